"""Every number on a results page (and in the README) is one a committed JSON holds
(issue 56, part 4), looked up in the files the page names (tests/page_numbers.py).

The pages written before this check still show numbers no file holds: they are listed,
page by page, in tests/data/untraced_page_numbers.json, a debt that can only shrink. A
number not on that list fails, and so does an entry the page no longer needs (fix a page,
then drop its entries)."""
import json
from collections import Counter

import pytest

from tests.page_numbers import ROOT, untraced

DEBT = ROOT / "tests/data/untraced_page_numbers.json"
PAGES = sorted((ROOT / "docs/results").glob("*.md")) + [ROOT / "README.md"]


def known() -> dict[str, dict[str, int]]:
    return json.loads(DEBT.read_text())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_numbers_on_the_page_come_from_its_json(page):
    name = page.relative_to(ROOT).as_posix()
    found = untraced(page, per_line=page.name == "README.md")
    listed = Counter(known().get(name, {}))
    new, fixed = found - listed, listed - found
    assert not new, (f"{name}: numbers no JSON it names holds: {dict(new)}; take them from "
                     "the committed result (name its experiments/results/*.json on the page) "
                     "or drop them")
    assert not fixed, (f"{name}: listed as untraced in {DEBT.name} but traced or gone now: "
                       f"{dict(fixed)}; remove them from the list")


def test_per_line_scope_looks_only_in_the_lines_own_files(tmp_path):
    results = tmp_path / "experiments/results"
    results.mkdir(parents=True)
    (results / "a.json").write_text(json.dumps({"v": 0.25}))
    page = tmp_path / "README.md"
    page.write_text("A: 0.25 (experiments/results/a.json).\nB: 0.25, no file named.\n")
    assert untraced(page, tmp_path) == Counter()
    assert untraced(page, tmp_path, per_line=True) == Counter({"0.25": 1})


def test_the_debt_names_only_pages_that_exist():
    assert {ROOT / n for n in known()} <= set(PAGES)


def test_the_check_finds_an_untraced_number_and_accepts_a_rounded_one(tmp_path):
    results = tmp_path / "experiments/results"
    results.mkdir(parents=True)
    (results / "bench_x.json").write_text(json.dumps(
        {"headline": {"value": 1.2346, "note": "seen at 17.5 s"}, "ms": 0.0312}))
    page = tmp_path / "x.md"
    page.write_text("# X\n\nFrom experiments/results/bench_x.json: 1.23x, 31.2 ms, 17.5 s, "
                    "98.7 % and 42 steps.\n\n```\n55.5\n```\n`66.6`, year 2026, 3 seeds.\n")
    assert untraced(page, tmp_path) == Counter({"98.7": 1, "42": 1})
    (page.parent / "row.md").write_text("| [X](x.md) | 1.235 | 4.56 |\n")
    assert untraced(page.parent / "row.md", tmp_path) == Counter({"4.56": 1})
    (results / "cells").mkdir()
    (results / "cells" / "k8_s0.json").write_text(json.dumps({"final": 0.4567}))
    folder = tmp_path / "folder.md"
    folder.write_text("Cells in experiments/results/cells/: 0.457 and 0.458.\n")
    assert untraced(folder, tmp_path) == Counter({"0.458": 1})
    (results / "bench_x.json").unlink()  # a page naming a file that is not there
    assert untraced(page, tmp_path) == Counter({"1.23": 1, "31.2": 1, "17.5": 1,
                                                "98.7": 1, "42": 1})


def test_versions_are_not_numbers_and_a_kilo_suffix_is_looked_up_scaled(tmp_path):
    results = tmp_path / "experiments/results"
    results.mkdir(parents=True)
    (results / "r.json").write_text(json.dumps({"tok_s": 12540.0, "jax": "0.10.2"}))
    page = tmp_path / "p.md"
    page.write_text("From experiments/results/r.json: jax 0.10.2 and 4.11.9 give 12.5k tok/s, "
                    "not 7.7k; it ends at 12.54.\n")
    assert untraced(page, tmp_path) == Counter({"7.7": 1})
