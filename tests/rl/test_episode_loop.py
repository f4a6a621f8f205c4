"""Environments in the loops: `python -m experiments.train --env NAME` end to end (in
process) on a scripted token-level environment, the asynchronous loop's deterministic mode
with exact proximal log-probs on episodes, and the refusals made before anything compiles.

The scripted game: the prompt [1, 3] hides a target id in 8..15; each model turn is one
token (a guess); the observation is one token, 4 ("higher") or 5 ("lower"); a correct
guess ends the episode (turn reward 1, info tool_calls 1), any other turn has turn reward
0.1 · (guess % 2); outcome "score" = 1 − 0.2 (turns − 1) when found, else 0. Every
outcome is appended to OUTCOMES (in sampling order), so the test can recompute a step's
reward mean from the episodes themselves."""
import dataclasses
import json

import numpy as np
import pytest

import rl.envs
from experiments.common.train_cli import main
from experiments.evaluate import main as evaluate_main
from rl.envs.base import StepResult
from rl.learner import OptimizerConfig, TrainConfig
from rl.loops import AsyncConfig, LoopConfig, RolloutOptions, run_async
from rl.loops.episodes import EnvTask, EpisodeOptions, take_episode_metrics
from rl.objectives import LossConfig
from rl.tasks.base import Prompt

OUTCOMES: list[float] = []
TURNS: list[int] = []


class ScriptedEpisode:
    def __init__(self, target):
        self.target, self.turns, self.found = target, 0, False

    def step(self, text):
        self.turns += 1
        guess = int(text)
        if guess == self.target:
            self.found = True
            return StepResult("", 1.0, True, {"tool_calls": 1})
        return StepResult("higher" if guess < self.target else "lower", 0.1 * (guess % 2), False,
                          {"tool_calls": 0})

    def outcome(self):
        score = 1.0 - 0.2 * (self.turns - 1) if self.found else 0.0
        OUTCOMES.append(score)
        TURNS.append(self.turns)
        return {"score": score}


@dataclasses.dataclass(frozen=True)
class ScriptedEnv:
    seed: int = 0
    max_turns: int = 3
    name: str = "scripted"
    reward_names: tuple = ("score",)
    stop_ids: tuple = ()
    max_turn_tokens: int = 1
    max_prompt_len: int = 2
    vocab_size: int = 16

    @property
    def max_episode_tokens(self):
        return self.max_prompt_len + 2 * self.max_turns

    def train_prompts(self, start, count):
        return [Prompt(ids=(1, 3), answer=8 + (self.seed + 5 * i) % 8, index=i)
                for i in range(start, start + count)]

    def eval_prompts(self, count):
        return [Prompt(ids=(1, 3), answer=8 + j % 8, index=j) for j in range(count)]

    def reset(self, prompt):
        return ScriptedEpisode(prompt.answer)

    def decode_turn(self, ids):
        return str(int(ids[0]))

    def encode_observation(self, text):
        return [4 if text == "higher" else 5]


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setitem(rl.envs.ENVS, "scripted", ScriptedEnv)
    OUTCOMES.clear()
    TURNS.clear()


def scripted_config(run_dir, asynchronous=None, **loop):
    """The RunConfig the loop tests run the scripted game with (3 turns, 2 prompts x 4
    episodes a step, one-token turns); `loop` overrides LoopConfig fields (steps: 3)."""
    from rl.run import LoggingConfig, RunConfig, TaskSpec

    loop = {"steps": 3, "prompts_per_step": 2, "group_size": 4, "eval_every": 0,
            "eval_prompts": 4, **loop}
    return RunConfig(
        task=TaskSpec("env:scripted", {"max_turns": 3}),
        train=TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                          optimizer=OptimizerConfig(name="adamw", learning_rate=1e-3)),
        rollout=RolloutOptions(segment_len=1), loop=LoopConfig(**loop),
        asynchronous=asynchronous, run_dir=str(run_dir), logging=LoggingConfig(progress=False))


def run_scripted(run_cfg):
    """run_async of the tiny model from scratch on a scripted-game config; (task, result)."""
    from models.config import get_config
    from models.decoder import init_params
    from rl.run import make_task

    task = make_task(run_cfg.task, seed=0)
    cfg = get_config("tiny", vocab_size=16)
    return task, run_async(cfg, init_params(cfg, 0), task, run_cfg)


ARGS = ["--env", "scripted", "--steps", "2", "--group-size", "4", "--prompts-per-step", "2",
        "--eval-prompts", "4", "--eval-every", "0", "--no-progress", "--wandb", "disabled"]


