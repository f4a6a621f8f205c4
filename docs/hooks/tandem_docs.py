"""mkdocs hooks of Tandem's documentation site (mkdocs.yml names this file under `hooks:`).

1. The committed result files (experiments/results/*.png, *.json) stay where the
   experiments write them; they are not copied into docs/. A page links them by their real
   relative path (`../../experiments/results/smollm2_rg.png` from docs/results/x.md), which
   also works when the Markdown is read on a code host. At build time `on_files` adds each
   of those files to the site as `results/files/<name>`, and `on_page_markdown` rewrites
   every link that resolves into experiments/results/ to that site path. A link to a
   results file that does not exist is left pointing at `results/files/<name>`, which the
   strict build then reports as a link to a missing file.

2. Docstrings may hold index expressions such as `tokens[i][j]`, which Markdown reads as a
   reference link `[i][j]`; mkdocs-autorefs then warns that the identifier `j` is unknown,
   and the strict build would stop on prose, not on a broken reference. A logging filter
   drops exactly those warnings: an unresolved target of one lower-case letter (never an
   API name here). Every other unresolved reference still fails the build.
"""
from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

RESULTS_DIR = Path(__file__).resolve().parents[2] / "experiments" / "results"
SITE_RESULTS = "results/files"  # where the result files live in the built site
RESULT_SUFFIXES = (".png", ".json")
# [text](target) and ![alt](target); the target ends at whitespace or ")".
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
INDEX_REF = re.compile(r"Could not find cross-reference target '[a-z]'$")


class IndexExpressionFilter(logging.Filter):
    """Drops autorefs' warning about a one-letter target (an index like `x[i][j]`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("mkdocs.plugins.mkdocs_autorefs")
                    and INDEX_REF.search(record.getMessage()))


def on_config(config):
    # On mkdocs' own handlers (the console and the strict-mode warning counter, which
    # `mkdocs build` installs before it calls on_config): a filter on the autorefs logger
    # would miss records its child loggers emit.
    for handler in logging.getLogger("mkdocs").handlers:
        if not any(isinstance(f, IndexExpressionFilter) for f in handler.filters):
            handler.addFilter(IndexExpressionFilter())
    return config


def on_files(files, config):
    for path in sorted(RESULTS_DIR.iterdir()):
        if path.is_file() and path.suffix in RESULT_SUFFIXES:
            files.append(File.generated(config, f"{SITE_RESULTS}/{path.name}",
                                        abs_src_path=str(path)))
    return files


def site_link(target: str, page_src_uri: str, docs_dir: Path) -> str | None:
    """The site-relative replacement of `target` (a link written on the page at
    `page_src_uri`) when it points into experiments/results/, else None."""
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return None
    path, _, anchor = target.partition("#")
    page_dir = (docs_dir / page_src_uri).parent
    resolved = Path(os.path.normpath(page_dir / path))
    if resolved.parent != RESULTS_DIR:
        return None
    new = posixpath.relpath(f"{SITE_RESULTS}/{resolved.name}",
                            posixpath.dirname(page_src_uri) or ".")
    return new + (f"#{anchor}" if anchor else "")


def on_page_markdown(markdown, page, config, files):
    docs_dir = Path(config.docs_dir).resolve()

    def rewrite(match: re.Match) -> str:
        new = site_link(match.group(2), page.file.src_uri, docs_dir)
        return match.group(0) if new is None else match.group(1) + new + match.group(3)

    return LINK.sub(rewrite, markdown)
