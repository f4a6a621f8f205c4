"""experiments.export: a training run's policy -> a Hugging Face model directory, checked
against transformers (an independent implementation) loading that directory.

A fake run dir is written exactly as the training loop writes one (TrainState from
rl.learner.init_train_state with the preset's optimizer, saved by rl.runtime.checkpoint's
Checkpointer, model.json from rl.run.record.model_record as rl.run.train writes it). Its model is SmolLM2-135M's architecture and tokenizer (the smollm2-rg preset's
model) shrunk to 2 layers of width 64: the full 135M model made the test take ~50 s on 2
cores (two 1.6 GB TrainState checkpoints), and its 30 fp32 layers alone differ from
transformers' by ~1.3e-4, above this test's 1e-4. The checkpoint holds the initial weights
perturbed by seeded noise, so only the checkpoint's params (not the initial ones) give
transformers' logits.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from experiments.export import main
from models.assets import load_model
from models.config import get_config
from models.decoder import forward, init_params
from rl.learner import init_train_state
from rl.run import PRESETS, RunDirError, RunPolicy, TaskSpec, load_policy, load_run
from rl.run.record import (
    load_tokenizer,
    model_config_from_dict,
    model_config_to_dict,
    model_record,
)
from rl.runtime.checkpoint import Checkpointer
from rl.runtime.logging import atomic_write_json

CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 + 25? Answer with a number."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Ünïcödé? 日本 🤖"}],
    [{"role": "user", "content": "  spaces,\ttabs\nand 1,000,000 digits <|im_end|> inline"}],
]


def perturb(params, seed: int, scale: float = 0.05):
    """Every leaf + scale * rms(leaf) * N(0, 1), seeded."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = [x + scale * jnp.sqrt(jnp.mean(jnp.square(x))) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
    return treedef.unflatten(out)


def write_run(run_dir, preset, config, checkpoints: dict, seed: int = 0) -> None:
    """A run dir as rl.run.train leaves it: model.json + orbax TrainState checkpoints
    ({step: params}; the optimizer state is the preset's, as the loop builds it)."""
    atomic_write_json(run_dir / "model.json", model_record(preset.override("loop.seed", seed),
                                                           config))
    with Checkpointer(run_dir / "checkpoints", keep=preset.loop.keep_checkpoints) as ck:
        for step, params in checkpoints.items():
            state = init_train_state(params, preset.train, seed)
            state = state.replace(step=jnp.int32(step), version=jnp.int32(step))
            ck.save(step, state, {"data_position": step * preset.loop.prompts_per_step,
                                  "task": preset.task.spec})


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


# ----------------------------------------------------------------------------- SmolLM2
SMALL_SMOLLM2 = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                 "num_kv_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory):
    """(out_dir, initial params, perturbed params, config, tokenizer) of an exported fake
    smollm2-rg run whose latest checkpoint (step 50) holds the perturbed weights."""
    preset = PRESETS["smollm2-rg"]
    # SmolLM2's vocab and special ids, fp32
    config = get_config(preset.model.name, **SMALL_SMOLLM2)
    tok = load_tokenizer({"model": preset.model.name})  # Tandem's SmolLM2 tokenizer (from the GGUF)
    params = init_params(config, 0)
    trained = perturb(params, seed=1)
    root = tmp_path_factory.mktemp("export")
    write_run(root / "run", preset, config, {25: params, 50: trained})
    # fp32 for the 1e-4 logit comparison; the default would be SmolLM2's own bfloat16
    summary = main(["--run-dir", str(root / "run"), "--out", str(root / "hf"),
                    "--dtype", "float32"])
    assert summary["step"] == 50 and summary["tokenizer"] and summary["dtype"] == "float32"
    return root / "hf", params, trained, config, tok


def test_exported_smollm2_logits_match_transformers(smollm2_export):
    out, initial, trained, config, tok = smollm2_export
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True))
               for m in CONVERSATIONS]
    width = max(map(len, prompts))
    # Right padding: causal attention keeps every real position independent of the padding.
    tokens = np.full((len(prompts), width), config.pad_token_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    valid = np.arange(width)[None, :] < np.array([len(p) for p in prompts])[:, None]

    ref = hf_logits(hf_model(out), tokens)
    ours = np.asarray(forward(trained, config, tokens))
    assert ref.shape == ours.shape == (len(prompts), width, config.vocab_size)
    err = np.abs(ours - ref)[valid].max()
    assert err <= 1e-4, f"max abs logit error {err}"
    # The check can tell the checkpoint's weights from the initial ones.
    initial_err = np.abs(np.asarray(forward(initial, config, tokens)) - ref)[valid].max()
    assert initial_err > 1e-2, initial_err

    gen = json.loads((out / "generation_config.json").read_text())
    # eos: the tokenizer's <|im_end|> and the smollm2 preset's <|endoftext|>.
    assert gen == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2}
    provenance = json.loads((out / "tandem_export.json").read_text())
    assert provenance["step"] == 50 and provenance["model"] == "smollm2-135m"
    assert provenance["task"] == "reasoning_gym:chain_sum"
    assert provenance["preset"] == "smollm2-rg"


