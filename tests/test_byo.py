"""Bring your own model, data and reward, end to end on the command line: a tiny HF model
directory (models.tiny_hf) + a JSONL prompt file + a reward function in a module train
with `python -m experiments.train --model DIR --task file:... --reward module:function`;
the plan with its memory estimate is printed; the run is evaluated and exported
(`--dtype bfloat16 | float16 | float32`, files 0644) and transformers, an independent
implementation, loads each export and decodes the same greedy tokens as Tandem.

Also: each bad model, prompt file or reward function is refused before anything compiles
(no XLA compile event is seen)."""
import contextlib
import io
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from experiments.common.train_cli import main as train_main
from experiments.evaluate import main as evaluate_main
from experiments.export import main as export_main
from experiments.generate import generate_tokens
from models.assets import load_model
from models.tiny_hf import write_tiny_model
from rl.loops.config import LoopConfig, RewardConfig, RunConfig, TaskSpec
from rl.run import load_policy

DATA = Path(__file__).resolve().parent / "data" / "byo"
TASK = ["--task", f"file:{DATA / 'problems.jsonl'}", "--task-option", "max_prompt_len=160",
        "--task-option", "max_new_tokens=8", "--task-option", "instruction=",
        "--task-option", "eval_fraction=0.25", "--verifier", "exact"]
