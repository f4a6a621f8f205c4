"""Your own environment from one command: `--env module:factory` / `--env file.py:factory`
(rl.envs.make_env, rl.envs.base.check_environment), checked before anything compiles; an
environment written the plain way (a blocking Episode.step) trains, its calls overlapped
by the engine's tool pool.

The user file below is written the way a researcher would write it, with no Tandem base
class: a number to find among 8..15 by guesses, 'higher' / 'lower' as one-token
observations, a 20 ms sleep in step standing in for a slow tool."""
import json
import textwrap

import pytest

from experiments.common.train_cli import main
from rl.envs import make_env, parse_env_spec

USER_ENV = '''
import threading, time
from rl.envs.base import StepResult
from rl.tasks.base import Prompt

CALLS = {"now": 0, "peak": 0}
LOCK = threading.Lock()


class Episode:
    def __init__(self, target):
        self.target, self.turns, self.found = target, 0, False

    def step(self, text):
        with LOCK:
            CALLS["now"] += 1
            CALLS["peak"] = max(CALLS["peak"], CALLS["now"])
        time.sleep(0.02)  # a blocking tool call
        with LOCK:
            CALLS["now"] -= 1
        self.turns += 1
        guess = int(text)
        self.found = guess == self.target
        return StepResult("higher" if guess < self.target else "lower", 0.0, self.found)

    def outcome(self):
        return {"score": float(self.found)}


class FindIt:
    name = "find_it"
    reward_names = ("score",)
    stop_ids = ()
    max_turn_tokens = 1
    max_prompt_len = 2
    vocab_size = 16

    def __init__(self, max_turns, seed):
        self.max_turns, self.seed = max_turns, seed
        self.max_episode_tokens = 2 + 2 * max_turns

    def train_prompts(self, start, count):
        return [Prompt(ids=(1, 3), answer=8 + (self.seed + 5 * i) % 8, index=i)
                for i in range(start, start + count)]

    def eval_prompts(self, count):
        return [Prompt(ids=(1, 3), answer=8 + j % 8, index=j) for j in range(count)]

    def reset(self, prompt):
        return Episode(prompt.answer)

    def decode_turn(self, ids):
        return str(int(ids[0]))

    def encode_observation(self, text):
        return [4 if text == "higher" else 5]


def make(max_turns=3, seed=0):
    return FindIt(max_turns, seed)
'''

BROKEN = '''
class Half:
    name = "half"
    reward_names = ("score",)
    max_turns = 2

    def train_prompts(self, start, count):
        return []


def make():
    return Half()
'''


@pytest.fixture
def user_files(tmp_path):
    (tmp_path / "my_env.py").write_text(textwrap.dedent(USER_ENV))
    (tmp_path / "half_env.py").write_text(BROKEN)
    return tmp_path


ARGS = ["--steps", "2", "--group-size", "4", "--prompts-per-step", "2", "--eval-prompts", "4",
        "--eval-every", "0", "--no-progress", "--wandb", "disabled"]


def test_spec_grammar():
    assert parse_env_spec("guess_number:k=16") == ("guess_number", {"k": 16})
    assert parse_env_spec("pkg.envs:make") == ("pkg.envs:make", {})
    assert parse_env_spec("dir/my_env.py:make:max_turns=2") == ("dir/my_env.py:make",
                                                                 {"max_turns": 2})


def test_user_factory_trains_from_the_command_line(user_files, tmp_path):
    path = user_files / "my_env.py"
    env = make_env(f"{path}:make:max_turns=2")
    assert env.max_turns == 2 and env.max_episode_tokens == 6
    run_dir = tmp_path / "run"
    summary = main(ARGS + ["--env", f"{path}:make", "--env-option", "max_turns=3",
                           "--run-dir", str(run_dir), "--max-concurrent-tool-calls", "8"])
    assert summary["steps"] == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["episode_turns"] >= 1 and 0 < r["slot_occupancy"] <= 1 for r in train)
    import sys
    mod = next(m for n, m in sys.modules.items() if n.startswith("_tandem_user_")
               and getattr(m, "FindIt", None) is not None)
    assert mod.CALLS["peak"] > 1  # the blocking steps of different episodes overlapped
    cfg = json.loads((run_dir / "run_config.json").read_text())
    assert cfg["task"]["spec"] == f"env:{path}:make"


@pytest.mark.parametrize("spec, match", [
    ("half_env.py:make", "has no stop_ids, max_turn_tokens, max_prompt_len, "
                         "max_episode_tokens, eval_prompts(), reset(), decode_turn(), "
                         "encode_observation()"),
    ("half_env.py:nothing", "has no 'nothing'"),
    ("no_such_module_xyz:make", "cannot import module"),
    ("my_env.py:make:colour=red", "rejected its options"),
])
def test_a_bad_factory_is_refused_before_compiling(user_files, tmp_path, capsys, monkeypatch,
                                                   spec, match):
    monkeypatch.chdir(user_files)
    with pytest.raises(SystemExit) as err:
        main(ARGS + ["--env", spec, "--run-dir", str(tmp_path / "r")])
    assert err.value.code == 2
    assert match in capsys.readouterr().err