def test_train_env_end_to_end(scripted, tmp_path):
    run_dir = tmp_path / "run"
    summary = main(ARGS + ["--run-dir", str(run_dir), "--env-option", "max_turns=3",
                           "--turn-credit", "turn", "--turn-credit-coef", "0.5"])
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(train) == 2 and len(evals) == 2
    b = 2 * 4
    # eval at step 0 (4 sampled + 4 greedy episodes), then 8 episodes per train step
    n_eval = 8
    for i, rec in enumerate(train):
        outcomes = OUTCOMES[n_eval + b * i:n_eval + b * (i + 1)]
        turns = TURNS[n_eval + b * i:n_eval + b * (i + 1)]
        assert rec["reward_mean"] == pytest.approx(np.mean(outcomes), abs=1e-6)
        assert rec["episode_turns"] == pytest.approx(np.mean(turns))
        # the loss counts the model's tokens only: one per turn (observations are context)
        assert rec["tokens"] == sum(turns) == rec["episode_model_tokens"] * b
        # one observation token between turns, none after the last
        assert rec["episode_obs_tokens"] == pytest.approx(rec["episode_turns"] - 1)
        ends = sum(rec[f"episode_end_{r}"] for r in ("done", "max_turns", "token_budget",
                                                    "env_error", "bad_result"))
        assert ends == pytest.approx(1.0)
        assert rec["episode_tool_calls"] == pytest.approx(rec["episode_end_done"])
        assert "episode_turn_reward" in rec and rec["adv_abs_mean"] > 0
    for rec in evals:  # the environment's outcome is the accuracy (no "correct" reward)
        assert rec["accuracy"] == pytest.approx(rec["reward"])
        assert rec["episode_turns"] >= 1 and rec["greedy_episode_turns"] >= 1
    assert np.mean(OUTCOMES[:4]) == pytest.approx(evals[0]["accuracy"], abs=1e-6)
    assert summary["steps"] == 2
    # experiments.evaluate rebuilds the environment from the run dir: greedy accuracy on the
    # same 4 held-out prompts equals the run's final greedy eval
    report = evaluate_main(["--model", str(run_dir), "--n", "4", "--no-progress"])
    assert report["task"] == "env:scripted" and report["n"] == 4
    assert report["accuracy"] == pytest.approx(evals[-1]["greedy_accuracy"], abs=1e-6)
    # the episode options are part of the run's recorded config: a resume that changes them
    # is refused
    with pytest.raises(SystemExit, match="episodes.turn_credit.coef"):
        main(ARGS + ["--run-dir", str(run_dir), "--env-option", "max_turns=3", "--resume",
                     "--steps", "3", "--turn-credit", "turn", "--turn-credit-coef", "0.25"])


def test_async_deterministic_runs_episodes(scripted, tmp_path):
    task, res = run_scripted(scripted_config(tmp_path / "a", AsyncConfig(
        max_staleness=1, mode="deterministic", proximal="exact")))
    assert isinstance(task, EnvTask) and task.options == EpisodeOptions()
    assert [r["step"] for r in res.train] == [1, 2, 3]
    for rec in res.train:
        assert rec["episode_turns"] >= 1
        # π_prox = the snapshot of each model token's own version: the same policy that
        # sampled it (observations, log μ = 0, are off the mask), so π_prox / μ is 1
        assert rec["mismatch_log_ratio_abs_mean"] < 1e-4
        assert rec["tokens"] == pytest.approx(rec["episode_model_tokens"] * 8)
    # step 1 samples with version 0; step 3 with version 1 (η = 1)
    assert res.train[-1]["behaviour_version_max"] == 1
    assert res.train[-1]["staleness_log_ratio_abs_mean"] > 1e-6  # π_θ (v=2) vs π_prox (v=1)
    assert take_episode_metrics(task) == {}  # every record drained its episodes


@pytest.mark.parametrize("rollout", ["static", "continuous"])
def test_threaded_producer_runs_episodes(scripted, tmp_path, rollout):
    """Episodes in the producer thread: every step trains on whole episodes within the
    staleness bound counted from each episode's oldest model token, observation tokens
    carry the version of the turn they answer, and the engine's slot / tool metrics are
    logged. The reference for the rewards is the episodes' own outcomes."""
    eta = 2
    _, res = run_scripted(scripted_config(
        tmp_path / rollout, AsyncConfig(max_staleness=eta, mode="threaded", rollout=rollout,
                                        proximal="exact" if rollout == "continuous"
                                        else "current"),
        steps=4, max_concurrent_tool_calls=4, tool_latency="fixed:0.01"))
    assert [r["step"] for r in res.train] == [1, 2, 3, 4]
    for rec in res.train:
        assert 0 <= rec["behaviour_version_max"] <= rec["step"] - 1
        assert rec["step"] - 1 - rec["behaviour_version_min"] <= eta  # oldest token admitted
        assert np.isfinite(rec["loss"])
        if rollout == "continuous":
            # Missing Old Logits' decomposition over whole episodes, logged per step: log
            # π_θ/μ = log π_prox/μ + log π_θ/π_prox with π_prox = each token's own
            # version's snapshot. The mismatch term is not 0 here: after an in-flight swap
            # the next tokens attend to KV the older version wrote (observations appended
            # too), which no single snapshot reproduces
            total = rec["mismatch_log_ratio_mean"] + rec["staleness_log_ratio_mean"]
            assert total == pytest.approx(rec["total_log_ratio_mean"], abs=1e-5)
            assert rec["mismatch_log_ratio_abs_mean"] >= 0
    got = [r for r in res.train if "episode_turns" in r]
    assert got and all(r["episode_turns"] >= 1 for r in got)
    assert any("slot_occupancy" in r and 0 < r["slot_occupancy"] <= 1 for r in got)


