"""Measures of the code's shape that the run harness issue set, read with `ast` (nothing is
imported): no function in rl/loops/ over ~80 lines; no public function under rl/ with more
than 8 parameters but the named exceptions (each with its reason); rl/loops/ at most 7
modules deep (the asynchronous sources beside the synchronous one, not on it); RunConfig
validated once per run, from the command line and from rl.run.train."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from tests.test_layout import ROOT, import_graph

MAX_LOOP_FUNCTION_LINES = 85  # "no function in rl/loops/ over ~80 lines"
MAX_PUBLIC_PARAMETERS = 8
MAX_LOOPS_DEPTH = 7
# (file, function) -> why it takes more than 8 parameters
WIDE_EXCEPTIONS = {
    ("rl/objectives/losses.py", "ppo_clip_loss"):
        "a registered loss: arrays and masks, then its hyper-parameters as keywords "
        "(LossConfig.params passes them through the registry)",
    ("rl/objectives/offpolicy.py", "decoupled_ppo_loss"):
        "AReaL's objective as a pure function of arrays: three log-probs, advantages, mask, "
        "then its clip / cap / aggregation keywords",
    ("rl/trajectory.py", "create"):
        "the keyword-only constructor of the Trajectory data type: one parameter per field",
    ("rl/rollout/sampler_state.py", "init_state"):
        "the keyword-only constructor of a SamplerState: slots, budgets and decode options "
        "are its fields",
    ("rl/rollout/sampler_state.py", "new_state"):
        "init_state's body without its truncation warning (the same fields)",
    ("rl/rollout/sharded_sampler.py", "init_state"):
        "init_state placed on a mesh (the same fields)",
    ("rl/rollout/sampler.py", "generate"):
        "plain generation in one call for notebooks and scripts: the sampler's options as "
        "keywords with defaults (the loops pass a RolloutSpec instead)",
    ("rl/learner/vcpo.py", "per_trajectory_grad_sq_norms"):
        "a pure function of params and the rows' arrays (tokens, positions, mask), then the "
        "temperature, chunk, attention kernel and method with defaults",
}


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [p for p in a.posonlyargs + a.args + a.kwonlyargs
                      if p.arg not in ("self", "cls")]
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1, len(params)


def test_no_function_in_the_loops_is_long():
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)"
            for p in sorted((ROOT / "rl" / "loops").glob("*.py"))
            for name, line, n, _ in functions(p) if n > MAX_LOOP_FUNCTION_LINES]
    assert not long, f"split by step: {long}"


def test_no_public_function_takes_more_than_8_parameters():
    wide, seen = [], set()
    for p in sorted((ROOT / "rl").rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        for name, line, _, k in functions(p):
            if k > MAX_PUBLIC_PARAMETERS and not name.startswith("_"):
                if (rel, name) in WIDE_EXCEPTIONS:
                    seen.add((rel, name))
                else:
                    wide.append(f"{rel}:{line} {name} ({k} parameters)")
    assert not wide, f"pass config objects instead: {wide}"
    stale = set(WIDE_EXCEPTIONS) - seen
    assert not stale, f"no longer wide, drop the exception: {sorted(stale)}"


def test_the_loops_are_at_most_7_modules_deep():
    graph = import_graph(ROOT, packages=("rl",))
    loops = {m: {d for d in deps if d.startswith("rl.loops.")}
             for m, deps in graph.items() if m.startswith("rl.loops.")}

    @functools.lru_cache(None)
    def chain(m):  # the longest import chain inside rl.loops starting at m
        below = [chain(d) for d in loops[m]]
        return (m, *max(below, key=len, default=()))

    deepest = max((chain(m) for m in loops), key=len)
    assert len(deepest) <= MAX_LOOPS_DEPTH, " -> ".join(deepest)
    # the asynchronous sources stand beside the synchronous one, not on it
    for m in ("rl.loops.asynchronous", "rl.loops.deterministic", "rl.loops.threaded"):
        assert "rl.loops.sync" not in chain(m), chain(m)


@pytest.fixture
def validations(monkeypatch):
    """Counts RunConfig.validate calls (every entry point's checks go through it)."""
    from rl.loops.config import RunConfig

    calls = []
    real = RunConfig.validate

    def counted(self):
        calls.append(self.name)
        return real(self)

    monkeypatch.setattr(RunConfig, "validate", counted)
    return calls


SMALL = {"loop.steps": 1, "loop.prompts_per_step": 2, "loop.group_size": 4,
         "loop.eval_prompts": 8, "loop.eval_every": 0, "loop.eval_greedy": False,
         "logging.wandb": "disabled", "logging.progress": False}


def test_a_run_is_validated_once(validations, tmp_path):
    from experiments.common.train_cli import main
    from rl.run import PRESETS, train

    argv = ["--no-progress", "--run-dir", str(tmp_path / "cli")]
    for path, value in SMALL.items():
        argv += ["--set", f"{path}={value}"]
    main(argv)
    assert len(validations) == 1, validations
    validations.clear()
    train(PRESETS["tiny-synthetic"].overrides({**SMALL, "run_dir": str(tmp_path / "py")}))
    assert len(validations) == 1, validations
