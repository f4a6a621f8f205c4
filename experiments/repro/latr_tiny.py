"""LATR vs GRPO on the off-policy testbed: does a tree rollout make a policy learn faster?

    python -m experiments.repro.latr_tiny sweep [--seeds 0 1 2] [--max-cells N]   # resumable
    python -m experiments.repro.latr_tiny report     # JSON, PNG, page, README / index rows

The task and learner are the off-policy testbed's (experiments.common.testbed.Setup: a
tiny policy from scratch, SyntheticTask "shift" with 32-token responses over 4 symbols,
reward = the share of correct positions, 400 steps of 8 prompts x 8 samples, AdamW 1e-3,
greedy evals of 512 held-out problems every 50 steps), in the synchronous loop. Two
methods, the same seeds (the same initial policy and prompt stream):

- grpo: every sample an independent chain (the tiny-synthetic preset's GRPO);
- latr: each group grown as a LATR tree (rl.rollout.latr, the authors' defaults:
  τ_abs = τ_rel = 0.2, m = 2, lookahead 20/30/50, δ = 0.4) and trained tree-packed
  (TrainConfig.tree);
- latr_mix: the same with mix_ratio 0.5 (4 of a group's 8 samples grown as the tree, 4
  independent). Added after the first latr cell, and before any latr_mix cell ran: a
  policy from scratch has a near-uniform next-token distribution, so no candidate passes
  τ_abs, the default tree never branches, every group is its greedy path repeated 8 times
  (all rewards equal: no GRPO signal) and the policy never moves. With half the group
  independent the policy learns, sharpens, and the tree starts to branch.

A finished cell's record (every eval's per-problem greedy reward, the cumulative tokens
decoded and training seconds at each eval, the train curves) goes to
experiments/results/latr_tiny/<method>_s<seed>.json; a cell with a record is skipped.

The rule, fixed before any cell ran and applied to each LATR arm against GRPO (the paper reports LATR learning 131 % faster, i.e. a
speed-up of 2.31 in steps to a given accuracy):
  S            GRPO's final greedy reward (mean over the seeds, step 400)
  t_LATR       the first eval step at which LATR's seed-mean greedy reward reaches S
  speed-up     400 / t_LATR in steps (and the same ratio in tokens decoded and in
               training seconds, at the two runs' cumulative counts)
  reproduced   t_LATR <= 400 / 2.31 and the paired 95 % interval of (LATR - GRPO) at that
               eval (over seeds and problems) lies above 0
  partly       LATR reaches S before step 400, or the paired interval at step 400 lies
               above 0
  not          otherwise
The share of groups with mixed rewards is reported beside it (on this task rewards are
shares of positions, so almost every group is mixed for both).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common.docs_rows import replace_row
from experiments.common.paired import paired_bootstrap, problem_results
from experiments.common.testbed import Setup
from rl.runtime.host import machine
from rl.runtime.logging import atomic_write_json

NAME = "latr_tiny"
RESULTS = Path("experiments/results")
CELLS_DIR = RESULTS / NAME
RESULT = RESULTS / f"{NAME}.json"
PAGE = Path("docs/results/latr-tiny.md")
README, INDEX = Path("README.md"), Path("docs/results/index.md")
WORK_DIR = Path("runs") / NAME
TITLE, ROW_AFTER = "LATR vs GRPO (tiny)", "Tree rollouts (LATR)"
SETUP = Setup()
METHODS = ("grpo", "latr", "latr_mix")
ARMS = METHODS[1:]  # each judged against grpo
MIX = 0.5  # latr_mix's share of the group grown as the tree
SEEDS = (0, 1, 2)
CLAIM = 2.31  # LATR's reported learning speed-up (131 % faster)
TRAIN_KEYS = ("reward_mean", "zero_spread_frac", "sampled_tokens", "step_s", "tree_branches",
              "tree_filled", "tree_decoded_per_leaf_token", "learner_packing_ratio")


def cell_name(method: str, seed: int) -> str:
    return f"{method}_s{seed}"


def cell_config(setup: Setup, method: str, seed: int, run_dir: Path):
    """The RunConfig of one (method, seed) cell (module doc)."""
    from rl.rollout.latr import LatrConfig
    from rl.run import PRESETS

    cfg = PRESETS["tiny-synthetic"].overrides({**setup.paths(), "loop.seed": seed,
                                                "model.init_seed": seed,
                                                "run_dir": str(run_dir)})
    cfg = dataclasses.replace(cfg, name=f"latr-tiny-{cell_name(method, seed)}")
    if method in ARMS:
        latr = LatrConfig() if method == "latr" else LatrConfig(mix_ratio=MIX)
        cfg = dataclasses.replace(cfg, latr=latr, train=dataclasses.replace(
            cfg.train, tree=True, packed=False))
    return cfg


def cell_record(setup: Setup, method: str, seed: int, run_dir: Path, wall_s: float) -> dict:
    """A finished cell's record: per-problem greedy reward at every eval, cumulative decoded
    tokens and training seconds at each eval step, train curves."""
    res = problem_results(run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    steps = sorted(res)
    # tokens decoded (a tree decodes each shared prefix once; its repeated rows not at all)
    tokens = np.cumsum([float(r.get("tree_decoded_tokens", r.get("sampled_tokens", 0.0)))
                        for r in train])
    seconds = np.cumsum([float(r.get("step_s", 0.0)) for r in train])
    done = np.asarray([int(r["step"]) for r in train])

    def upto(values, step):  # cumulative value after `step` train steps
        k = int(np.searchsorted(done, step, side="right"))
        return float(values[k - 1]) if k else 0.0

    return {"method": method, "seed": seed, "setup": dataclasses.asdict(setup),
            "eval_steps": steps,
            "eval_problems": {str(s): [res[s]["greedy"][i] for i in sorted(res[s]["greedy"])]
                              for s in steps},
            "tokens_at_eval": [upto(tokens, s) for s in steps],
            "seconds_at_eval": [upto(seconds, s) for s in steps],
            "train_keys": ["step", *TRAIN_KEYS],
            "train": [[r["step"], *(None if r.get(k) is None else round(float(r[k]), 5)
                                    for k in TRAIN_KEYS)] for r in train[::5]],
            "wall_s": round(wall_s, 1), "machine": machine()}


def sweep(seeds, max_cells: int | None, setup: Setup = SETUP, cells_dir: Path = CELLS_DIR,
          work_dir: Path = WORK_DIR) -> None:
    """Train every missing cell, seed by seed (both methods of a seed back to back, so load
    from other jobs hits them alike); the report is rewritten after each committed cell."""
    import shutil

    from rl.run import train

    todo = [(m, s) for s in seeds for m in METHODS
            if not (cells_dir / f"{cell_name(m, s)}.json").is_file()]
    cells_dir.mkdir(parents=True, exist_ok=True)
    for i, (m, s) in enumerate(todo[:max_cells]):
        run_dir = work_dir / cell_name(m, s)
        shutil.rmtree(run_dir, ignore_errors=True)  # minutes a cell: an unfinished one restarts
        t0 = time.perf_counter()
        train(cell_config(setup, m, s, run_dir))
        rec = cell_record(setup, m, s, run_dir, time.perf_counter() - t0)
        atomic_write_json(cells_dir / f"{cell_name(m, s)}.json", rec)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        final = np.mean(rec["eval_problems"][str(rec["eval_steps"][-1])])
        print(f"[{i + 1}/{len(todo)}] {cell_name(m, s)}: greedy reward {final:.3f} "
              f"({rec['wall_s']} s)", file=sys.stderr, flush=True)
        if cells_dir == CELLS_DIR and all((cells_dir / f"{cell_name(x, s)}.json").is_file()
                                          for x in ("grpo", "latr")):
            report()


# ----------------------------------------------------------------------------- report
def load_cells(cells_dir: Path = CELLS_DIR) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for f in sorted(cells_dir.glob("*.json")):
        r = json.loads(f.read_text())
        out.setdefault(r["method"], {})[r["seed"]] = r
    return out


def analyse(cells: dict[str, dict[int, dict]], arm: str = "latr") -> dict:
    """The rule's numbers (module doc) for one LATR arm against GRPO, over the seeds both
    finished (the keys say "latr" for the arm)."""
    seeds = sorted(set(cells.get("grpo", {})) & set(cells.get(arm, {})))
    if not seeds:
        raise ValueError(f"no seed has both grpo and {arm} finished")
    g, lt = [cells["grpo"][s] for s in seeds], [cells[arm][s] for s in seeds]
    steps = g[0]["eval_steps"]

    def table(recs, step):  # [seeds, problems]
        return np.asarray([r["eval_problems"][str(step)] for r in recs], np.float64)

    def mean_at(recs, key, i):
        return float(np.mean([r[key][i] for r in recs]))

    curve = {m: [float(table(recs, s).mean()) for s in steps] for m, recs in
             (("grpo", g), ("latr", lt))}
    diffs = [paired_bootstrap(table(lt, s), table(g, s)).as_dict() for s in steps]
    target = curve["grpo"][-1]
    reach = next((i for i, v in enumerate(curve["latr"]) if v >= target and steps[i] > 0), None)
    last = len(steps) - 1
    speed = None
    if reach is not None:
        speed = {"steps": steps[last] / steps[reach],
                 "decoded_tokens": mean_at(g, "tokens_at_eval", last)
                 / max(mean_at(lt, "tokens_at_eval", reach), 1.0),
                 "seconds": mean_at(g, "seconds_at_eval", last)
                 / max(mean_at(lt, "seconds_at_eval", reach), 1e-9)}
    if reach is not None and steps[reach] <= steps[last] / CLAIM and diffs[reach]["low"] > 0:
        verdict = "reproduced"
    elif (reach is not None and reach < last) or diffs[last]["low"] > 0:
        verdict = "partly"
    else:
        verdict = "not"

    def train_mean(recs, key):
        i = ["step", *TRAIN_KEYS].index(key)
        vals = [row[i] for r in recs for row in r["train"] if row[i] is not None]
        return float(np.mean(vals)) if vals else None

    return {"seeds": seeds, "eval_steps": steps, "curve": curve, "diff_latr_minus_grpo": diffs,
            "grpo_final": target, "latr_reaches_at": None if reach is None else steps[reach],
            "speedup": speed, "verdict": verdict,
            "tokens_at_eval": {m: [mean_at(r, "tokens_at_eval", i) for i in range(len(steps))]
                               for m, r in (("grpo", g), ("latr", lt))},
            "seconds_at_eval": {m: [mean_at(r, "seconds_at_eval", i) for i in range(len(steps))]
                                for m, r in (("grpo", g), ("latr", lt))},
            "mixed_share": {m: 1 - train_mean(r, "zero_spread_frac") for m, r in
                            (("grpo", g), ("latr", lt))},
            "latr_tree": {k: train_mean(lt, k) for k in ("tree_branches", "tree_filled",
                                                          "tree_decoded_per_leaf_token",
                                                          "learner_packing_ratio")},
            "wall_s": {m: float(np.mean([r["wall_s"] for r in recs])) for m, recs in
                       (("grpo", g), ("latr", lt))},
            "machine": g[0]["machine"]}


def report(cells_dir: Path = CELLS_DIR, out: Path = RESULT, page: bool = True) -> dict:
    cells = load_cells(cells_dir)
    arms = {a: analyse(cells, a) for a in ARMS
            if set(cells.get("grpo", {})) & set(cells.get(a, {}))}
    if "latr" not in arms:
        raise SystemExit("no seed has grpo and latr finished: run the sweep first")
    found = arms["latr"]
    d = found["diff_latr_minus_grpo"][-1]
    result = {"headline": {"metric": "LATR (the authors' defaults) - GRPO greedy reward at "
                                     f"step {found['eval_steps'][-1]} (tiny testbed, paired)",
                           "value": d["value"], "target": 0.0, "machine": found["machine"],
                           "low": d["low"], "high": d["high"], "verdict": found["verdict"]},
              "setup": dataclasses.asdict(SETUP), "claim_speedup": CLAIM, "mix_ratio": MIX,
              "command": f"python -m experiments.repro.{NAME} report", **found,
              "arms": arms}
    atomic_write_json(out, result)
    plot(result, out.with_suffix(".png"))
    if page:
        PAGE.write_text(render_page(result))
        replace_row(README, summary_row(result, f"docs/results/{PAGE.name}"), TITLE, ROW_AFTER)
        replace_row(INDEX, summary_row(result, PAGE.name, index=True), TITLE, ROW_AFTER)
    return result


LABEL = {"latr": "LATR (defaults)", "latr_mix": f"LATR, mix {MIX:g}"}


def arm_phrase(name: str, a: dict) -> str:
    d, sp = a["diff_latr_minus_grpo"][-1], a["speedup"]
    reach = ("never reaches GRPO's final" if sp is None else
             f"reaches GRPO's final at step {a['latr_reaches_at']} ({sp['steps']:.2f}× in "
             f"steps, {sp['seconds']:.2f}× in training time)")
    return (f"{LABEL[name]} {a['curve']['latr'][-1]:.3f}, paired {d['value']:+.3f} "
            f"[{d['low']:+.3f}, {d['high']:+.3f}], {reach}")


def summary_row(result: dict, link: str, index: bool = False) -> str:
    arms = result["arms"]
    first = next(iter(arms.values()))
    text = (f"| [{TITLE}]({link}) | a tiny policy from scratch, {len(first['seeds'])} seeds, "
            f"greedy reward at step {first['eval_steps'][-1]}: GRPO "
            f"{first['curve']['grpo'][-1]:.3f}; " + "; ".join(
                arm_phrase(n, a) for n, a in arms.items()) + " |")
    if not index:
        return text
    verdicts = ", ".join(f"{LABEL[n]}: {a['verdict']}" for n, a in arms.items())
    return text + f" {CLAIM:g}× faster (the paper's +131 %) | {verdicts} |"


def arm_section(name: str, a: dict) -> str:
    steps, c = a["eval_steps"], a["curve"]
    rows = []
    for i, s in enumerate(steps):
        d = a["diff_latr_minus_grpo"][i]
        rows.append(f"| {s} | {c['grpo'][i]:.3f} | {c['latr'][i]:.3f} | {d['value']:+.3f} "
                    f"[{d['low']:+.3f}, {d['high']:+.3f}] | "
                    f"{a['tokens_at_eval']['grpo'][i]:.0f} / {a['tokens_at_eval']['latr'][i]:.0f} | "
                    f"{a['seconds_at_eval']['grpo'][i]:.0f} / {a['seconds_at_eval']['latr'][i]:.0f} |")
    sp, tree = a["speedup"], a["latr_tree"]
    speed = (f"{LABEL[name]} never reaches GRPO's final reward in the run." if sp is None else
             f"{LABEL[name]} reaches GRPO's final reward ({a['grpo_final']:.3f}) at step "
             f"{a['latr_reaches_at']}: a speed-up of {sp['steps']:.2f}× in steps, "
             f"{sp['decoded_tokens']:.2f}× in decoded tokens and {sp['seconds']:.2f}× in "
             "training seconds.")

    def fmt(x, f=".2f"):
        return "n/a" if x is None else format(x, f)
    return f"""## {LABEL[name]} against GRPO ({len(a['seeds'])} seeds)

