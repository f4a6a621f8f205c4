"""Synthetic run dirs, as `experiments.train` leaves them, for the drivers' tests."""
import json

import numpy as np


def write_run(run_dir, step_s, greedy, initial=None, resumed_step=None, eval_extra=None):
    """A finished run dir: train records (step_s each; a resumed step logged twice, the
    first copy with a huge step_s that must not count), greedy evals at 0 and the last step
    (per problem in eval_problems.jsonl; eval_extra: {step: more eval fields})."""
    run_dir.mkdir(parents=True)
    last = len(step_s)
    recs = []
    for step, s in enumerate(step_s, 1):
        if step == resumed_step:
            recs.append({"kind": "train", "step": step, "step_s": 1e6, "train_s": 1e6})
        recs.append({"kind": "train", "step": step, "step_s": s, "train_s": s / 2,
                     "tool_wait_share": 0.1})
    initial = np.zeros_like(greedy) if initial is None else initial
    for step, acc in ((0, initial), (last, greedy)):
        recs.append({"kind": "eval", "step": step, "greedy_accuracy": float(np.mean(acc)),
                     **(eval_extra or {}).get(step, {})})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    lines = [{"step": step, "pass": "greedy", "prompt_index": list(range(len(acc))),
              "accuracy": [float(x) for x in acc]} for step, acc in ((0, initial), (last, greedy))]
    (run_dir / "eval_problems.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"command": "train"}))
