"""The module table of docs/how-it-works.md ("The package, module by module")
lists the package as it is on disk:

- every ``.py`` file under ``composable_shard/`` has a row, named by its path
  from the repository root (```composable_shard/runtime/state.py```);
- no row names a file that does not exist, and no file has two rows;
- every module's docstring opens with ``Owns: ``;
- each row's text starts with the module's summary, which is read from the
  first paragraph of its docstring (whitespace collapsed): the text after
  ``Owns: `` up to the first `` — ``, ``: `` or ``; `` outside parentheses,
  brackets and ````code```` spans, or up to the end of its first sentence (a
  ``.`` followed by a space or the end), whichever comes first. The row may
  go on after the summary (to say more where it is short). A ``|`` in the
  summary is written ``\\|`` in the table.

So a module whose responsibility changes updates its "Owns:" line, and the
table follows it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "composable_shard"
DOC = ROOT / "docs" / "how-it-works.md"
SECTION = "### The package, module by module"
_ROW = re.compile(r"^\| `(composable_shard/[^`]+\.py)` \| (.*) \|\s*$")
_BREAKS = (" — ", ": ", "; ")


def owns_summary(docstring: str) -> str | None:
    """The summary of a module (the rule in this file's docstring); ``None``
    when the docstring does not open with ``Owns: ``."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    if not paragraph.startswith("Owns: "):
        return None
    text = paragraph[len("Owns: ") :]
    depth, in_code, i = 0, False, 0
    while i < len(text):
        if text.startswith("``", i):
            in_code = not in_code
            i += 2
            continue
        if not in_code:
            char = text[i]
            if char in "([":
                depth += 1
            elif char in ")]":
                depth -= 1
            elif depth == 0 and (text.startswith(_BREAKS, i) or (char == "." and text[i + 1 : i + 2] in ("", " "))):
                break
        i += 1
    return text[:i]


def module_files() -> list[str]:
    return sorted(str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py"))


def table_rows(markdown: str) -> list[tuple[str, str]]:
    """(path, text) of every row of the module table."""
    assert SECTION in markdown, f"{DOC} has no section {SECTION!r}"
    section = markdown.split(SECTION, 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        match = _ROW.match(line)
        if match is not None:
            rows.append((match.group(1), match.group(2).replace("\\|", "|")))
    return rows


def table_problems(rows: list[tuple[str, str]], files: list[str], root: Path) -> list[str]:
    problems = []
    paths = [path for path, _ in rows]
    problems += [f"{path}: no row in the table" for path in files if path not in paths]
    problems += [f"{path}: a row, but no such file" for path in paths if path not in files]
    problems += [f"{path}: {paths.count(path)} rows" for path in sorted(set(paths)) if paths.count(path) > 1]
    for path, text in rows:
        if path not in files:
            continue
        docstring = ast.get_docstring(ast.parse((root / path).read_text())) or ""
        summary = owns_summary(docstring)
        if summary is None:
            problems.append(f"{path}: its docstring does not open with 'Owns: '")
        elif not text.startswith(summary):
            problems.append(f"{path}: the row should start with its 'Owns:' summary {summary!r}, it reads {text!r}")
    return problems


def test_the_module_table_lists_every_module_with_its_owns_summary() -> None:
    problems = table_problems(table_rows(DOC.read_text()), module_files(), ROOT)
    assert not problems, f"{DOC.relative_to(ROOT)}, {SECTION!r}:\n" + "\n".join(problems)


def test_the_check_names_missing_extra_and_stale_rows(tmp_path: Path) -> None:
    package = tmp_path / "composable_shard"
    package.mkdir()
    (package / "a.py").write_text('"""Owns: the a things — and more.\n\nKnows nothing of: b."""\n')
    (package / "b.py").write_text('"""Owns: b (in brackets: kept). More."""\n')
    (package / "c.py").write_text('"""No owns line."""\n')
    files = ["composable_shard/a.py", "composable_shard/b.py", "composable_shard/c.py"]
    markdown = (
        f"{SECTION}\n\n| module | owns |\n|---|---|\n"
        "| `composable_shard/a.py` | the a things, said at length |\n"
        "| `composable_shard/b.py` | b (in brackets: changed) |\n"
        "| `composable_shard/c.py` | c |\n"
        "| `composable_shard/gone.py` | gone |\n\n## Next\n| `composable_shard/after.py` | x |\n"
    )
    rows = table_rows(markdown)
    assert [path for path, _ in rows][-1] == "composable_shard/gone.py"
    assert table_problems(rows, files + ["composable_shard/new.py"], tmp_path) == [
        "composable_shard/new.py: no row in the table",
        "composable_shard/gone.py: a row, but no such file",
        "composable_shard/b.py: the row should start with its 'Owns:' summary 'b (in brackets: kept)', "
        "it reads 'b (in brackets: changed)'",
        "composable_shard/c.py: its docstring does not open with 'Owns: '",
    ]
    assert owns_summary("Owns: ``x. y`` and z; more") == "``x. y`` and z"
