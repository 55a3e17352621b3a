"""Owns: writing a table as GitHub-flavoured Markdown (``--markdown``), so
the tables in ``docs/benchmarks.md`` can be regenerated from a run, or as
plain text with right-aligned columns (a subcommand's titled table, either
way: ``titled_table``).

Knows nothing of: what the cells mean (the callers format every number
exactly as in the plain-text table).
"""

from __future__ import annotations


def _cell(text: str) -> str:
    return text.strip().replace("|", "\\|") or " "


def markdown_table(header: list[str], rows: list[list[str]], right_aligned: set[int] | None = None) -> str:
    """A header row, the alignment row (columns in ``right_aligned``, by
    index, are numbers: right-aligned) and one line per row."""
    right = right_aligned or set()
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells, the header {len(header)}: {row}")
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |"]
    lines.append("|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|")
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def titled_table(title: str, header: list[str], rows: list[list[str]], *, markdown: bool) -> str:
    """``title`` then the table: Markdown (every column but the first
    right-aligned) or plain text, each column as wide as its widest cell."""
    if markdown:
        return f"{title}\n\n{markdown_table(header, rows, set(range(1, len(header))))}"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
