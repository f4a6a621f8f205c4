"""What a run is about to do, printed before it starts: the model, the task and its rewards,
the batch, and an estimate of the memory the chosen batch needs.

    print(format_plan(cfg, model_config, task))
    estimate = estimate_memory(model_config, cfg, task)   # MemoryEstimate, bytes per part

`estimate_memory` is arithmetic on the config, not a measurement. Parts (B = rows per
step = prompts_per_step x group_size, L = max_prompt_len + max_new_tokens, b = bytes of
the param dtype):
  params      every parameter, b each (the frozen base of a LoRA run included)
  gradients   the trained parameters (adapters for LoRA), b each
  optimizer   AdamW's two moments per trained parameter, b each (SGD: none)
  reference   a second copy of the params when a KL term needs the reference policy
              (full fine-tuning with loss.kl_coef > 0; LoRA reuses the base)
  snapshots   the asynchronous loop's param ring: ring_capacity copies of the trained params
              (snapshot_store "disk": at most 2 in memory, the rest on disk)
  kv_cache    the sampler's keys and values: B rows x L positions x layers x 2 x kv_heads
              x head_dim, in the rollouts' compute dtype (rollout.dtype, else the
              model's; the evals' cache is in the model's)
  activations the learner's saved activations for one micro-batch, by the remat policy
              (train.remat, else the model config's): "none" keeps per layer tokens x
              (4 hidden + 2 q/o + 2 k/v + 2 mlp widths) floats plus the attention scores
              (rows x heads x positions²); "dots" keeps per layer the projections' outputs
              (q + 2 k/v + hidden + 2 mlp widths + hidden) and "full" the layer's input
              (hidden), each plus one layer's "none" set for the recomputation; in the
              compute dtype; packed groups count their prompt once (prompts_per_step x
              (prompt + group_size x response))
  head        the chunked vocabulary head: logprob_chunk x vocab floats, x 3 (forward,
              backward, softmax), plus the other chunks' logits kept for the backward
              (head tokens x vocab floats in all) when train.keeps_head_logits; the head
              runs on the scored positions only: a packed micro-batch's response tokens,
              an unpacked one's rows x (length - 1)
  runtime     a fixed 1 GiB for the JAX / XLA process (compiled programs, buffers)

`total` is the training step's sum. The evals hold params, optimizer state, reference and
snapshots too, with their own KV cache (`eval_kv_cache`: one row per eval prompt, or
loop.eval_max_rows rows at a time) instead of the learner's parts; `peak` is the larger of
the two. The eval side counts the KV cache only: the prefill's temporaries come on top.

Against measurements (the peak resident memory of the run's step profile, CPU): the
smollm2-rg preset estimates 10.3 GB and measured 10.5 GB (docs/results/real-model-step.md;
the head's kept logits counted over the 3,072 response tokens);
a run of the tiny HF model (models.tiny_hf; 2 prompts x 4 samples, 160 + 8 tokens)
estimates 1.09 GB and measured 1.05 GB, nearly all of it the runtime; smollm2-rg with
`--remat full` estimates 4.82 GB a step and measured 5.19-5.31 GB, with `--low-memory`
4.36 GB and 3.90-4.10 GB. The evals are underestimated: an unchunked 256-prompt eval of
smollm2-rg estimates 4.76 GB and reached >= 8 GB (docs/results/learner-memory.md). On a GPU XLA's
allocator preallocates most of the device's memory, so compare with the profile's peak,
not with nvidia-smi.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from models.config import ModelConfig

GIB = 1 << 30
RUNTIME_BYTES = GIB
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per part (module docstring); total their sum."""

    params: int
    gradients: int
    optimizer: int
    reference: int
    snapshots: int
    kv_cache: int
    activations: int
    head: int
    runtime: int = RUNTIME_BYTES
    eval_kv_cache: int = 0

    @property
    def total(self) -> int:
        """The training step: every part but eval_kv_cache."""
        return sum(getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name != "eval_kv_cache")

    @property
    def eval_total(self) -> int:
        """An eval: the state the run keeps (params, optimizer, reference, snapshots,
        runtime) and the eval's KV cache."""
        return (self.params + self.optimizer + self.reference + self.snapshots + self.runtime
                + self.eval_kv_cache)

    @property
    def peak(self) -> int:
        return max(self.total, self.eval_total)

    def format(self) -> str:
        parts = ", ".join(f"{f.name} {gb(getattr(self, f.name))}" for f in dataclasses.fields(self)
                          if getattr(self, f.name) and f.name != "eval_kv_cache")
        evals = (f"; evals ~{gb(self.eval_total)} (KV cache {gb(self.eval_kv_cache)})"
                 if self.eval_kv_cache else "")
        return f"~{gb(self.total)} a step ({parts}){evals}"


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n < 1e11 else f"{n / 1e9:.0f} GB"


def count_params(config: ModelConfig, lora: Any = None) -> tuple[int, int]:
    """(all parameters, trained parameters): the model's, and the LoRA adapters' when
    `lora` (a models.lora.LoraConfig) is given (else all are trained). Shapes only."""
    import jax

    from models.decoder import init_params

    shapes = jax.eval_shape(lambda: init_params(config, 0))
    total = int(sum(x.size for x in jax.tree.leaves(shapes)))
    if lora is None:
        return total, total
    from models.lora import init_lora

    adapters = jax.eval_shape(lambda: init_lora(init_params(config, 0), lora, 0))
    return total, int(sum(x.size for x in jax.tree.leaves(adapters)))


