"""The results page of experiments.bench.learner (docs/results/learner-floor.md) and its
README / results-index rows, rendered from the benchmark's JSON: every number on them
comes from experiments/results/bench_learner.json (tests/test_bench_learner.py checks the
committed page against it)."""
from __future__ import annotations

from pathlib import Path

from experiments.common.docs_rows import write_page_and_rows

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "results" / "learner-floor.md"
TITLE = "Learner at its floor"
AFTER = "Learner memory"
SIDES = {"tandem": "Tandem (default `TrainConfig`)", "tandem[preset]": "Tandem, preset options",
         "jax": "plain-JAX floor", "torch": "transformers + torch"}


def commands(rows: list[dict]) -> str:
    """The commands behind the rows: one per shape, the later ones merged into the file."""
    return "\n".join(
        f"python -m experiments.bench.learner --shapes {r['shape']} --repeats "
        f"{len(next(iter(r['times_s'].values())))} --breakdown ''" + (" --merge" if i else "")
        for i, r in enumerate(rows))


def verdict(headline: dict) -> str:
    return "met" if headline["value"] <= headline["target"] else "missed"


def ratio_cell(pair: dict | None) -> str:
    if pair is None:
        return "—"
    return f"{pair['median']:.2f} [{pair['min']:.2f}, {pair['max']:.2f}]"


def shape_table(row: dict) -> list[str]:
    """One shape's table: a line per side, the floor's paired ratios and matmul counts."""
    floor = row.get("paired_time_vs_floor", {})
    torch = row.get("paired_time_vs_torch", {})
    mm = row.get("matmul_gflop", {})
    lines = [f"**{row['shape'].replace('x', ' × ')}** ({row['tokens']:,} tokens, "
             f"{row['micro_batches']} micro-batch{'es' if row['micro_batches'] > 1 else ''}, "
             f"{len(next(iter(row['times_s'].values())))} rounds):", "",
             "| side | step s (median) | tok/s | GFLOP/s | of peak | time / floor's | "
             "time / torch's | matmul GFLOP (jaxpr) |", "|---|---|---|---|---|---|---|---|"]
    for side in ("tandem", "tandem[preset]", "jax", "torch"):
        if side not in row["step_s"]:
            continue
        to_floor = "1" if side == "jax" else ratio_cell(floor.get(side))
        to_torch = "1" if side == "torch" else ratio_cell(torch.get(side))
        lines.append(f"| {SIDES[side]} | {row['step_s'][side]:.2f} | "
                     f"{row['tokens_per_s'][side]:.0f} | {row['gflops'][side]:.1f} | "
                     f"{100 * row['fraction_of_peak'][side]:.0f} % | {to_floor} | {to_torch} | "
                     f"{mm.get(side, '—') if side != 'torch' else '—'} |")
    return lines


def matmul_sentence(row: dict) -> str:
    mm = row.get("matmul_gflop", {})
    if "tandem" not in mm or "jax" not in mm:
        return ""
    diff = mm["jax"] - mm["tandem"]
    text = (f"At {row['shape'].replace('x', ' × ')} the library's step runs "
            f"{mm['tandem']:.1f} GFLOP of matmuls, the floor's {mm['jax']:.1f} "
            f"({diff:.2f} GFLOP fewer: the floor applies the vocabulary head at every "
            "position and drops the last one's logits; the library never computes them)")
    if row.get("matmul_gflop_note"):
        text += f" ({row['matmul_gflop_note']})"
    if "tandem[preset]" in mm:
        text += (f"; with the preset's packed groups {mm['tandem[preset]']:.1f} GFLOP "
                 "(each group's prompt runs once)")
    return text + "."