def test_exported_tokenizer_matches_tandem(smollm2_export):
    out, _, _, config, tok = smollm2_export
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert hf_tok.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=gen) == text
            ids = tok.encode(text)
            assert hf_tok.encode(text, add_special_tokens=False) == ids
            assert hf_tok.encode(text) == tok.encode(text, add_special_tokens=True)
            assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)
            assert hf_tok.decode(ids) == tok.decode(ids, skip_special_tokens=False) == text
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_ids[0], tok.pad_token_id)
    assert len(hf_tok) == tok.vocab_size
    # Tandem reads its own export back: same tokenizer, same config.
    config2, _, tok2 = load_model(out)
    assert config2 == config
    assert tok2.chat_template == tok.chat_template
    assert tok2.eos_token_ids == config.eos_token_ids == (2, 0)  # generation_config.json's
    assert tok2.encode(text) == tok.encode(text)


# ----------------------------------------------------------------------------- tiny
def test_tiny_run_exports_weights_without_tokenizer(tmp_path, capsys):
    preset = PRESETS["tiny-synthetic"]
    config, params, _ = load_policy(preset, 0)
    later = perturb(params, seed=2, scale=0.5)
    write_run(tmp_path / "run", preset, config, {1: params, 2: later})

    policy = load_run(tmp_path / "run", step=1)  # no TrainConfig needed: params only
    assert isinstance(policy, RunPolicy) and policy.step == 1 and policy.tokenizer is None
    assert policy.model_config == config and policy.meta["task"] == "synthetic"
    assert policy.meta["task_options"] == preset.task.kwargs
    for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    main(["--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert "no tokenizer written" in capsys.readouterr().err
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    ref = hf_logits(hf_model(tmp_path / "hf"), tokens)
    assert np.abs(np.asarray(forward(later, config, tokens)) - ref).max() <= 1e-4

    # --step picks an older checkpoint; --force replaces the model files.
    main(["--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--step", "1",
          "--force"])
    ref = hf_logits(hf_model(tmp_path / "hf"), tokens)
    assert np.abs(np.asarray(forward(params, config, tokens)) - ref).max() <= 1e-4


def test_model_config_json_round_trip():
    for name in ("tiny", "smollm2-135m", "llama-3.2-1b", "qwen3-0.6b"):
        config = get_config(name)
        d = model_config_to_dict(config)
        assert model_config_from_dict(json.loads(json.dumps(d))) == config
    run = PRESETS["tiny-synthetic"].override("loop.seed", 3)
    record = model_record(run.override("task", TaskSpec("reasoning_gym:chain_sum", {"size": 2})),
                          get_config("tiny"))
    assert record["task"] == "reasoning_gym:chain_sum" and record["task_options"] == {"size": 2}
    assert record["seed"] == 3 and record["model"] == "tiny" and record["preset"] == "tiny-synthetic"
    with pytest.raises(ValueError, match="colour"):
        model_config_from_dict({**model_config_to_dict(get_config("tiny")), "colour": 1})


# ----------------------------------------------------------------------------- bad input
def test_bad_input_gives_clear_errors(tmp_path):
    preset = PRESETS["tiny-synthetic"]
    config = get_config("tiny", vocab_size=16)
    out = ["--out", str(tmp_path / "hf")]
    with pytest.raises(SystemExit, match="does not exist; pass the run dir of a run made by rl.run.train"):
        main(["--run-dir", str(tmp_path / "missing"), *out])

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(SystemExit, match="predates model.json or was not made by"):
        main(["--run-dir", str(run), *out])
    (run / "model.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not a valid model.json"):
        main(["--run-dir", str(run), *out])

    atomic_write_json(run / "model.json", model_record(preset, config))
    no_ckpt = "run has no checkpoint.*train with --save-every or let it finish"
    with pytest.raises(SystemExit, match=no_ckpt):
        main(["--run-dir", str(run), *out])
    (run / "checkpoints").mkdir()  # a run stopped before its first save
    with pytest.raises(RunDirError, match=no_ckpt):
        load_run(run)

    write_run(run, preset, config, {3: init_params(config, 0)})
    with pytest.raises(SystemExit, match=r"step 7 not found.*available steps: \[3\]"):
        main(["--run-dir", str(run), *out, "--step", "7"])

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty; pass --force"):
        main(["--run-dir", str(run), *out])
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["notes.txt"]
    main(["--run-dir", str(run), *out, "--force"])
    assert (tmp_path / "hf" / "notes.txt").read_text() == "mine"  # only model files replaced
    assert (tmp_path / "hf" / "model.safetensors").is_file()

    wrong = get_config("tiny", vocab_size=32)  # model.json that does not match the weights
    atomic_write_json(run / "model.json", model_record(preset, wrong))
    with pytest.raises(RunDirError, match=r"does not match model.json's model_config: "
                       r"\['params'\]\['embed'\]\['embedding'\] has shape \(16, 64\)"):
        load_run(run)