def estimate_memory(model_config: ModelConfig, cfg: Any, task: Any) -> MemoryEstimate:
    """The memory estimate of a run of `cfg` (a RunConfig) on `task` (module docstring)."""
    from models.decoder import remat_policy

    c, train, loop = model_config, cfg.train, cfg.loop
    b = _BYTES[c.param_dtype]
    act = _BYTES[c.dtype]
    total, trained = count_params(c, train.lora)
    rows = loop.prompts_per_step * loop.group_size
    prompt, response = int(task.max_prompt_len), int(task.max_new_tokens)
    length = prompt + response
    kv = (rows * length * c.num_layers * 2 * c.num_kv_heads * c.head_dim
          * _BYTES[cfg.rollout.dtype or c.dtype])
    if train.packed:
        tokens = loop.prompts_per_step * (prompt + loop.group_size * response)
    else:
        tokens = rows * length
    tokens = -(-tokens // train.micro_batches)
    q = c.num_heads * c.head_dim
    k = c.num_kv_heads * c.head_dim
    per_token = 4 * c.hidden_size + 2 * q + 2 * k + 2 * c.intermediate_size
    scores = -(-rows // train.micro_batches) * c.num_heads * length * length
    layer = tokens * per_token + scores  # one layer's activations, no remat
    policy = remat_policy(c.remat if train.remat is None else train.remat)
    if policy == "none":
        activations = layer * c.num_layers * act
    else:  # what each layer keeps, plus one layer recomputed in the backward
        kept = (q + 2 * k + 2 * c.hidden_size + 2 * c.intermediate_size
                if policy == "dots" else c.hidden_size)
        activations = (tokens * kept * c.num_layers + layer) * act
    eval_rows = loop.eval_prompts if not loop.eval_max_rows else min(loop.eval_max_rows,
                                                                     loop.eval_prompts)
    eval_kv = eval_rows * length * c.num_layers * 2 * c.num_kv_heads * c.head_dim * act
    # the head runs on the positions that are scored: a packed micro-batch's response
    # tokens, an unpacked one's rows x (length - 1) (rl.learner.step: the same count decides
    # whether the logits are kept)
    if train.packed:
        head_tokens = -(-rows * response // train.micro_batches)
    else:
        head_tokens = -(-rows // train.micro_batches) * (length - 1)
    chunk = min(train.logprob_chunk or head_tokens, head_tokens)
    head = 3 * chunk * c.vocab_size * 4
    if train.logprob_chunk and train.keeps_head_logits(head_tokens, c.vocab_size):  # all kept
        head += (head_tokens - chunk) * c.vocab_size * 4
    adam = train.optimizer.name == "adamw"
    reference = total * b if (train.lora is None and train.loss.kl_coef > 0) else 0
    snapshots = 0 if cfg.asynchronous is None else cfg.asynchronous.resident_snapshots * trained * b
    return MemoryEstimate(params=total * b, gradients=trained * b,
                          optimizer=(2 * trained * b) if adam else 0, reference=reference,
                          snapshots=snapshots, kv_cache=kv, activations=activations, head=head,
                          eval_kv_cache=eval_kv)


def format_plan(cfg: Any, model_config: ModelConfig, task: Any) -> str:
    """The plan printed before a run starts: model, task, rewards and their weights, batch,
    steps, and the memory estimate."""
    c, loop = model_config, cfg.loop
    total, trained = count_params(c, cfg.train.lora)
    weights = dict(cfg.train.reward_weights)
    rewards = ", ".join(f"{n} x{weights.get(n, 1.0):g}" for n in task.reward_names)
    fn = cfg.reward.function
    lines = [
        f"model  {cfg.model.name}: {c.arch}, {total / 1e6:.1f}M params"
        + ("" if trained == total else f" ({trained / 1e6:.2f}M trained, LoRA)")
        + f", {c.num_layers} layers, params {c.param_dtype}, compute {c.dtype}, context "
          f"{c.max_position_embeddings}",
        f"task   {task.name}: prompts <= {task.max_prompt_len} tokens + responses <= "
        f"{task.max_new_tokens}" + ("" if not hasattr(task, "sizes") else
                                    f"; {task.sizes['train']} train / "
                                    f"{task.sizes['eval']} eval rows"),
        f"reward {rewards}" + ("" if fn is None else f" (function {fn})")
        + (f"; verifier {getattr(task, 'verifier')}" if hasattr(task, "verifier") else ""),
        f"batch  {loop.prompts_per_step} prompts x {loop.group_size} samples, {loop.steps} steps, "
        f"micro-batches {cfg.train.micro_batches}" + (", packed" if cfg.train.packed else "")
        + ("" if cfg.asynchronous is None else
           f", async (max_staleness {cfg.asynchronous.max_staleness})"),
        f"memory {estimate_memory(c, cfg, task).format()} (an estimate: rl.run.plan)",
    ]
    return "\n".join(lines)


__all__ = ["MemoryEstimate", "count_params", "estimate_memory", "format_plan"]
