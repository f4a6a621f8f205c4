"""`python -m experiments.train` on a damaged run dir, end to end (real subprocesses):
--resume on a checkpoint with one flipped bit (data orbax itself accepts) exits non-zero
with a CheckpointError naming the checkpoint, the damaged array and the
--resume-from-last-good flag; with that flag the run skips it, continues from the
previous checkpoint and ends with one record per step; a run dir locked by another
process is refused with the holder's pid before the model is loaded."""
import json
import os
import subprocess
import sys
from pathlib import Path

from test_checkpoint_integrity import flip_accepted_bit

from experiments.common.train_cli import main
from rl.learner import init_train_state
from rl.run import PRESETS, load_policy
from rl.runtime.checkpoint import Checkpointer
from rl.runtime.runlock import RunLock

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--prompts-per-step", "2", "--group-size", "4", "--eval-prompts", "8",
         "--eval-every", "0", "--no-progress", "--wandb", "disabled"]


def train(run_dir, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "experiments.train", *SMALL, "--run-dir",
                           str(run_dir), *flags], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)


def test_damaged_checkpoint_is_a_clear_cli_error_and_the_flag_falls_back(tmp_path):
    run_dir = tmp_path / "run"
    main(["--steps", "2", "--save-every", "1", "--run-dir", str(run_dir), *SMALL])
    preset = PRESETS["tiny-synthetic"]
    _, params, _ = load_policy(preset, 0)
    with Checkpointer(run_dir / "checkpoints") as ck:
        saved, _ = ck.restore(init_train_state(params, preset.train, 0), step=2)
    changed = flip_accepted_bit(run_dir / "checkpoints", 2, saved)

    bad = train(run_dir, "--steps", "3", "--save-every", "1", "--resume")
    assert bad.returncode != 0, bad.stdout[-3000:]
    assert f"array {changed[0]} fails its checksum" in bad.stdout, bad.stdout[-3000:]
    assert str(run_dir / "checkpoints" / "2") in bad.stdout
    assert "previous checkpoint (step 1)" in bad.stdout and "--resume-from-last-good" in bad.stdout

    good = train(run_dir, "--steps", "3", "--save-every", "1", "--resume",
                 "--resume-from-last-good")
    assert good.returncode == 0, good.stdout[-3000:]
    assert "skipping checkpoint step 2 (falling back to step 1)" in good.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "2.damaged").is_dir()
    with Checkpointer(run_dir / "checkpoints") as ck:
        assert ck.all_steps() == [2, 3]  # step 2 written again over the set-aside one


def test_locked_run_dir_is_refused_with_the_holders_pid(tmp_path):
    with RunLock(tmp_path / "run"):
        out = train(tmp_path / "run", "--steps", "1")
    assert out.returncode != 0
    assert f"pid {os.getpid()} on host" in out.stdout and "is in use" in out.stdout
    assert not (tmp_path / "run" / "model.json").exists()  # refused before loading the model
