"""A Ray worker's R concurrent continuous requests: one engine they share
(rl.loops.shared_engine.SharedEngine, R × b × G slots) against one round each
(rl.loops.producer.sample_round, b × G slots, each request on its own thread, as a worker
sampled them before), on a long-tail length mix.

Task: a SyntheticTask with one stop symbol out of its 64-token vocabulary sampled by a
random-init tiny decoder, so a response stops with probability ≈ 1/64 per token:
geometric lengths (mean ≈ 64) capped at --max-new-tokens; a group returns when its last
sample stops. Each repeat samples R requests of b prompts both ways, the two sides
alternating (the order swapped every repeat), after one untimed pass of each (compiles).
Useful tokens are the harvested response tokens; the ratio is shared / rounds of tokens
per second, per repeat.

    python -m experiments.bench.shared_engine            # R = 2, b = 8, G = 4, 5 repeats
    python -m experiments.bench.shared_engine --report   # the page from the committed JSON
Writes experiments/results/bench_shared_engine.json and docs/results/shared-engine.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np

from experiments.common.benchmarking import (
    compile_seconds,
    load_average,
    machine,
    results_path,
    write_results,
)

PAGE = Path("docs/results/shared-engine.md")
MODULE = "experiments.bench.shared_engine"
TARGET = 1.0  # the shared engine is not slower than one round per request


def long_tail_spec(max_new_tokens: int, group_size: int, segment_len: int):
    """(rollout spec, params): a random-init tiny decoder on a 64-token synthetic task
    whose first symbol stops a response."""
    from models.config import get_config
    from models.decoder import init_params
    from rl.loops.rollouts import RolloutSpec
    from rl.rollout import SamplingConfig
    from rl.tasks import SyntheticTask
    from rl.tasks.synthetic import FIRST_SYMBOL

    @dataclasses.dataclass(frozen=True)
    class LongTail(SyntheticTask):
        @property
        def stop_ids(self) -> tuple[int, ...]:
            return (FIRST_SYMBOL,)

        @property
        def max_new_tokens(self) -> int:
            return max_new_tokens

    task = LongTail(kind="copy", length=6, alphabet=60)
    config = get_config("tiny", vocab_size=task.vocab_size)
    spec = RolloutSpec(task, config, group_size=group_size, segment_len=segment_len,
                       sampling=SamplingConfig(temperature=1.0), max_new_tokens=max_new_tokens)
    return spec, init_params(config, 0)


def in_threads(bodies) -> tuple[list, float]:
    """Run the callables on their own threads; (their results, wall seconds)."""
    out = [None] * len(bodies)

    def run(i, fn):
        out[i] = fn()
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(bodies)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def one_pass(side: str, spec, params, prompts: list[list], seeds: list[int]) -> dict:
    """R requests sampled one way: (wall seconds, useful tokens, groups)."""
    from rl.loops.producer import sample_round
    from rl.loops.shared_engine import SharedEngine

    latest = lambda: (params, 0)  # noqa: E731
    b, g = len(prompts[0]), spec.group_size
    if side == "rounds":
        bodies = [lambda p=p, s=s: sample_round(spec, b * g, s, p, latest)
                  for p, s in zip(prompts, seeds)]
    else:
        engine = SharedEngine(spec, len(prompts) * b * g)
        tickets = [engine.queue(s, p) for p, s in zip(prompts, seeds)]
        bodies = [lambda t=t: engine.wait(t, latest) for t in tickets]
    answers, wall = in_threads(bodies)
    groups = [grp for got, _ in answers for grp in got]
    tokens = int(sum(np.asarray(grp.traj.response_mask).sum() for grp in groups))
    return {"wall_s": wall, "useful_tokens": tokens, "groups": len(groups)}


def measure(args) -> dict:
    spec, params = long_tail_spec(args.max_new_tokens, args.group_size, args.segment_len)
    task, sides = spec.task, ("rounds", "shared")
    rows = {s: [] for s in sides}
    with compile_seconds() as compiled:
        for rep in range(args.repeats + 1):  # pass 0 compiles, untimed
            start = rep * args.requests * args.prompts
            prompts = [task.train_prompts(start + r * args.prompts, args.prompts)
                       for r in range(args.requests)]
            seeds = [1000 * rep + r for r in range(args.requests)]
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                c0 = compiled[0]
                got = one_pass(side, spec, params, prompts, seeds)
                if rep:  # a timed pass compiles nothing (recorded to show it)
                    rows[side].append({**got, "compile_s": round(compiled[0] - c0, 4)})
    ratios = [(s["useful_tokens"] / s["wall_s"]) / (r["useful_tokens"] / r["wall_s"])
              for s, r in zip(rows["shared"], rows["rounds"])]
    return {"rows": rows, "ratios": ratios}


def render_page(result: dict) -> str:
    s, r = result["setup"], result["summary"]
    lines = [
        "# One engine for a Ray worker's requests", "",
        f"<!-- generated by python -m {MODULE} from experiments/results/bench_shared_engine.json;"
        " do not edit -->", "",
        "A Ray rollout worker under `--rollout continuous --worker-requests R` samples its R "
        "concurrent requests in one engine they share (`rl.loops.shared_engine`): a slot a "
        "finished group frees takes the next queued prompt of any request, and one decode "
        "step serves all of them. Before, each request was its own round on its own thread. "
        "This page times the two ways on one process, without Ray.", "",
        "**Command**", "", "```bash", f"python -m {MODULE}", "```", "",
        f"Setup: R = {s['requests']} requests of b = {s['prompts']} prompts × G = "
        f"{s['group_size']} samples; a random-init tiny decoder on a {s['vocab']}-token task "
        f"with one stop id (lengths geometric, mean ≈ {s['vocab']}, cap "
        f"{s['max_new_tokens']}), segments of {s['segment_len']} tokens; {s['repeats']} "
        "repeats, the two sides alternating, after an untimed pass of each.", "",
        f"**Machine**: {result['headline']['machine']}; load average before / after "
        f"{result['load_average']['before']} / {result['load_average']['after']}.", "",
        "| side | useful tok/s, median [min, max] | wall s per R requests, median |",
        "|---|---|---|"]
    for side, label in (("rounds", "one round per request (before)"),
                        ("shared", "one shared engine")):
        tps = r[side]["tokens_per_s"]
        lines.append(f"| {label} | {tps['median']:.0f} [{tps['min']:.0f}, {tps['max']:.0f}] | "
                     f"{r[side]['wall_s']['median']:.2f} |")
    ratio = r["ratio"]
    verdict = "met" if ratio["median"] >= TARGET else "missed"
    lines += ["", f"Shared / rounds, tokens per second, paired by repeat: **{ratio['median']:.2f}× "
              f"[{ratio['min']:.2f}, {ratio['max']:.2f}]** (target: not slower, ≥ "
              f"{TARGET:.1f}×: {verdict}).", "",
              "Both sides run on the same two CPU cores: the shared engine's one batched "
              "decode against two engines' decodes on two threads. On an accelerator the "
              "two threads' decodes would queue on one device, so there the shared engine "
              "also saves a decode per segment per request; that is not measured here.", "",
              "**Files**: [`bench_shared_engine.json`]"
              "(../../experiments/results/bench_shared_engine.json)."]
    return "\n".join(lines) + "\n"


def spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)),
            "max": float(max(values)), "runs": [float(v) for v in values]}


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="prompts (groups) per request")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--segment-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out",
                   help="results JSON (default experiments/results/bench_shared_engine.json)")
    p.add_argument("--report", action="store_true", help="only rewrite the page from the JSON")
    args = p.parse_args(argv)
    default = results_path(__file__)
    if args.report:
        PAGE.write_text(render_page(json.loads(default.read_text())))
        return None
    if args.requests < 2 or args.repeats < 1:
        p.error("--requests must be >= 2 (sharing needs two) and --repeats >= 1")
    before = load_average()
    got = measure(args)
    summary = {side: {"tokens_per_s": spread([x["useful_tokens"] / x["wall_s"] for x in rows]),
                      "wall_s": spread([x["wall_s"] for x in rows])}
               for side, rows in got["rows"].items()}
    summary["ratio"] = spread(got["ratios"])
    result = {
        "headline": {"metric": f"useful tokens/s, one shared engine / one round per request "
                               f"({args.requests} concurrent requests, median of "
                               f"{args.repeats} paired repeats)",
                     "value": round(summary["ratio"]["median"], 3), "target": TARGET,
                     "machine": machine()},
        "setup": {"requests": args.requests, "prompts": args.prompts,
                  "group_size": args.group_size, "segment_len": args.segment_len,
                  "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "vocab": 64},
        "summary": summary, "rows": got["rows"],
        "load_average": {"before": before, "after": load_average()},
        "command": f"python -m {MODULE}"}
    out = Path(args.out) if args.out else default
    write_results(out, result)
    if out == default:
        PAGE.write_text(render_page(result))
    print(render_page(result))
    return result


if __name__ == "__main__":
    main()
