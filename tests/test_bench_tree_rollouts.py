"""The tree-rollout benchmark's arithmetic on hand-made rows (learner tokens per leaf of
the three layouts, decoded tokens, mixed-reward shares) and its committed page = its JSON
rendered."""
import json

import pytest

from experiments.bench import tree_rollouts as bench


def rows():
    # one seed, two prompts; LATR: 2 and 4 distinct leaves, independent: 8 each
    latr = [[{"leaves": 2, "prompt_tokens": 10, "response_tokens": 12, "decoded_tokens": 9,
              "tree_tokens": 19, "fork_fractions": [0.25], "rewards": [0.0, 1.0],
              "seconds": 1.0},
             {"leaves": 4, "prompt_tokens": 6, "response_tokens": 20, "decoded_tokens": 14,
              "tree_tokens": 20, "fork_fractions": [0.1, 0.5, 0.9],
              "rewards": [1.0, 1.0, 1.0, 1.0], "seconds": 2.0}]]
    indep = [[{"leaves": 8, "prompt_tokens": 10, "response_tokens": 40, "decoded_tokens": 40,
               "rewards": [0.0] * 8, "seconds": 1.0},
              {"leaves": 8, "prompt_tokens": 6, "response_tokens": 48, "decoded_tokens": 48,
               "rewards": [0.0] * 7 + [1.0], "seconds": 1.0}]]
    return latr, indep


def test_ratios_are_ratios_of_totals_per_leaf():
    s = bench.summarise(*rows())
    tree_per_leaf = (19 + 20) / 6
    independent = (8 * 10 + 40 + 8 * 6 + 48) / 16
    shared = (10 + 40 + 6 + 48) / 16
    assert s["learner_tokens_per_leaf"]["latr_tree"] == pytest.approx(tree_per_leaf)
    assert s["learner_ratio_vs_independent_sequences"]["value"] == pytest.approx(
        independent / tree_per_leaf)
    assert s["learner_ratio_vs_prompt_shared"]["value"] == pytest.approx(shared / tree_per_leaf)
    same = (2 * 10 + 12 + 4 * 6 + 20) / 6
    assert s["learner_ratio_same_leaves_independent_vs_tree"]["value"] == pytest.approx(
        same / tree_per_leaf)
    assert s["decoded_ratio_independent_vs_latr"]["value"] == pytest.approx(
        (88 / 16) / (23 / 6))
    assert s["mixed_reward_share"]["latr"] == 0.5 and s["mixed_reward_share"]["independent"] == 0.5
    assert s["forks"]["count"] == 4 and s["forks"]["fraction_in_first_third"] == 0.5


def test_the_committed_page_is_its_json_rendered():
    assert bench.RESULT.is_file(), "the committed result (python -m experiments.bench.tree_rollouts)"
    result = json.loads(bench.RESULT.read_text())
    assert bench.PAGE.read_text() == bench.render_page(result)
    index = (bench.PAGE.parent / "index.md").read_text().splitlines()
    assert bench.summary_row(result, "tree-rollouts.md", index=True) in index
