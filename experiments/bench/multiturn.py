"""Multi-turn rollouts: appending observations to the KV cache vs re-prefilling the whole
history every turn (rl.rollout.multiturn, modes "append" and "reprefill").

    python -m experiments.bench.multiturn [--model smollm2-135m] [--turns 2,4,8] [--repeats 3]
        [--prompt-len 128] [--turn-len 32] [--obs-len 32] [--groups 2] [--group-size 4]
        [--layout segmented|replicated]

The model is the SmolLM2-135M architecture (models.config preset "smollm2-135m", float32)
with RANDOM weights: the cost of a token pass does not depend on the weights, and a
scripted environment fixes every length: prompts of --prompt-len random ids, turns of
exactly --turn-len tokens (no stop ids: each turn ends on its turn budget), observations
of exactly --obs-len ids (a function of the turn's ids), done after T turns. So both
modes make episodes of the same lengths (checked) and the only difference is how the
observations enter the cache: append runs just the new tokens at the slot's position,
reprefill rebuilds the group's KV from prompt + all turns + observations after every turn.
The two usually draw the same tokens too, but not always here: random weights give an
almost uniform distribution over 49152 tokens, where a float-rounding change of the
logits (appended vs re-prefilled keys, ~2e-6 in log-prob; both sides match a
teacher-forced forward to that) now and then moves the inverse-CDF draw to another token,
after which the episode's later tokens differ; the JSON records the fraction of identical
tokens. It does not change what is measured (lengths are fixed).

Per (T, mode): tokens the model processes per episode (prefill + decode + append or
re-prefill passes, rl.rollout.multiturn's token_counts, padding not counted) and wall
seconds per episode (one rollout of --groups x --group-size episodes run concurrently,
divided by the episodes). One warm-up rollout per (T, mode) compiles; the timed repeats
alternate append / reprefill so that load from other processes hits both alike; the
median repeat is reported (all are kept). Writes experiments/results/bench_multiturn.json
(headline: the reprefill / append token ratio at 4 turns, target 2.0; the wall-time ratio
beside it) and bench_multiturn.png.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from experiments.common.benchmarking import load_average, machine, results_path, write_results
from models.config import get_config
from models.decoder import init_params
from rl.envs.base import StepResult
from rl.rollout import MultiTurnConfig, MultiTurnEngine, SamplingConfig
from rl.tasks.base import Prompt

RESULT = results_path(__file__)


class FixedEpisode:
    def __init__(self, env):
        self.env, self.turn = env, 0

    def step(self, text):
        self.turn += 1
        s = sum(int(t) for t in text.split())
        hi = min(1000, self.env.vocab_size)
        obs = " ".join(str((s * 31 + 7 * j) % (hi - 10) + 10) for j in range(self.env.obs_len))
        return StepResult(observation=obs, reward=0.0, done=self.turn >= self.env.turns)

    def outcome(self):
        return {"turns": float(self.turn)}


class FixedEnv:
    """Scripted: fixed turn and observation lengths, done after `turns` turns."""

    name = "fixed"
    reward_names = ("turns",)
    stop_ids = ()

    def __init__(self, turns, prompt_len, turn_len, obs_len, vocab_size):
        self.turns, self.obs_len, self.vocab_size = turns, obs_len, vocab_size
        self.max_turns, self.max_turn_tokens, self.max_prompt_len = turns, turn_len, prompt_len
        self.max_episode_tokens = prompt_len + turns * turn_len + (turns - 1) * obs_len

    def reset(self, prompt):
        return FixedEpisode(self)

    def decode_turn(self, ids):
        return " ".join(str(int(t)) for t in ids)

    def encode_observation(self, text):
        return [int(t) for t in text.split()]


def rollout(params, cfg, env, prompts, args, mode):
    eng = MultiTurnEngine(cfg, env, MultiTurnConfig(
        num_slots=args.groups * args.group_size, group_size=args.group_size,
        segment_len=args.turn_len, sampling=SamplingConfig(temperature=1.0),
        kv_layout=args.layout, mode=mode))
    eng.submit(prompts)
    t0 = time.perf_counter()
    batches, v = [], 0
    while not eng.idle:
        eng.step(params, v)
        v += 1
        if (b := eng.harvest()) is not None:
            batches.append(b)
    wall = time.perf_counter() - t0
    ids = np.concatenate([np.asarray(b.trajectory.response_ids) for b in batches])
    return wall, dict(eng.token_counts), dict(eng.timings), ids


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common.plots import save_png
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for mode, color in (("append", "tab:green"), ("reprefill", "tab:purple")):
        rs = [r for r in rows if r["mode"] == mode]
        t = [r["turns"] for r in rs]
        axes[0].plot(t, [r["tokens_per_episode"] for r in rs], "o-", color=color, label=mode)
        axes[1].plot(t, [r["wall_s_per_episode"] for r in rs], "o-", color=color, label=mode)
    axes[0].set(xlabel="turns per episode", ylabel="token passes per episode")
    axes[1].set(xlabel="turns per episode", ylabel="wall s per episode")
    for ax in axes:
        ax.legend()
        ax.set_xscale("log", base=2)
    save_png(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--turns", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--turn-len", type=int, default=32)
    ap.add_argument("--obs-len", type=int, default=32)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--layout", default="segmented", choices=("segmented", "replicated"))
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    cfg = get_config(args.model, dtype="float32", param_dtype="float32")
    params = init_params(cfg, 0)
    rng = np.random.default_rng(0)
    prompts = [Prompt(ids=tuple(int(t) for t in rng.integers(10, min(1000, cfg.vocab_size), args.prompt_len)),
                      answer=None, index=i) for i in range(args.groups)]
    episodes = args.groups * args.group_size
    load_before = load_average()
    rows, runs = [], []
    for turns in [int(t) for t in args.turns.split(",")]:
        env = FixedEnv(turns, args.prompt_len, args.turn_len, args.obs_len, cfg.vocab_size)
        ids = {}
        for mode in ("append", "reprefill"):  # warm-up: compile
            _, _, _, ids[mode] = rollout(params, cfg, env, prompts, args, mode)
        if ids["append"].shape != ids["reprefill"].shape:
            raise SystemExit(f"turns={turns}: append and reprefill made different lengths")
        same = float((ids["append"] == ids["reprefill"]).mean())
        walls = {"append": [], "reprefill": []}
        for rep in range(args.repeats):
            order = ("append", "reprefill") if rep % 2 == 0 else ("reprefill", "append")
            for mode in order:
                wall, counts, timings, _ = rollout(params, cfg, env, prompts, args, mode)
                walls[mode].append(wall)
                runs.append({"turns": turns, "mode": mode, "repeat": rep, "wall_s": wall,
                             "token_counts": counts, "timings": timings})
        for mode in ("append", "reprefill"):
            last = [r for r in runs if r["turns"] == turns and r["mode"] == mode][-1]
            total = sum(last["token_counts"].values())
            rows.append({"turns": turns, "mode": mode,
                         "tokens_per_episode": total / episodes,
                         "token_counts": last["token_counts"],
                         "wall_s_per_episode": statistics.median(walls[mode]) / episodes,
                         "wall_s_runs": walls[mode], "same_tokens_fraction": same})
        a, r = rows[-2], rows[-1]
        print(f"T={turns}: tokens/episode append {a['tokens_per_episode']:.0f} reprefill "
              f"{r['tokens_per_episode']:.0f} (x{r['tokens_per_episode'] / a['tokens_per_episode']:.2f}); "
              f"wall s/episode append {a['wall_s_per_episode']:.3f} reprefill "
              f"{r['wall_s_per_episode']:.3f} "
              f"(x{r['wall_s_per_episode'] / a['wall_s_per_episode']:.2f}); "
              f"same tokens {same:.4f}", flush=True)
    print(f"\n{'turns':>5} {'mode':>10} {'tokens/ep':>10} {'wall s/ep':>10} {'token x':>8} "
          f"{'wall x':>7}")
    ratios = {}
    for a, r in zip(rows[::2], rows[1::2]):
        tx = r["tokens_per_episode"] / a["tokens_per_episode"]
        wx = r["wall_s_per_episode"] / a["wall_s_per_episode"]
        ratios[a["turns"]] = {"token_ratio": tx, "wall_ratio": wx}
        for row, x in ((a, ("", "")), (r, (f"{tx:.2f}", f"{wx:.2f}"))):
            print(f"{row['turns']:>5} {row['mode']:>10} {row['tokens_per_episode']:>10.0f} "
                  f"{row['wall_s_per_episode']:>10.3f} {x[0]:>8} {x[1]:>7}")
    where = machine()
    head_t = 4 if 4 in ratios else min(ratios)
    result = {
        "headline": {"metric": f"reprefill / append token passes per episode at {head_t} turns",
                     "value": round(ratios[head_t]["token_ratio"], 3), "target": 2.0,
                     "machine": where,
                     "wall_ratio": round(ratios[head_t]["wall_ratio"], 3),
                     "wall_ratio_target": 1.0},
        "ratios": {str(k): v for k, v in ratios.items()},
        "table": rows, "runs": runs,
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {
            "weights": "random (init_params seed 0)", "dtype": "float32",
            "episodes_per_rollout": episodes},
        "load_average": {"before": load_before, "after": load_average()},
        "device": jax.devices()[0].platform,
    }
    out = write_results(Path(args.out), result)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
