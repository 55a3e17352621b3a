"""Every relative link in README.md and docs/ resolves: the file exists and,
where the link names a section (``file.md#anchor``), the file has a heading
with that anchor (GitHub's rule: lower case, punctuation dropped, spaces to
hyphens). Code blocks and inline code are not links. Web links are not
fetched."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _anchors(markdown: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", markdown.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(document: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(_prose(document.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor '{anchor}' in {linked.name}")
    return broken


def test_readme_and_docs_links_resolve():
    problems = {
        str(doc.relative_to(ROOT)): found for doc in _documents() if (found := broken_links(doc))
    }
    assert not problems, f"broken links (fix the link or the heading): {problems}"


def test_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A section (2-D)\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](other.md#a-section-2-d) [gone](missing.md) [bad](other.md#nope) "
        "`[code](missing.md)` [web](https://example.com/x)\n"
    )
    assert broken_links(doc) == [
        f"missing.md: no file {tmp_path / 'missing.md'}",
        "other.md#nope: no heading with anchor 'nope' in other.md",
    ]