| step | GRPO | {LABEL[name]} | difference | decoded tokens GRPO / LATR | training s GRPO / LATR |
|---|---|---|---|---|---|
{chr(10).join(rows)}

{speed} **Verdict: {a['verdict']}.** Groups with mixed rewards: GRPO
{fmt(a['mixed_share']['grpo'], '.3f')}, {LABEL[name]} {fmt(a['mixed_share']['latr'], '.3f')}.
The trees: {fmt(tree['tree_branches'], '.1f')} branches a batch,
{fmt(tree['tree_filled'], '.1f')} rows a batch repeating a tree's first leaf,
{fmt(tree['tree_decoded_per_leaf_token'], '.3f')} tokens decoded per leaf token; the
learner's trees hold {fmt(tree['learner_packing_ratio'])}× fewer tokens than its rows.
Whole-run wall time: GRPO {a['wall_s']['grpo']:.0f} s, {LABEL[name]} {a['wall_s']['latr']:.0f} s.
"""


def render_page(result: dict) -> str:
    st, steps = result["setup"], result["eval_steps"]
    sections = "\n".join(arm_section(n, a) for n, a in result["arms"].items())
    return f"""# LATR vs GRPO on the tiny testbed

<!-- generated by `python -m experiments.repro.{NAME} report` from
experiments/results/{NAME}.json; do not edit by hand -->

