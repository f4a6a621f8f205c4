"""Which numbers on a docs page no committed JSON holds (issue 56, part 4).

A page's numbers are looked up in the JSON files under experiments/results/ that the page
names (a path or a link to a file, or a folder: every JSON under it), and, on a line
that links another results page (the index's and the README's rows), in that page's
files too. A number matches a value when the value,
possibly scaled by a unit factor (percent, milli, micro, kilo, mega, giga, per hour, per
minute, MiB, GiB), rounds to it at the number's own decimals. Left out: code (blocks and
`spans`), HTML comments, link targets, integers below 10 and years.

Scoping the search to the page's own files keeps coincidences rare: a search across every
committed JSON matches almost any number somewhere.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a number, maybe with thousands commas, not inside a word, path or version ("jax
# 0.10.2" holds none); "2.36x" and "186.7k" (looked up with the kilo factor) count, and
# so does a number ending a sentence
NUMBER = re.compile(
    r"(?<![\w.\-/#])[-−]?\d+(?:,\d{3})*(?:\.\d+)?(?=[xk]\b|[^\w/.]|\.(?!\d)|$)")
JSON_REF = re.compile(r"experiments/results/[\w/.\-]+\.json")
DIR_REF = re.compile(r"experiments/results/[\w.\-]+(?:/[\w.\-]+)*/(?![\w.\-])")
PAGE_LINK = re.compile(r"\(((?:docs/results/)?[\w\-]+\.md)\)")
SCALES = (1, 100, 1e-2, 1e3, 1e-3, 1e6, 1e-6, 1e9, 1e-9, 3600, 1 / 3600, 60, 1 / 60,
          2**20, 2**-20, 2**30, 2**-30)


def as_float(token: str) -> float:
    return float(token.replace(",", "").replace("−", "-"))


def json_values(obj, out: list[float]) -> list[float]:
    """Every number in a JSON tree, also those written inside its strings."""
    if isinstance(obj, bool):
        return out
    if isinstance(obj, (int, float)):
        out.append(float(obj))
    elif isinstance(obj, dict):
        for v in obj.values():
            json_values(v, out)
    elif isinstance(obj, list):
        for v in obj:
            json_values(v, out)
    elif isinstance(obj, str):
        out.extend(as_float(m.group()) for m in NUMBER.finditer(obj))
    return out


def prose(text: str) -> str:
    """The text a reader sees as prose: code, comments and link targets blanked (the
    line structure kept)."""
    blank = lambda m: "\n" * m.group().count("\n")  # noqa: E731
    text = re.sub(r"```.*?```", blank, text, flags=re.S)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    return re.sub(r"\]\([^)\n]*\)", "]", text)


def shown_as(value: float, token: str) -> bool:
    x = as_float(token)
    decimals = len(token.split(".")[1]) if "." in token else 0
    tol = 0.51 * 10.0 ** -decimals
    return any(abs(abs(round(value * s, decimals)) - abs(x)) < tol for s in SCALES)


def page_refs(text: str, root: Path = ROOT) -> list[Path]:
    """The JSON files a page names: by path, or every one under a folder it names."""
    files = {root / r for r in JSON_REF.findall(text)}
    for folder in DIR_REF.findall(text):
        files.update((root / folder).rglob("*.json"))
    return sorted(files)


def values_of(paths, cache: dict) -> list[float]:
    out: list[float] = []
    for p in paths:
        if p not in cache:
            cache[p] = json_values(json.loads(p.read_text()), []) if p.is_file() else []
        out.extend(cache[p])
    return out


def untraced(page: Path, root: Path = ROOT, per_line: bool = False) -> Counter:
    """Counter of the number tokens on `page` that none of its JSON files holds.
    per_line: a line's numbers are looked up only in the files that line names (and its
    linked pages'), not in every file the page names (the README: one page, many
    results)."""
    text = page.read_text()
    cache: dict = {}
    own = [] if per_line else page_refs(text, root)
    missing: Counter = Counter()
    for raw, line in zip(text.splitlines(), prose(text).splitlines()):
        scope = list(own) + (page_refs(raw, root) if per_line else [])
        for link in PAGE_LINK.findall(raw):
            linked = (page.parent / link) if (page.parent / link).is_file() else root / link
            if linked.is_file() and linked.resolve() != page.resolve():
                scope += page_refs(linked.read_text(), root)
        values = values_of(scope, cache)
        for m in NUMBER.finditer(line):
            token = m.group()
            x = as_float(token)
            if ("." not in token and abs(x) < 10) or re.fullmatch(r"(19|20)\d\d", token):
                continue
            if not any(shown_as(v, token) for v in values):
                missing[token] += 1
    return missing