PROMPTS = ["What is 2 + 3?", "Name a colour.", "Ünïcödé 日本?"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, model dir, run dir, captured stderr of the run) of a 2-step run."""
    root = tmp_path_factory.mktemp("byo")
    model = write_tiny_model(root / "model")
    sys.path.insert(0, str(DATA))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            train_main(["--model", str(model), *TASK, "--reward", "rewards:exact_digits",
                        "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
                        "--segment-len", "8", "--eval-every", "0", "--eval-prompts", "4",
                        "--save-every", "1", "--wandb", "disabled",
                        "--run-dir", str(root / "run")])
    finally:
        sys.path.remove(str(DATA))
        sys.modules.pop("rewards", None)
    return root, model, root / "run", err.getvalue()


@pytest.mark.slow  # ~60 s on 2 cores: a 2-step run, an eval, three exports
def test_cli_run_records_model_task_and_reward(trained):
    root, model, run, stderr = trained
    assert f"model  {model}: llama, 0.1M params" in stderr
    assert "reward digits x1, short x1, correct x0, format x0 (function rewards:exact_digits)" \
        in stderr and "memory ~" in stderr
    cfg = RunConfig.load(run)
    assert cfg.model.name == str(model) and cfg.reward.function == "rewards:exact_digits"
    assert cfg.reward.verifier == "exact"
    assert dict(cfg.train.reward_weights) == {"correct": 0.0, "format": 0.0}
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2
    for r in train:  # trained on the function's rewards only: the logged ones weigh 0
        assert r["reward_mean"] == pytest.approx(r["reward_digits"] + r["reward_short"])
    assert {"reward_correct", "reward_format"} <= set(train[0])


def test_resume_with_another_reward_is_refused_before_a_step(trained, tmp_path, capsys):
    """The reward (function, verifier) is part of the checkpoint's config record: a resume
    that changes it stops with the fields named, and nothing is written to the run."""
    _, model, run, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = (copy / "metrics.jsonl").read_text()
    args = ["--model", str(model), *TASK, "--steps", "3", "--prompts-per-step", "2",
            "--group-size", "4", "--segment-len", "8", "--eval-every", "0", "--eval-prompts",
            "4", "--save-every", "1", "--wandb", "disabled", "--run-dir", str(copy), "--resume"]
    sys.path.insert(0, str(DATA))
    try:
        with pytest.raises(SystemExit) as exc:
            train_main([*args[:-1], "--verifier", "numeric", "--reward", "rewards:exact_digits",
                        "--resume"])
    finally:
        sys.path.remove(str(DATA))
        sys.modules.pop("rewards", None)
    msg = str(exc.value.code)
    assert msg.startswith("error: the resumed run's config differs"), msg
    assert "reward.verifier: checkpoint 'exact' -> now 'numeric'" in msg
    with pytest.raises(SystemExit) as exc:  # no reward function this time
        train_main(args)
    assert "reward.function: checkpoint 'rewards:exact_digits' -> now None" in str(exc.value.code)
    assert (copy / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_evaluate_a_run_uses_its_reward(trained, tmp_path):
    _, _, run, _ = trained
    sys.path.insert(0, str(DATA))
    try:
        report = evaluate_main(["--model", str(run), "--n", "4", "--no-progress",
                                "--out", str(tmp_path / "eval.json")])
    finally:
        sys.path.remove(str(DATA))
        sys.modules.pop("rewards", None)
    assert set(report["rewards"]) == {"digits", "short", "correct", "format"}
    assert report["accuracy_reward"] == "correct"
    assert report["reward"] == pytest.approx(report["rewards"]["digits"]
                                             + report["rewards"]["short"])


def tandem_greedy(path, text, n=8):
    config, params, tok = load_model(path)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    new, _, _ = generate_tokens(params, config, ids, max_new_tokens=n, greedy=True,
                                eos_ids=tok.eos_token_ids, prefill_chunk=None)
    return ids, new


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_export_loads_in_transformers_with_the_same_greedy_tokens(trained, dtype):
    root, model, run, _ = trained
    out = root / f"hf-{dtype}"
    summary = export_main(["--model", str(run), "--out", str(out), "--dtype", dtype])
    assert summary["dtype"] == dtype and summary["step"] == 2
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():  # the usual mode under the umask (0644 under 022), not 0600
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
    with safe_open(out / "model.safetensors", framework="np") as f:
        t = f.get_tensor("model.embed_tokens.weight")
    assert t.dtype == {"float32": np.float32, "float16": np.float16}.get(dtype, t.dtype)
    if dtype == "bfloat16":
        assert str(t.dtype) == "bfloat16"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in PROMPTS:
        ids, ours = tandem_greedy(out, text)
        rendered = hf_tok.apply_chat_template([{"role": "user", "content": text}],
                                              tokenize=False, add_generation_prompt=True)
        assert hf_tok(rendered, add_special_tokens=False)["input_ids"] == ids
        with torch.no_grad():
            got = hf.generate(torch.tensor([ids]), max_new_tokens=len(ours), do_sample=False,
                              eos_token_id=[257, 258], pad_token_id=257)
        assert got[0, len(ids):].tolist() == ours, (dtype, text)


@pytest.mark.slow
def test_export_defaults_to_the_models_own_dtype(trained, tmp_path):
    root, model, run, _ = trained
    bf16_model = root / "model-bf16"
    shutil.copytree(model, bf16_model)
    config = json.loads((bf16_model / "config.json").read_text())
    (bf16_model / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert export_main(["--model", str(run), "--out", str(tmp_path / "a")])["dtype"] == "float32"
    assert export_main(["--model", str(bf16_model), "--out", str(tmp_path / "b")])["dtype"] \
        == "bfloat16"
    with pytest.raises(SystemExit, match="--step is for a training run dir"):
        export_main(["--model", str(model), "--out", str(tmp_path / "c"), "--step", "1"])


# ----------------------------------------------------------------------------- early checks
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def broken_copy(tiny_dir, tmp_path, how):
    path = tmp_path / "model"
    shutil.copytree(tiny_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    tok = json.loads((path / "tokenizer_config.json").read_text())
    if how == "mistral":
        (path / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    elif how == "no weights":
        (path / "model.safetensors").unlink()
    elif how == "torch weights":
        (path / "model.safetensors").rename(path / "pytorch_model.bin")
    elif how == "no chat template":
        tok.pop("chat_template")
        (path / "tokenizer_config.json").write_text(json.dumps(tok))
    return path


def base_config(model, **task_options):
    options = {"max_prompt_len": 160, "max_new_tokens": 8, **task_options}
    return RunConfig(model=str(model), task=TaskSpec(f"file:{DATA / 'problems.jsonl'}", options),
                     reward=RewardConfig(verifier="exact"),
                     loop=LoopConfig(steps=1, prompts_per_step=2, group_size=2))


CASES = {
    "mistral": ({}, {}, r"architecture 'mistral' is not supported; Tandem loads llama \(Llama"),
    "no weights": ({}, {}, "has no weights: neither model.safetensors"),
    "torch weights": ({}, {}, r"PyTorch weights \['pytorch_model.bin'\]: convert them"),
    "no chat template": ({}, {}, "has no chat template.*chat=false"),
    "context": ({"max_prompt_len": 500, "max_new_tokens": 100}, {},
                r"= 600, more than the model's context \(512\)"),
    "column": ({"answer": "solution"}, {}, "has no column 'solution'"),
    "reward": ({}, {"function": "no_such_module_q:f"}, "cannot import module"),
    "verifier": ({}, {"verifier": "dataset"}, "verifier must be one of"),
    "synthetic": ({}, {}, "token-level, for the tiny random model.*--task file:PATH"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_inputs_are_refused_before_anything_compiles(tiny_dir, tmp_path, case):
    task_options, reward, message = CASES[case]
    model = broken_copy(tiny_dir, tmp_path, case) if case in (
        "mistral", "no weights", "torch weights", "no chat template") else tiny_dir
    cfg = base_config(model, **task_options)
    if case == "synthetic":
        cfg = cfg.override("task", TaskSpec("synthetic"))
    if reward:
        cfg = cfg.overrides({f"reward.{k}": v for k, v in reward.items()})
    compiles = []

    def listener(event, duration, **_):
        if "compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with pytest.raises(ValueError, match=message):
            load_policy(cfg.validate())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    if case == "no chat template":  # the plain prompt needs no template
        _, _, task = load_policy(base_config(model, chat=False))
        assert task.eval_prompts(1)[0].ids
    if case == "verifier":
        assert RewardConfig(verifier="exact").task_options == {"verifier": "exact"}
