"""Chat with a model from the command line.

    python -m experiments.generate --model smollm2-135m --prompt "What is 7 times 6?" --greedy

The prompt goes through the model's chat template; the completion is printed on stdout,
timings (compile separately from generation) on stderr. Sampling is the default, at
temperature 0.7 (a common chat default; use --greedy for argmax decoding). Prompts longer
than --prefill-chunk tokens (default 512) prefill in chunks of that many (bounded memory,
models/chunked_prefill.py) behind a progress bar; --prefill-chunk 0 prefills in one shot.

Decoding is the rollout sampler's (rl.rollout.sampler): one decode loop in the codebase.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from tqdm import tqdm

from experiments.common.benchmarking import compile_seconds
from models.assets import MODEL_REGISTRY, load_model
from models.chunked_prefill import DEFAULT_CHUNK, check_chunk_size
from rl import rollout

PROGRESS_BAR_MIN_TOKENS = 64  # show a tqdm bar only for generations longer than this
SEGMENT_TOKENS = 16  # tokens per sampler call: the progress bar advances per segment


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """What to generate. temperature is ignored when greedy=True."""

    prompt: str
    model: str = "smollm2-135m"
    max_new_tokens: int = 128
    greedy: bool = False
    temperature: float = 0.7
    seed: int = 0
    prefill_chunk: int | None = DEFAULT_CHUNK  # None: one-shot prefill

    def __post_init__(self):
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError("prompt is empty; pass some text with --prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not (self.temperature > 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0 (or use --greedy), got {self.temperature}")
        check_chunk_size(self.prefill_chunk)


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
        return len(self.new_ids) / self.decode_s if self.new_ids and self.decode_s > 0 else float("nan")


class PrefillBar:
    """A tqdm bar over prefill chunks (created at the first chunk, so short prompts that
    prefill in one shot show none) with the prompt tokens/s so far; a progress callback
    for rl.rollout.prefill."""

    def __init__(self):
        self.bar, self.tokens, self.t0 = None, 0, time.perf_counter()

    def __call__(self, i: int, n: int, tokens: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=n, unit="chunk", desc="prefill", file=sys.stderr, leave=False)
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
    on_tokens: Callable[[int], None] | None = None,
    prefill_chunk: int | None = DEFAULT_CHUNK,
    on_prefill: Callable[[int, int, int], None] | None = None,
) -> tuple[list[int], bool, dict[str, float]]:
    """Generate up to max_new_tokens after prompt_ids (one sample) with the rollout
    sampler, stopping after any eos id. on_tokens(n) is called after each segment with the
    number of new tokens. The prompt prefills once: in chunks of prefill_chunk tokens when
    it is longer (None: one shot), calling on_prefill(i, n, tokens) after chunk i of n.
    Returns (new token ids, stopped_on_eos, timings {"compile_s", "prefill_s",
    "decode_s"}): the first calls compile as they go; the seconds jax spent compiling
    (`compile_seconds`) are reported as compile_s and left out of the other two."""
    if len(prompt_ids) < 1:
        raise ValueError("prompt_ids is empty; the prompt must have at least one token")
    max_len = len(prompt_ids) + max_new_tokens
    if max_len > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {max_len} "
            f"exceeds the model's max_position_embeddings={config.max_position_embeddings}; "
            "shorten the prompt or lower --max-new-tokens")
    cfg = (rollout.SamplingConfig(greedy=True) if greedy
           else rollout.SamplingConfig(temperature=temperature))
    state = rollout.init_state(config, num_slots=1, max_prompt_len=len(prompt_ids),
                                max_new_tokens=max_new_tokens, sampling=cfg, stop_ids=eos_ids,
                                prefill_chunk=prefill_chunk)
    keys = rollout.sample_keys(seed, [0], 1)
    with compile_seconds() as compiled:
        t0 = time.perf_counter()
        live = jax.block_until_ready(
            rollout.prefill(params, state, [list(prompt_ids)], [[0]], keys, progress=on_prefill))
        prefill_wall, prefill_compile = time.perf_counter() - t0, compiled[0]
        t0, produced = time.perf_counter(), 0
        while not bool(live.done[0]):
            live = rollout.decode_segment(params, live, SEGMENT_TOKENS, 0)
            n = int(live.num_generated[0])
            if on_tokens is not None:
                on_tokens(n - produced)
            produced = n
        decode_wall = time.perf_counter() - t0
    sample = rollout.read_slots(live, [0])[0]
    timings = {"compile_s": compiled[0], "prefill_s": prefill_wall - prefill_compile,
               "decode_s": decode_wall - (compiled[0] - prefill_compile)}
    return sample.response_ids.tolist(), sample.stopped, timings


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
    prefill_bar = PrefillBar()
    try:
        new_ids, stopped, timings = generate_tokens(
            params, config, prompt_ids,
            max_new_tokens=options.max_new_tokens, eos_ids=eos_ids, greedy=options.greedy,
            temperature=options.temperature, seed=options.seed,
            on_tokens=None if bar is None else bar.update,
            prefill_chunk=options.prefill_chunk, on_prefill=prefill_bar,
        )
    finally:
        prefill_bar.close()
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
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_CHUNK,
                        help=f"prefill prompts in chunks of this many tokens (default {DEFAULT_CHUNK}; "
                             "bounded memory, a progress bar); 0 = one shot")
    args = parser.parse_args(argv)
    try:
        return GenerateOptions(prompt=args.prompt, model=args.model, max_new_tokens=args.max_new_tokens,
                               greedy=args.greedy, temperature=args.temperature, seed=args.seed,
                               prefill_chunk=args.prefill_chunk or None)
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
