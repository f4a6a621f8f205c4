"""SmolLM2-135M-Instruct with a calculator tool: accuracy without it, with it, and after GRPO.

    python -m experiments.repro.calculator_tool base           # base accuracies (N held-out)
    python -m experiments.repro.calculator_tool grpo --run-dir runs/calc -- --steps 40
    python -m experiments.repro.calculator_tool report --run-dir runs/calc

`base`: the held-out problems of rl.envs.CalculatorEnv (3-4 digit a*b, a+b+c, a*b+c; the
first N of the eval split; `--env-option K=V` changes the environment, e.g. the
multi-call variant ops_per_call=1), greedy, through the library's multi-turn engine
(rl.rollout.multiturn.MultiTurnEngine): once with tool=False (one turn, the model must
compute the answer itself) and once with the <calc> tool (up to max_turns turns). Records
accuracy (outcome "correct"), the share of episodes that called the tool, tool calls per
episode, end reasons, and per problem kind; writes <out>.base.json.
`grpo`: `experiments.train --preset smollm2-calc` (GRPO on the tool environment; the
loop's greedy eval on the same N held-out problems every few steps logs accuracy and
episode_tool_calls) in --run-dir, under the real-model lock the caller takes.
`report`: the JSON (headline: greedy accuracy with the tool after GRPO vs before) and a
PNG from the base file and the run's metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common.benchmarking import machine, results_path
from experiments.common.flags import parse_task_options
from experiments.common.seeds import read_metrics
from rl.runtime.logging import atomic_write_json

OUT = str(results_path(__file__))


def kind_of(expr: str) -> str:
    return "muladd" if "*" in expr and "+" in expr else "mul" if "*" in expr else "add"


def run_episodes(model, env, prompts, *, num_slots: int = 32, segment_len: int = 16) -> list:
    """Greedy episodes of `prompts` (one each) with the multi-turn engine; the records."""
    from rl.rollout.multiturn import MultiTurnConfig, MultiTurnEngine
    from rl.rollout.sampler_state import SamplingConfig

    config, params, _ = model
    engine = MultiTurnEngine(config, env, MultiTurnConfig(
        num_slots=num_slots, group_size=1, segment_len=segment_len,
        sampling=SamplingConfig(greedy=True), seed=0))
    engine.submit(list(prompts))
    records = []
    while not engine.idle:
        engine.step(params, 0)
        got = engine.harvest()
        if got is not None:
            records += list(got.episodes)
    return sorted(records, key=lambda r: r.group_id)


def summarize(records) -> dict:
    correct = np.array([r.outcome["correct"] for r in records])
    calls = np.array([sum(int(i.get("tool_calls", 0)) for i in r.infos if isinstance(i, dict))
                      for r in records])
    n = len(records)
    out = {"n": n, "accuracy": round(float(correct.mean()), 4),
           "accuracy_stderr": round(float(np.sqrt(correct.mean() * (1 - correct.mean()) / n)), 4),
           "used_tool": round(float((calls > 0).mean()), 4),
           "tool_calls_per_episode": round(float(calls.mean()), 4),
           "turns_per_episode": round(float(np.mean([r.turns for r in records])), 3),
           "end_reasons": {k: int(v) for k, v in zip(*np.unique(
               [r.end_reason.value for r in records], return_counts=True))}}
    if (calls > 0).any():
        out["accuracy_when_tool_used"] = round(float(correct[calls > 0].mean()), 4)
    if (calls == 0).any():
        out["accuracy_without_a_call"] = round(float(correct[calls == 0].mean()), 4)
    kinds = np.array([kind_of(r.prompt.text) for r in records])
    out["accuracy_by_kind"] = {k: round(float(correct[kinds == k].mean()), 4)
                               for k in sorted(set(kinds))}
    out["examples"] = [{"problem": r.prompt.text, "answer": r.prompt.answer,
                        "correct": r.outcome["correct"], "transcript": r.text[:400]}
                       for r in records[:6]]
    return out


def cmd_base(args) -> dict:
    from models.assets import load_model
    from rl.envs import CalculatorEnv

    model = load_model("smollm2-135m")
    options = parse_task_options(args.env_option)
    res = {"machine": machine(), "n": args.n, "env_options": options,
           "command": "python -m experiments.repro.calculator_tool " + " ".join(sys.argv[1:])}
    for tool in (False, True):
        env = CalculatorEnv(tokenizer=model[2], tool=tool, **options)
        t0 = time.perf_counter()
        recs = run_episodes(model, env, env.eval_prompts(args.n))
        s = summarize(recs)
        s["wall_s"] = round(time.perf_counter() - t0, 1)
        res["tool" if tool else "no_tool"] = s
        print(f"{'tool' if tool else 'no tool'}: accuracy {s['accuracy']:.3f} ± "
              f"{s['accuracy_stderr']:.3f}, used the tool {s['used_tool']:.2f}, "
              f"{s['wall_s']} s", flush=True)
    atomic_write_json(Path(args.out).with_suffix(".base.json"), res)
    return res


def cmd_grpo(args) -> dict:
    from experiments.common.train_cli import main as train_main

    return train_main(["--preset", "smollm2-calc", "--run-dir", args.run_dir, "--no-progress",
                       *args.train_args])


def cmd_report(args) -> dict:
    base = json.loads(Path(args.out).with_suffix(".base.json").read_text())
    run_dir = Path(args.run_dir)
    _, evals = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = [{"step": e["step"], "minutes": round(e.get("time_s", 0) / 60, 1),
              "greedy_accuracy": e.get("greedy_accuracy"),
              "greedy_tool_calls": e.get("greedy_episode_tool_calls",
                                         e.get("episode_tool_calls")),
              "sampled_accuracy": e.get("accuracy")} for e in evals]
    first, last = curve[0], curve[-1]
    res = {
        "headline": {
            "metric": f"greedy accuracy with the calculator on {base['n']} held-out problems, "
                      "after GRPO (value) vs before (base)",
            "value": last["greedy_accuracy"], "base": first["greedy_accuracy"],
            "base_no_tool": base["no_tool"]["accuracy"],
            "target": first["greedy_accuracy"], "machine": base["machine"]},
        "base": base, "grpo": {"run_dir": str(run_dir), "steps": summary.get("steps"),
                               "wall_time_s": summary.get("wall_time_s"), "eval_curve": curve},
    }
    out = Path(args.out)
    atomic_write_json(out, res)
    plot(res, out.with_suffix(".png"))
    print(json.dumps(res["headline"], indent=1))
    return res


def plot(res: dict, path: Path) -> None:
    from experiments.common.plots import plt, save_png

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    base, curve = res["base"], res["grpo"]["eval_curve"]
    bars = [("no tool", base["no_tool"]["accuracy"]), ("tool", base["tool"]["accuracy"]),
            ("tool + GRPO", curve[-1]["greedy_accuracy"])]
    a.bar([k for k, _ in bars], [v for _, v in bars], color=["gray", "tab:blue", "tab:green"])
    for i, (_, v) in enumerate(bars):
        a.text(i, v + 0.01, f"{v:.2f}", ha="center")
    a.set_ylim(0, 1)
    a.set_ylabel(f"greedy accuracy ({base['n']} held-out problems)")
    a.set_title("SmolLM2-135M-Instruct, 3-4 digit arithmetic")
    steps = [c["step"] for c in curve]
    b.plot(steps, [c["greedy_accuracy"] for c in curve], "o-", label="greedy accuracy")
    if all(c["greedy_tool_calls"] is not None for c in curve):
        b.plot(steps, [c["greedy_tool_calls"] for c in curve], "s--",
               label="tool calls per episode")
    b.set_xlabel("GRPO step")
    b.set_ylim(0, max(1.05, max((c["greedy_tool_calls"] or 0) for c in curve) + 0.1))
    b.legend(fontsize=8)
    b.set_title("during GRPO (held-out eval)")
    save_png(fig, path)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m experiments.repro.calculator_tool",
                                epilog="flags after -- go to experiments.train (grpo)")
    p.add_argument("command", choices=("base", "grpo", "report"))
    p.add_argument("--n", type=int, default=64, help="held-out problems (base)")
    p.add_argument("--env-option", action="append", default=[], metavar="K=V",
                   help="base: a CalculatorEnv option for both runs (repeatable), e.g. "
                        "ops_per_call=1 (the multi-call variant); write it to its own --out")
    p.add_argument("--out", default=OUT)
    p.add_argument("--run-dir", default="runs/calculator_tool")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # flags for experiments.train
    args = p.parse_args(argv[:cut])
    args.train_args = argv[cut + 1:]
    return {"base": cmd_base, "grpo": cmd_grpo, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
