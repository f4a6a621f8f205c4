"""Chat with a model from the command line.

    python -m experiments.generate --model smollm2-135m --prompt "What is 7 times 6?" --greedy

The prompt goes through the model's chat template; the completion is printed on stdout,
timings (compile separately from generation) on stderr. Sampling is the default, at
temperature 0.7 (a common chat default; use --greedy for argmax decoding).

The decode loop here is deliberately minimal (batch 1, one jitted prefill + one jitted
decode-and-sample step, host-side stop check); the rollout sampler replaces it later.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from models.assets import MODEL_REGISTRY, load_model
from models.decoder import decode_step, prefill
from models.kv_cache import init_cache

PROGRESS_BAR_MIN_TOKENS = 64  # show a tqdm bar only for generations longer than this


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """What to generate. temperature is ignored when greedy=True."""

    prompt: str
    model: str = "smollm2-135m"
    max_new_tokens: int = 128
    greedy: bool = False
    temperature: float = 0.7
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError("prompt is empty; pass some text with --prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not (self.temperature > 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0 (or use --greedy), got {self.temperature}")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """prompt_ids / new_ids: token ids; text: decoded completion (special tokens dropped);
    stopped_on_eos: whether an eos id ended it; *_s: wall-clock seconds."""

    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    stopped_on_eos: bool
    compile_s: float
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        # The first new token comes from prefill; the others each cost one decode step.
        steps = len(self.new_ids) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else float("nan")


def _sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, greedy: bool) -> jax.Array:
    """logits [batch, vocab] f32 -> token ids [batch] int32."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("config", "greedy"))
def _prefill_and_sample(params, tokens, lengths, cache, key, temperature, *, config, greedy):
    logits, cache = prefill(params, config, tokens, lengths, cache)
    last = logits[jnp.arange(tokens.shape[0]), lengths - 1]  # [batch, vocab]
    return _sample(last, key, temperature, greedy), cache


@partial(jax.jit, static_argnames=("config", "greedy"), donate_argnames=("cache",))
def _decode_and_sample(params, token, cache, key, temperature, *, config, greedy):
    logits, cache = decode_step(params, config, token, cache)
    return _sample(logits, key, temperature, greedy), cache


def generate_tokens(
    params,
    config,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    greedy: bool = False,
    temperature: float = 0.7,
    seed: int = 0,
    on_token: Callable[[int], None] | None = None,
) -> tuple[list[int], bool, dict[str, float]]:
    """Generate up to max_new_tokens after prompt_ids (batch 1), stopping after any eos id.

    Returns (new token ids, stopped_on_eos, timings {"compile_s", "prefill_s", "decode_s"}).
    Compilation is done ahead of time so that it is timed apart from generation.
    """
    t = len(prompt_ids)
    if t < 1:
        raise ValueError("prompt_ids is empty; the prompt must have at least one token")
    max_len = t + max_new_tokens
    if max_len > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({t} tokens) + max_new_tokens ({max_new_tokens}) = {max_len} exceeds the "
            f"model's max_position_embeddings={config.max_position_embeddings}; shorten the prompt "
            "or lower --max-new-tokens"
        )
    tokens = jnp.asarray([list(prompt_ids)], jnp.int32)
    lengths = jnp.asarray([t], jnp.int32)
    cache = init_cache(config, 1, max_len)
    key = jax.random.PRNGKey(seed)
    temp = jnp.float32(temperature)
    static = dict(config=config, greedy=greedy)

    t0 = time.perf_counter()
    prefill_fn = _prefill_and_sample.lower(params, tokens, lengths, cache, key, temp, **static).compile()
    step_fn = None
    if max_new_tokens > 1:
        step_fn = _decode_and_sample.lower(params, tokens[:, 0], cache, key, temp, **static).compile()
    compile_s = time.perf_counter() - t0

    eos = set(int(e) for e in eos_ids)
    t0 = time.perf_counter()
    token, cache = prefill_fn(params, tokens, lengths, cache, jax.random.fold_in(key, 0), temp)
    new_ids = [int(token[0])]  # host sync: prefill is done
    prefill_s = time.perf_counter() - t0
    if on_token is not None:
        on_token(new_ids[-1])
    t0 = time.perf_counter()
    while new_ids[-1] not in eos and len(new_ids) < max_new_tokens:
        token, cache = step_fn(params, token, cache, jax.random.fold_in(key, len(new_ids)), temp)
        new_ids.append(int(token[0]))
        if on_token is not None:
            on_token(new_ids[-1])
    decode_s = time.perf_counter() - t0
    timings = {"compile_s": compile_s, "prefill_s": prefill_s, "decode_s": decode_s}
    return new_ids, new_ids[-1] in eos, timings


def run(options: GenerateOptions, model=None) -> GenerationResult:
    """Load the model (or use `model` = (config, params, tokenizer)), apply the chat template
    to options.prompt and generate."""
    config, params, tokenizer = model if model is not None else load_model(options.model)
    text = tokenizer.apply_chat_template([{"role": "user", "content": options.prompt}], add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text)
    eos_ids = sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids))
    if not eos_ids:
        raise ValueError(f"model {options.model!r} declares no eos token; generation could not stop")
    bar = None
    if options.max_new_tokens > PROGRESS_BAR_MIN_TOKENS:
        bar = tqdm(total=options.max_new_tokens, unit="tok", desc="generating", file=sys.stderr, leave=False)
    try:
        new_ids, stopped, timings = generate_tokens(
            params, config, prompt_ids,
            max_new_tokens=options.max_new_tokens, eos_ids=eos_ids, greedy=options.greedy,
            temperature=options.temperature, seed=options.seed,
            on_token=None if bar is None else (lambda _tok: bar.update(1)),
        )
    finally:
        if bar is not None:
            bar.close()
    return GenerationResult(
        prompt_ids=prompt_ids, new_ids=new_ids, text=tokenizer.decode(new_ids, skip_special_tokens=True),
        stopped_on_eos=stopped, **timings,
    )


def parse_args(argv: Sequence[str] | None = None) -> GenerateOptions:
    parser = argparse.ArgumentParser(prog="python -m experiments.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"registered name ({', '.join(sorted(MODEL_REGISTRY))}), a .gguf file or an HF directory")
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        return GenerateOptions(prompt=args.prompt, model=args.model, max_new_tokens=args.max_new_tokens,
                               greedy=args.greedy, temperature=args.temperature, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))


def main(argv: Sequence[str] | None = None) -> GenerationResult:
    options = parse_args(argv)
    try:
        result = run(options)
    except (ValueError, FileNotFoundError) as e:  # bad input or missing model: message, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(result.text)
    n = len(result.new_ids)
    print(
        f"[{n} tokens{' (eos)' if result.stopped_on_eos else ''}; prompt {len(result.prompt_ids)} tokens "
        f"prefilled in {result.prefill_s:.2f} s; decode {result.decode_tokens_per_s:.1f} tokens/s; "
        f"compile {result.compile_s:.1f} s]",
        file=sys.stderr,
    )
    return result


if __name__ == "__main__":
    main()
