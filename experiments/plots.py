"""Reward curves of a training run as a PNG (matplotlib, Agg backend, atomic write)."""
from __future__ import annotations

import io
import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rl.runtime.logging import atomic_write_bytes  # noqa: E402


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_reward_curve(train: Sequence[dict], evals: Sequence[dict], path: str | os.PathLike, *,
                      baseline: float | None = None, title: str = "GRPO reward",
                      smooth: int = 20) -> None:
    """Train reward per step (raw and a `smooth`-step moving average), eval reward
    (sampled, and greedy if present) at each eval, and an optional horizontal baseline
    (e.g. the random policy's reward). Records are metrics.jsonl rows."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        steps = [r["step"] for r in train]
        rew = [r["reward_mean"] for r in train]
        ax.plot(steps, rew, color="tab:blue", alpha=0.25, lw=0.8, label="train reward (batch mean)")
        ax.plot(steps, _smooth(rew, smooth), color="tab:blue", lw=1.8,
                label=f"train reward ({smooth}-step mean)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["reward"] for r in evals], "o-", color="tab:red",
                ms=3.5, lw=1.4, label="eval reward (sampled)")
        greedy = [r for r in evals if r.get("greedy_reward") is not None]
        if greedy:
            ax.plot([r["step"] for r in greedy], [r["greedy_reward"] for r in greedy], "s--",
                    color="tab:orange", ms=3, lw=1.0, label="eval reward (greedy)")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls=":", lw=1.2, label=f"random policy ({baseline:.3f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
