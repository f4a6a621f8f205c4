"""A results table's row, rewritten in place by the script whose JSON it reports.

README.md and docs/results/index.md hold one row per result, each a markdown table line
that links its page as `[Title](...)`. A script that regenerates its page puts its row in
place of the line that links the same title, or, the first time, after the line that
links `after`.
"""
from __future__ import annotations

from pathlib import Path


def add_docs_only_flag(parser) -> None:
    """--docs-only: regenerate a script's page and rows from its committed JSON."""
    parser.add_argument("--docs-only", action="store_true",
                        help="regenerate the page and the README / index rows from the "
                             "committed JSON")


def docs_from_json(path: Path, write_docs) -> dict:
    """write_docs(the JSON at `path`) and return it (a script's --docs-only)."""
    import json

    result = json.loads(Path(path).read_text())
    write_docs(result)
    return result


def replace_row(path: Path, row: str, title: str, after: str) -> None:
    """Put `row` in place of the table line of `path` linking `[title](`, or insert it
    after the line linking `[after](` when there is none yet."""
    lines = Path(path).read_text().splitlines()
    at = next((i for i, x in enumerate(lines) if f"[{title}](" in x), None)
    if at is not None:
        lines[at] = row
    else:
        anchor = next((i for i, x in enumerate(lines) if f"[{after}](" in x), None)
        if anchor is None:
            raise ValueError(f"{path}: no row links [{title}] or [{after}]; add the table row "
                             "by hand once")
        lines.insert(anchor + 1, row)
    Path(path).write_text("\n".join(lines) + "\n")


def write_page_and_rows(page: Path, text: str, summary_row, title: str, after: str) -> None:
    """A results page and its two table rows: `text` into docs/results/<page>, then the
    README row (summary_row(link to docs/results/<page>)) and the results index row
    (summary_row(link to <page>, index=True)), each by `title`, placed after `after` the
    first time (replace_row). The README and index are the ones beside `page`."""
    page.write_text(text)
    root = page.parents[2]
    replace_row(root / "README.md", summary_row(f"docs/results/{page.name}"), title, after)
    replace_row(page.parent / "index.md", summary_row(page.name, index=True), title, after)