@pytest.mark.parametrize("extra, match", [
    (["--group-size", "1"], "group_size 1"),
    (["--task", "synthetic"], "--env and --task"),
    (["--prune"], "--prune"),
])
def test_refusals_before_compiling(scripted, tmp_path, capsys, extra, match):
    args = [a for a in ARGS if a not in ()]
    if extra[0] == "--group-size":
        i = args.index("--group-size")
        args = args[:i] + args[i + 2:]
    with pytest.raises(SystemExit) as err:
        main(args + extra + ["--run-dir", str(tmp_path / "r")])
    assert err.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["deterministic", "threaded"])
def test_april_rounds_run_episodes(scripted, tmp_path, mode):
    """APRIL with episodes (rl.rollout.april_episodes) in both async modes: every step
    trains on whole episodes within the staleness bound, the rounds carry unfinished
    groups (the counters say so and balance; rl/rollout/april_episodes' own tests show
    episodes carried mid-turn, token for token), and the episodes' metrics are logged; a
    deterministic run resumed from a checkpoint that carried groups counts them lost and
    starts them again."""
    from models.config import get_config
    from models.decoder import init_params

    eta = 2
    run_cfg = scripted_config(tmp_path / mode, AsyncConfig(
        max_staleness=eta, mode=mode, rollout="april", over_provision=2.0),
        steps=4, save_every=2, max_concurrent_tool_calls=0)
    task, res = run_scripted(run_cfg)
    cfg = get_config("tiny", vocab_size=16)
    assert [r["step"] for r in res.train] == [1, 2, 3, 4]
    for rec in res.train:
        assert rec["step"] - 1 - rec["behaviour_version_min"] <= eta
        # a threaded producer's episodes are metered at the step after the round that
        # sampled them: a step whose batch was queued before has none of its own
        assert np.isfinite(rec["loss"]) and rec.get("episode_turns", 1) >= 1
        assert rec["april_submitted"] + rec["april_restarted"] == (
            rec["april_harvested"] + rec["april_rejected"] + rec["april_lost"]
            + rec["april_in_engine"] + rec["april_in_hand"])
    assert sum("episode_turns" in r for r in res.train) >= (4 if mode == "deterministic" else 1)
    last = res.train[-1]
    assert last["april_harvested"] >= 4 * 2 and last["april_resumed"] > 0  # carried episodes
    if mode != "deterministic":
        return
    from rl.loops import Resume
    part = dataclasses.replace(run_cfg, loop=dataclasses.replace(run_cfg.loop, steps=3),
                               run_dir=str(tmp_path / "part"))
    cut = run_async(cfg, init_params(cfg, 0), task, part)
    again = run_async(cfg, init_params(cfg, 0), task, dataclasses.replace(part, loop=run_cfg.loop),
                      resume=Resume())
    after = [r for r in again.train if r["step"] > 3]  # (the records hold steps 1-3 too)
    assert [r["step"] for r in after] == [4]
    carried = cut.train[-1]["april_in_engine"] + cut.train[-1]["april_in_hand"]
    assert carried >= 1 and after[0]["april_lost"] == carried
    assert after[-1]["april_restarted"] == carried  # started again, first


def test_an_evals_episode_records_are_its_own(scripted):
    """The evaluator samples through own_records(task): episodes recorded into the train
    task meanwhile (a producer thread's) stay there for the train record, and the eval's
    never reach it."""
    import types

    from rl.envs.base import EndReason
    from rl.loops.episodes import own_records
    from rl.rollout.episodes import EpisodeRecord
    from rl.run import TaskSpec, make_task

    task = make_task(TaskSpec("env:scripted", {"max_turns": 3}), seed=0)
    view = own_records(task)
    assert view.env is task.env and view.options == task.options
    traj = types.SimpleNamespace(env_mask=np.array([[False, True]]),
                                 response_mask=np.array([[True, True]]))

    def rec(turns):
        r = EpisodeRecord(group_id=0, sample=0, prompt=task.train_prompts(0, 1)[0], turns=turns)
        r.end_reason = EndReason.DONE
        return r

    task.record([rec(3)], traj)  # the producer's train episode
    view.record([rec(1)], traj)  # the eval's
    assert take_episode_metrics(view)["episode_turns"] == 1.0
    assert take_episode_metrics(task)["episode_turns"] == 3.0
    assert take_episode_metrics(view) == {} and take_episode_metrics(task) == {}
    plain = make_task(TaskSpec("synthetic"), seed=0)
    assert own_records(plain) is plain
