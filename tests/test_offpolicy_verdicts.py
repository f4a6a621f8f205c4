"""The shared verdict rule on hand-built cells: 2 seeds x 200 problems of 0/1 outcomes whose
means are set exactly, so every kept share and every verdict is known beforehand."""
import numpy as np
import pytest

from experiments.common.offpolicy_verdicts import KEPT, verdicts_from_tables


def outcomes(mean: float, problems: int = 200, seed: int = 0) -> np.ndarray:
    """0/1 outcomes with exactly round(mean * problems) ones, in a seeded order."""
    x = np.zeros(problems)
    x[: round(mean * problems)] = 1.0
    return np.random.default_rng(seed).permutation(x)


def cell(final: float, initial: float = 0.1) -> dict[int, dict]:
    return {s: {"initial": outcomes(initial, seed=100 + s), "final": outcomes(final, seed=s)}
            for s in (0, 1)}


def test_kept_share_and_verdicts_follow_the_rule():
    cells = {("naive", 0): cell(0.6), ("naive", 8): cell(0.2),      # naive keeps 0.2 of G
             ("decoupled", 8): cell(0.6),                           # keeps all: holds
             ("m2po", 8): cell(0.22),                               # no better than naive
             ("icepop", 0): cell(0.6)}                              # only at k = 0: untested
    found = verdicts_from_tables(cells)
    rows = {(r["method"], r["k"]): r for r in found["rows"]}
    assert found["sync_gain"] == pytest.approx(0.5)
    assert rows[("naive", 8)]["kept"]["value"] == pytest.approx((0.2 - 0.1) / 0.5)
    assert rows[("naive", 8)]["kept"]["high"] < KEPT and found["staleness_hurts_at"] == [8]
    assert rows[("decoupled", 8)]["vs_naive"]["value"] == pytest.approx(0.4)
    assert found["verdicts"] == {"decoupled": "reproduced", "m2po": "not", "icepop": "untested"}


def test_nothing_hurts_when_naive_keeps_the_gain():
    cells = {("naive", 0): cell(0.6), ("naive", 8): cell(0.58), ("decoupled", 8): cell(0.6)}
    found = verdicts_from_tables(cells)
    assert found["staleness_hurts_at"] == [] and found["verdicts"] == {"decoupled": "untested"}


def test_a_method_that_beats_naive_but_keeps_too_little_does_not_hold():
    cells = {("naive", 0): cell(0.6), ("naive", 8): cell(0.15), ("vcpo", 8): cell(0.35)}
    found = verdicts_from_tables(cells)
    assert next(r for r in found["rows"] if r["method"] == "vcpo")["vs_naive"]["low"] > 0
    assert found["verdicts"] == {"vcpo": "not"}  # kept 0.5 < 0.8


def test_no_synchronous_baseline_is_refused():
    with pytest.raises(ValueError, match="synchronous baseline"):
        verdicts_from_tables({("naive", 8): cell(0.2)})