def render_page(result: dict) -> str:
    h = result["headline"]
    peak = result["peak_gflops"]
    rows = result["rows"]
    out = [
        "# The learner at its floor", "",
        "One training step of SmolLM2-135M-Instruct (forward, backward, clip + AdamW, fp32, "
        "unpacked rows) in Tandem's jitted step, in the plain-JAX step it should approach "
        "(`jax.value_and_grad` of the same loss through `models.decoder.forward`, then optax; "
        "compiled with the library's own CPU options), in Tandem with the `smollm2-rg` "
        "preset's learner options on the same samples (packed groups, its clip range, "
        "temperature and reward weights), and in transformers + torch, alternating call by "
        "call. *time / floor's* is each side's time over the floor's in the same round, "
        "median [min, max] over the rounds. The matmul counts come from each step's jaxpr "
        "(`experiments.common.jaxpr_flops`): they say what the step computes, whatever the "
        "timer says on a shared machine.", "",
        "```bash", commands(rows), "```", "",
        f"**Machine**: {h['machine']}; load average before / after "
        f"{h['load']['before']} / {h['load']['after']} (the last run); *of peak* is against the "
        f"matmul peak measured in each shape's run ({peak:.1f} GFLOP/s in the last).", "",
        f"**Headline**: {h['metric']}: **{h['value']:.3f}** "
        f"[{h['range'][0]:.3f}, {h['range'][1]:.3f}] (target ≤ {h['target']:g}: "
        f"{verdict(h)}).", "",
    ]
    for row in rows:
        out += shape_table(row) + [""]
    sentences = [s for s in (matmul_sentence(r) for r in rows) if s]
    out += ["## What the library computes beyond the floor", "",
            *sentences, "",
            "- **No extra forward.** With `old_logp=\"current\"` the step takes the ratio's "
            "old log-probs from its own forward (stop-gradient), so the matmul counts equal "
            "the floor's; `tests/test_bench_learner.py` checks them against the hand count "
            "for a tiny model and that the kept or recomputed head adds what it should.",
            "- **No gradient accumulator for one micro-batch.** The step used to run even "
            "one micro-batch through `lax.scan` over a zero-initialised gradient (two more "
            "passes over the parameters a step); with `micro_batches=1` it now calls "
            "`value_and_grad` once (the same numbers).",
            "- **What stays**: the metrics (clip fractions, log-ratio statistics, the "
            "entropy: one more pass over each head chunk's logits), the chunked head's loop "
            "and the token masks. They are not matmuls; the paired ratio above is what they "
            "cost together.", "",
            "**Files**: [`bench_learner.json`](../../experiments/results/bench_learner.json).",
            ""]
    return "\n".join(out)


def summary_row(result: dict, link: str, index: bool = False) -> str:
    h = result["headline"]
    rows = {r["shape"]: r for r in result["rows"]}
    last = max(result["rows"], key=lambda r: r["tokens"])
    torch = last.get("paired_time_vs_torch", {}).get("tandem")
    parts = [f"SmolLM2 train step at {last['shape'].replace('x', '×')}: "
             f"{h['value']:.2f}× the plain-JAX floor's time [{h['range'][0]:.2f}, "
             f"{h['range'][1]:.2f}]"]
    if torch is not None:
        parts.append(f"{torch['median']:.2f}× torch's")
    preset = last.get("paired_time_vs_floor", {}).get("tandem[preset]")
    if preset is not None:
        parts.append(f"with the smollm2-rg options {preset['median']:.2f}× the floor's")
    others = [s for s in rows if s != last["shape"] and "tandem" in
              rows[s].get("paired_time_vs_floor", {})]
    for s in others:
        parts.append(f"{rows[s]['paired_time_vs_floor']['tandem']['median']:.2f}× at "
                     f"{s.replace('x', '×')}")
    text = f"| [{TITLE}]({link}) | " + "; ".join(parts) + " |"
    if not index:
        return text
    return text + f" ≤ {h['target']:g}× the floor | {verdict(h)} |"


def write_docs(result: dict) -> None:
    write_page_and_rows(PAGE, render_page(result),
                        lambda link, index=False: summary_row(result, link, index=index),
                        TITLE, AFTER)
