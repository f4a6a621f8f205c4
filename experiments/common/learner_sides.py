"""The sides of experiments.bench.learner's comparison, for one batch: the library's
jitted step, its plain-JAX floor and their breakdown pieces (`JaxSides`), a run preset's
learner options on the same samples (`preset_side`) and transformers + torch
(`TorchSide`); and the batch they share (`make_batch`). Nothing heavy is imported at
module level: the benchmark sets torch's environment before torch or jax start."""
from __future__ import annotations

from typing import Any

GROUP = 8  # rows per GRPO group (a prompt shared by each group's rows)


def make_batch(b: int, t: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """Host arrays: tokens [B, T] int32, loss_mask [B, T] bool (True at response tokens),
    rewards [B] float32 and GRPO advantages [B] (group-normalised rewards)."""
    import numpy as np

    if b % GROUP:
        raise ValueError(f"batch {b} must be a multiple of the group size {GROUP}")
    rng = np.random.default_rng(seed)
    p = t // 4
    tokens = rng.integers(0, vocab, (b, t), dtype=np.int32)
    mask = np.zeros((b, t), bool)
    for g in range(b // GROUP):
        rows = slice(g * GROUP, (g + 1) * GROUP)
        tokens[rows, :p] = tokens[g * GROUP, :p]  # the group's shared prompt
    for i in range(b):
        r = int(rng.integers(t // 2, t - p + 1))
        mask[i, p:p + r] = True
        tokens[i, p + r:] = 0  # right padding
    rewards = rng.standard_normal(b).astype(np.float32)
    grp = rewards.reshape(-1, GROUP)
    adv = ((grp - grp.mean(1, keepdims=True)) / (grp.std(1, keepdims=True) + 1e-6)).reshape(-1)
    return {"tokens": tokens, "mask": mask, "rewards": rewards, "adv": adv.astype(np.float32)}



def floor_functions(config, tx):
    """(loss_fn, plain_step, opt_only, head_loss): the plain-JAX floor's pieces, written the
    way a user writes them (value_and_grad through models.decoder.forward, then optax)."""
    import jax
    import jax.numpy as jnp
    import optax

    from models.decoder import forward

    def loss_fn(p, tokens, mask, adv, norm=None):
        logits = forward(p, config, tokens)
        z = logits[:, :-1]
        picked = jnp.take_along_axis(z, tokens[:, 1:, None], axis=-1)[..., 0]
        logp = picked - jax.nn.logsumexp(z, axis=-1)
        norm = jnp.maximum(jnp.sum(mask), 1.0) if norm is None else norm
        return -jnp.sum(adv[:, None] * logp * mask) / norm

    def micro_value_and_grad(p, tokens, mask, adv):
        """Gradient accumulation over the leading micro-batch axis (exact: each
        micro-batch's loss is divided by the whole batch's token count)."""
        if tokens.shape[0] == 1:
            return jax.value_and_grad(loss_fn)(p, tokens[0], mask[0], adv[0])
        norm = jnp.maximum(jnp.sum(mask), 1.0)

        def body(acc, mb):
            loss, g = jax.value_and_grad(loss_fn)(p, *mb, norm)
            return jax.tree.map(jnp.add, acc, g), loss

        g, ls = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), (tokens, mask, adv))
        return jnp.sum(ls), g

    def plain_step(p, opt_state, tokens, mask, adv):
        loss, g = micro_value_and_grad(p, tokens, mask, adv)
        upd, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, upd), opt_state, loss

    def opt_only(p, opt_state, g):
        upd, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, upd), opt_state

    def head_loss(h, emb, tokens, mask, adv):  # final hidden [B, T, E] -> loss
        z = jnp.einsum("bse,ve->bsv", h, emb, preferred_element_type=jnp.float32)[:, :-1]
        picked = jnp.take_along_axis(z, tokens[:, 1:, None], axis=-1)[..., 0]
        logp = picked - jax.nn.logsumexp(z, axis=-1)
        return -jnp.sum(adv[:, None] * logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return loss_fn, plain_step, opt_only, head_loss


class JaxSides:
    """The Tandem step, the plain-JAX step and their breakdown pieces for one batch."""

    def __init__(self, config, params, batch: dict[str, Any], options: dict | None,
                 micro_batches: int = 1, preset: str | None = None):
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax

        from models.logprobs import token_logprobs
        from rl.learner import (
            OptimizerConfig,
            TrainBatch,
            TrainConfig,
            init_train_state,
            make_train_step,
        )
        from rl.objectives.losses import LossConfig

        self.jax = jax
        b, t = batch["tokens"].shape
        self.config = config
        self.train_config = TrainConfig(
            loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
            optimizer=OptimizerConfig(name="adamw", learning_rate=1e-6, weight_decay=0.0,
                                      max_grad_norm=1.0),
            old_logp="current", micro_batches=micro_batches)
        self.tandem_step = make_train_step(self.train_config, config, compiler_options=options)
        self.tandem_batch = TrainBatch(
            tokens=jnp.asarray(batch["tokens"]),
            positions=jnp.asarray(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()),
            loss_mask=jnp.asarray(batch["mask"]),
            behaviour_logprobs=jnp.zeros((b, t), jnp.float32),
            versions=jnp.zeros((b, t), jnp.int32),
            rewards=jnp.asarray(batch["rewards"][:, None]),
            group_size=GROUP, reward_names=("reward",))
        # the library's state is donated: keep it alive across calls
        self.params = params
        self.tandem_state = self.tandem_step.place_state(
            init_train_state(jax.tree.map(jnp.copy, params), self.train_config))

        tokens = jnp.asarray(batch["tokens"])
        mask = jnp.asarray(batch["mask"][:, 1:]).astype(jnp.float32)
        adv = jnp.asarray(batch["adv"])
        self.data = (tokens, mask, adv)
        m = micro_batches
        self.micro_data = tuple(x.reshape((m, x.shape[0] // m) + x.shape[1:])
                                for x in self.data)

        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6, weight_decay=0.0))
        self.tx = tx
        loss_fn, plain_step, opt_only, head_loss = floor_functions(config, tx)

        # the floor compiles with the library's own CPU defaults (and the caller's options
        # on top): the two sides then differ only in what they compute
        from rl.learner.jitted import cpu_default_options
        floor_options = {**dict(cpu_default_options()), **dict(options or {})} or None

        def jit(f, **kw):
            return jax.jit(f, compiler_options=floor_options, **kw)

        self.plain_fn = plain_step  # un-jitted: a jaxpr of a jit with compiler options fails
        self.plain_step = jit(plain_step, donate_argnums=(0, 1))
        self.plain_state = (jax.tree.map(jnp.copy, params), tx.init(params))
        self.fwd = jit(loss_fn)
        self.fwd_bwd = jit(jax.value_and_grad(loss_fn))
        self.opt = jit(opt_only)
        self.head = jit(jax.value_and_grad(head_loss, argnums=(0, 1)))
        positions = self.tandem_batch.positions
        self.logprobs = jit(lambda p, tk: token_logprobs(p, config, tk, positions, 1.0)[0])
        self.hidden = jax.random.normal(jax.random.PRNGKey(0), (b, t, config.hidden_size),
                                        jnp.float32)
        self._grads = None
        self.preset = None
        if preset is not None:
            self.preset = preset_side(preset, config, params, batch, micro_batches, options)

    def matmul_flops(self) -> dict[str, int]:
        """Matmul FLOPs of one step of each side, counted from its jaxpr
        (experiments.common.jaxpr_flops): equal counts = the same matmuls."""
        from functools import partial

        from experiments.common.jaxpr_flops import matmul_flops
        from rl.learner.step import train_step

        def library(cfg, state, batch):
            return matmul_flops(partial(train_step, config=cfg, model_config=self.config),
                                state, batch)

        out = {"tandem": library(self.train_config, self.tandem_state, self.tandem_batch),
               "jax": matmul_flops(self.plain_fn, *self.plain_state, *self.micro_data)}
        if self.preset is not None:
            out["tandem[preset]"] = library(*self.preset[:3])
        return out

    def matmul_gflop(self) -> dict[str, float]:
        """matmul_flops() in GFLOP (3 decimals), for the JSON."""
        return {k: round(v / 1e9, 3) for k, v in self.matmul_flops().items()}

    def run_preset(self):
        cfg, state, batch, step = self.preset
        state, metrics = step(state, batch)
        self.preset = (cfg, state, batch, step)
        self.jax.block_until_ready(metrics["loss"])

    def run_tandem(self):
        self.tandem_state, metrics = self.tandem_step(self.tandem_state, self.tandem_batch)
        self.jax.block_until_ready(metrics["loss"])

    def run_plain(self):
        p, o, loss = self.plain_step(*self.plain_state, *self.micro_data)
        self.plain_state = (p, o)
        loss.block_until_ready()

    def run_fwd(self):
        self.fwd(self.params, *self.data).block_until_ready()

    def run_fwd_bwd(self):
        self._grads = None  # never hold two gradients at once
        _, g = self.fwd_bwd(self.params, *self.data)
        self.jax.block_until_ready(g)
        self._grads = g

    def run_opt(self):
        if self._grads is None:
            self.run_fwd_bwd()
        p, o = self.opt(self.params, self.plain_state[1], self._grads)
        self.jax.block_until_ready((p, o))

    def run_head(self):
        emb = self.params["embed"]["embedding"]
        self.jax.block_until_ready(self.head(self.hidden, emb, *self.data))

    def run_logprobs(self):
        self.logprobs(self.params, self.data[0]).block_until_ready()


def preset_side(name: str, config, params, batch: dict[str, Any], micro_batches: int,
                options: dict | None):
    """(TrainConfig, placed state, TrainBatch, jitted step) of the preset `name`'s learner
    options (e.g. smollm2-rg: packed groups, its clip range and temperature) on the same
    samples: make_batch's rows as a Trajectory of groups of GROUP (prompt T/4, then the
    response), through batch_from_trajectory like a run's batch."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from rl.learner import batch_from_trajectory, init_train_state, make_train_step
    from rl.run import PRESETS
    from rl.trajectory import Trajectory

    cfg = dataclasses.replace(PRESETS[name].train, micro_batches=micro_batches)
    tokens, mask = batch["tokens"], batch["mask"]
    b, t = tokens.shape
    p = t // 4
    rewards = {name: np.zeros(b, np.float32) for name in dict(cfg.reward_weights or {})}
    rewards[next(iter(rewards), "reward")] = batch["rewards"]
    traj = Trajectory.create(
        prompt_ids=tokens[:, :p], prompt_lengths=np.full(b, p), response_ids=tokens[:, p:],
        response_mask=mask[:, p:], behaviour_logprobs=np.zeros((b, t - p)),
        versions=np.zeros((b, t - p)), group_ids=np.repeat(np.arange(b // GROUP), GROUP),
        finished=np.ones(b, bool), truncated=np.zeros(b, bool), rewards=rewards)
    train_batch = batch_from_trajectory(traj, group_size=GROUP, model_config=config,
                                        packed=cfg.packed)
    step = make_train_step(cfg, config, compiler_options=options)
    state = step.place_state(init_train_state(jax.tree.map(jnp.copy, params), cfg))
    return cfg, state, train_batch, step


class TorchSide:
    """transformers + torch: the same model, loss and AdamW."""

    def __init__(self, hf, batch: dict[str, Any], micro_batches: int = 1):
        import torch

        self.micro_batches = micro_batches
        self.torch = torch
        self.model = hf.train()
        self.tokens = torch.from_numpy(batch["tokens"]).long()
        self.mask = torch.from_numpy(batch["mask"][:, 1:]).float()
        self.adv = torch.from_numpy(batch["adv"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, weight_decay=0.0,
                                     foreach=True)
        b, t = self.tokens.shape
        self.hidden = torch.randn(b, t, hf.config.hidden_size, requires_grad=True)

    def _loss(self, logits, rows=slice(None)):
        z = logits[:, :-1].float()
        logp = torch_logp(self.torch, z, self.tokens[rows, 1:])
        norm = self.mask.sum().clamp(min=1.0)  # the whole batch's tokens: exact accumulation
        return -(self.adv[rows, None] * logp * self.mask[rows]).sum() / norm

    def run_step(self):
        self.opt.zero_grad(set_to_none=True)
        b = self.tokens.shape[0] // self.micro_batches
        for i in range(self.micro_batches):  # gradient accumulation, like the JAX sides
            rows = slice(i * b, (i + 1) * b)
            self._loss(self.model(input_ids=self.tokens[rows]).logits, rows).backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def run_fwd(self):
        with self.torch.no_grad():
            self._loss(self.model(input_ids=self.tokens).logits)

    def run_fwd_bwd(self):
        self.opt.zero_grad(set_to_none=True)
        self._loss(self.model(input_ids=self.tokens).logits).backward()

    def run_opt(self):
        if any(p.grad is None for p in self.model.parameters()):
            self.run_fwd_bwd()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def run_head(self):
        w = self.model.get_output_embeddings().weight
        self.hidden.grad = None
        w.grad = None
        self._loss(self.torch.nn.functional.linear(self.hidden, w)).backward()


def torch_logp(torch, z, target):
    return torch.gather(z, -1, target[..., None])[..., 0] - torch.logsumexp(z, dim=-1)


# ----------------------------------------------------------------------------- main