Does growing each group as a LATR tree make a policy learn faster? The off-policy testbed's
task and learner (a tiny policy from scratch on 32-token "shift" responses, reward = the
share of correct positions, {st['steps']} steps of {st['prompts_per_step']} prompts ×
{st['group_size']} samples), synchronous, the same seeds (the same initial policy and
prompts) for every method: GRPO with independent samples against LATR trained tree-packed
(`--latr --tree-batches`), with the authors' defaults and with mix_ratio {MIX:g} (half of
each group independent; added after the first LATR cell showed the default tree never
branching from scratch, before any of its cells ran). Greedy reward on {st['eval_prompts']}
held-out problems; intervals: 95 %, paired bootstrap over seeds and problems.
Machine: {result['machine']}.

**The rule** (fixed before any cell ran): S = GRPO's final greedy reward; t = the first
eval step at which the LATR arm's seed-mean reaches S. Reproduced (the paper's +131 %, a
{CLAIM:g}× speed-up) when t ≤ {steps[-1]} / {CLAIM:g} and the paired interval of
LATR − GRPO at t lies above 0; partly when it reaches S before the last step or the paired
interval at the last step lies above 0; not otherwise.

{sections}
Why the default tree cannot learn from scratch: a random policy's next-token distribution
is near uniform, so no candidate passes τ_abs = {0.2:g}; LATR takes the most likely token
while the tree is not full, so a tree that never branches is one greedy path, repeated to
fill the group (the authors' rule): every reward of the group is equal and GRPO's advantage
is zero.

![greedy reward by step, decoded tokens and training time](../../experiments/results/{NAME}.png)

Command: `python -m experiments.repro.{NAME} sweep` then `report`.
"""


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common.plots import save_png

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    colors = {"grpo": "tab:blue", "latr": "tab:red", "latr_mix": "tab:green"}
    lines = {"grpo": next(iter(result["arms"].values()))}
    lines.update(result["arms"])
    for name, a in lines.items():
        side = "grpo" if name == "grpo" else "latr"
        for ax, x in zip(axes, (a["eval_steps"], a["tokens_at_eval"][side],
                                a["seconds_at_eval"][side])):
            ax.plot(x, a["curve"][side], marker="o", color=colors[name],
                    label="GRPO" if name == "grpo" else LABEL[name])
    grpo_final = lines["grpo"]["grpo_final"]
    for ax, label in zip(axes, ("step", "tokens decoded", "training seconds")):
        ax.axhline(grpo_final, ls="--", c="gray", lw=1)
        ax.set_xlabel(label)
    axes[0].set_ylabel("greedy reward (seed mean)")
    axes[0].legend(fontsize=8)
    fig.suptitle("LATR vs GRPO, tiny testbed", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m experiments.repro.{NAME}",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="train the missing cells (resumable)")
    s.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    s.add_argument("--max-cells", type=int)
    sub.add_parser("report")
    args = p.parse_args(argv)
    if args.cmd == "sweep":
        sweep(args.seeds, args.max_cells)
    else:
        r = report()
        print(json.dumps({a: {k: v[k] for k in ("curve", "speedup", "verdict")}
                          for a, v in r["arms"].items()}, indent=1))


if __name__ == "__main__":
    main()
