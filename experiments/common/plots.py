"""Reward curves of a training run as a PNG (matplotlib, Agg backend, atomic write)."""
from __future__ import annotations

import io
import os
from collections.abc import Sequence

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rl.runtime.logging import atomic_write_bytes


def save_png(fig, path: str | os.PathLike) -> None:
    """Lay out `fig`, write it to `path` as a PNG atomically (no half-written file) and
    close it."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


_COLORS = ("tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving mean: out[i] = mean of values[max(0, i - window + 1) : i + 1], NaNs
    left out (NaN where the window holds nothing else)."""
    x = np.asarray(values, dtype=np.float64)
    ok = ~np.isnan(x)
    total = np.concatenate([[0.0], np.cumsum(np.where(ok, x, 0.0))])
    count = np.concatenate([[0], np.cumsum(ok)])
    end = np.arange(1, x.size + 1)
    start = np.maximum(0, end - window)
    n = count[end] - count[start]
    return np.where(n > 0, (total[end] - total[start]) / np.maximum(n, 1), np.nan).tolist()


def reward_names_of(train: Sequence[dict], evals: Sequence[dict]) -> list[str]:
    """Named rewards logged in train records ("reward_<name>", other than reward_mean)
    and present in the eval records too."""
    names = []
    for r in train[:1]:
        names = [k[len("reward_"):] for k in r if k.startswith("reward_") and k != "reward_mean"]
    return [n for n in names if not evals or n in evals[0]]


def _draw(ax, train, evals, x_train, x_eval, names, baseline, baseline_label, window):
    if train:
        rew = [r["reward_mean"] for r in train]
        ax.plot(x_train, rew, color="tab:blue", alpha=0.25, lw=0.8, label="train reward (batch mean)")
        ax.plot(x_train, smooth(rew, window), color="tab:blue", lw=1.8,
                label=f"train reward ({window}-step mean)")
    if evals:
        total = "eval reward" + (f" (= {names[0]})" if len(names) == 1 else " (weighted total)")
        ax.plot(x_eval, [r["reward"] for r in evals], "o-", color="tab:red", ms=3.5, lw=1.4,
                label=f"{total}, sampled")
        greedy = [(x, r["greedy_reward"]) for x, r in zip(x_eval, evals)
                  if r.get("greedy_reward") is not None]
        if greedy:
            ax.plot(*zip(*greedy), "s--", color="tab:orange", ms=3, lw=1.0,
                    label=f"{total}, greedy")
    if len(names) > 1:  # one line per named reward (with one, it is the total above)
        for name, color in zip(names, _COLORS * (1 + len(names) // len(_COLORS))):
            col = f"reward_{name}"
            if train and all(r.get(col) is not None for r in train):
                ax.plot(x_train, smooth([r[col] for r in train], window), color=color, lw=1.0,
                        alpha=0.6, label=f"train {name} ({window}-step mean)")
            if evals and all(r.get(name) is not None for r in evals):
                ax.plot(x_eval, [r[name] for r in evals], "o-", color=color, ms=3, lw=1.2,
                        label=f"eval {name}, sampled")
            g = [(x, r[f"greedy_{name}"]) for x, r in zip(x_eval, evals)
                 if r.get(f"greedy_{name}") is not None]
            if g:
                ax.plot(*zip(*g), "s--", color=color, ms=2.5, lw=0.9, label=f"eval {name}, greedy")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls=":", lw=1.2, label=f"{baseline_label} ({baseline:.3f})")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)


def plot_reward_curve(train: Sequence[dict], evals: Sequence[dict], path: str | os.PathLike, *,
                      baseline: float | None = None, pretrained: bool = False,
                      title: str = "GRPO reward", smooth: int = 20,
                      reward_names: Sequence[str] | None = None, minutes: bool = False) -> None:
    """Train reward per step (raw and a `smooth`-step moving average), eval reward
    (sampled, and greedy if present) at each eval, with more than one named reward also
    each one as its own line (train: smoothed "reward_<name>"; eval: sampled and greedy),
    and an optional horizontal baseline: the step-0 eval, labelled "random policy" or, with
    pretrained=True, "starting policy". minutes=True adds a second panel against wall-clock
    minutes (records' "time_s"; skipped when they have none). reward_names: default
    reward_names_of(train, evals). Records are metrics.jsonl rows."""
    names = list(reward_names) if reward_names is not None else reward_names_of(train, evals)
    label = "starting policy" if pretrained else "random policy"
    timed = minutes and (train or evals) and all(r.get("time_s") is not None
                                                 for r in [*train, *evals])
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(13 if timed else 7, 4), dpi=120,
                             sharey=True, squeeze=False)
    ax = axes[0][0]
    _draw(ax, train, evals, [r["step"] for r in train], [r["step"] for r in evals], names,
          baseline, label, smooth)
    ax.set_xlabel("optimizer step")
    ax.set_title(title)
    ax.legend(fontsize=7 if len(names) > 1 else 8, loc="best")
    if timed:
        ax2 = axes[0][1]
        _draw(ax2, train, evals, [r["time_s"] / 60 for r in train],
              [r["time_s"] / 60 for r in evals], names, baseline, label, smooth)
        ax2.set_xlabel("wall-clock minutes (compilation and evals included)")
        ax2.set_title(f"{title} vs time")
    save_png(fig, path)
