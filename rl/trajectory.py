"""`Trajectory`: a batch of sampled responses, as the rollout engine hands it to the learner.

Row b is one sample (one response to one prompt); the samples of a group (the N responses
to one prompt) share a `group_ids` value. Arrays are right-padded: prompt tokens past
`prompt_lengths[b]` and response tokens where `response_mask` is False are padding (0).
Per response token the batch records the behaviour log-prob log μ (what the sampler drew
from) and the policy version whose parameters produced the token.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Trajectory:
    """prompt_ids [B, P_max] int32, prompt_lengths [B] int32, response_ids [B, R_max] int32,
    response_mask [B, R_max] bool (a prefix per row), behaviour_logprobs [B, R_max] float32,
    versions [B, R_max] int32, group_ids [B] int32, finished [B] bool (ended on a stop id),
    truncated [B] bool (ran out of its token budget), rewards: None or {name: [B] float32}.
    Multi-turn only (else None): env_mask [B, R_max] bool (True on observation tokens, inside
    response_mask), turn_ids [B, R_max] int32 (model turn of each response token, 0 on
    padding), turn_rewards [B, max_turns] float32 (reward of each model turn, 0 past the
    episode's last turn).

    Build with `Trajectory.create(...)` (converts and validates); under jit the fields are
    plain traced arrays and nothing is checked."""

    prompt_ids: jax.Array
    prompt_lengths: jax.Array
    response_ids: jax.Array
    response_mask: jax.Array
    behaviour_logprobs: jax.Array
    versions: jax.Array
    group_ids: jax.Array
    finished: jax.Array
    truncated: jax.Array
    rewards: dict[str, jax.Array] | None = None
    env_mask: jax.Array | None = None
    turn_ids: jax.Array | None = None
    turn_rewards: jax.Array | None = None

    @classmethod
    def create(
        cls,
        *,
        prompt_ids: Any,
        prompt_lengths: Any,
        response_ids: Any,
        response_mask: Any,
        behaviour_logprobs: Any,
        versions: Any,
        group_ids: Any,
        finished: Any,
        truncated: Any,
        rewards: Mapping[str, Any] | None = None,
        env_mask: Any = None,
        turn_ids: Any = None,
        turn_rewards: Any = None,
    ) -> "Trajectory":
        """Convert to the documented dtypes and validate (ValueError on any violation)."""
        traj = cls(
            prompt_ids=jnp.asarray(prompt_ids, jnp.int32),
            prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32),
            response_ids=jnp.asarray(response_ids, jnp.int32),
            response_mask=jnp.asarray(response_mask, bool),
            behaviour_logprobs=jnp.asarray(behaviour_logprobs, jnp.float32),
            versions=jnp.asarray(versions, jnp.int32),
            group_ids=jnp.asarray(group_ids, jnp.int32),
            finished=jnp.asarray(finished, bool),
            truncated=jnp.asarray(truncated, bool),
            rewards=None if rewards is None else {
                str(k): jnp.asarray(v, jnp.float32) for k, v in rewards.items()},
            env_mask=None if env_mask is None else jnp.asarray(env_mask, bool),
            turn_ids=None if turn_ids is None else jnp.asarray(turn_ids, jnp.int32),
            turn_rewards=None if turn_rewards is None else jnp.asarray(turn_rewards, jnp.float32),
        )
        traj.validate()
        return traj

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> jax.Array:
        """[B] int32: number of response tokens per row."""
        return self.response_mask.sum(axis=1).astype(jnp.int32)

    @property
    def multi_turn(self) -> bool:
        """True for episodes of an environment (env_mask given)."""
        return self.env_mask is not None

    @property
    def model_mask(self) -> jax.Array:
        """[B, R_max] bool: response tokens the model wrote (response_mask & ~env_mask) —
        the learner's targets."""
        if self.env_mask is None:
            return self.response_mask
        return self.response_mask & ~self.env_mask

    def num_tokens(self) -> int:
        """Total number of (unmasked) response tokens in the batch (observations included)."""
        return int(np.asarray(self.response_mask).sum())

    def num_model_tokens(self) -> int:
        """Number of response tokens the model sampled (observations excluded)."""
        return int(np.asarray(self.model_mask).sum())

    def with_rewards(self, rewards: Mapping[str, Any]) -> "Trajectory":
        """A copy with `rewards` ({name: [B]}) attached, validated."""
        traj = self.replace(rewards={str(k): jnp.asarray(v, jnp.float32) for k, v in rewards.items()})
        traj.validate()
        return traj

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError if shapes, dtypes or values are inconsistent (host-side check)."""
        b = self.prompt_ids.shape[0] if self.prompt_ids.ndim >= 1 else -1
        if self.prompt_ids.ndim != 2:
            raise ValueError(f"Trajectory.prompt_ids must be [B, P_max], got shape {self.prompt_ids.shape}")
        if self.response_ids.ndim != 2:
            raise ValueError(
                f"Trajectory.response_ids must be [B, R_max], got shape {self.response_ids.shape}")
        r = self.response_ids.shape[1]
        for name, shape in (("prompt_lengths", (b,)), ("response_ids", (b, r)),
                            ("response_mask", (b, r)), ("behaviour_logprobs", (b, r)),
                            ("versions", (b, r)), ("group_ids", (b,)), ("finished", (b,)),
                            ("truncated", (b,))):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"Trajectory.{name} must have shape {shape} (B={b}), got {got}")
        present = [n for n in ("env_mask", "turn_ids", "turn_rewards") if getattr(self, n) is not None]
        if present and len(present) != 3:
            raise ValueError(f"Trajectory multi-turn fields come together: got {present} without "
                             "the rest of env_mask, turn_ids, turn_rewards")
        if present:
            for name in ("env_mask", "turn_ids"):
                if tuple(getattr(self, name).shape) != (b, r):
                    raise ValueError(f"Trajectory.{name} must have shape {(b, r)}, got "
                                     f"{tuple(getattr(self, name).shape)}")
            if self.turn_rewards.ndim != 2 or self.turn_rewards.shape[0] != b:
                raise ValueError("Trajectory.turn_rewards must be [B, max_turns], got shape "
                                 f"{tuple(self.turn_rewards.shape)}")
        if self.rewards is not None:
            for k, v in self.rewards.items():
                if tuple(v.shape) != (b,):
                    raise ValueError(f"Trajectory.rewards[{k!r}] must have shape ({b},), got {tuple(v.shape)}")
                if not np.isfinite(np.asarray(v)).all():
                    raise ValueError(f"Trajectory.rewards[{k!r}] contains non-finite values")
        if isinstance(self.prompt_ids, jax.core.Tracer):
            return
        plen = np.asarray(self.prompt_lengths)
        if b and (plen.min() < 1 or plen.max() > self.prompt_ids.shape[1]):
            raise ValueError(
                f"Trajectory.prompt_lengths must be in [1, P_max={self.prompt_ids.shape[1]}], "
                f"got range [{plen.min()}, {plen.max()}]")
        mask = np.asarray(self.response_mask)
        lengths = mask.sum(axis=1)
        if not (mask == (np.arange(r)[None, :] < lengths[:, None])).all():
            raise ValueError("Trajectory.response_mask must be a prefix (True then False) in every row")
        lp = np.asarray(self.behaviour_logprobs)
        if not np.isfinite(lp[mask]).all() or (lp[mask] > 1e-5).any():
            raise ValueError("Trajectory.behaviour_logprobs must be finite and <= 0 where response_mask is True")
        if (np.asarray(self.versions)[mask] < 0).any():
            raise ValueError("Trajectory.versions must be >= 0 where response_mask is True")
        if present:
            env = np.asarray(self.env_mask)
            if (env & ~mask).any():
                raise ValueError("Trajectory.env_mask must be False outside response_mask")
            if not np.isfinite(np.asarray(self.turn_rewards)).all():
                raise ValueError("Trajectory.turn_rewards contains non-finite values")
            if (np.asarray(self.turn_ids)[mask] < 0).any():
                raise ValueError("Trajectory.turn_ids must be >= 0 where response_mask is True")
        both = np.asarray(self.finished) & np.asarray(self.truncated)
        if both.any():
            raise ValueError(
                f"Trajectory rows {np.nonzero(both)[0].tolist()[:8]} are both finished and "
                "truncated; a row ends either on a stop id or on its budget")


def concat_trajectories(trajs: Sequence[Trajectory]) -> Trajectory:
    """Stack batches row-wise, right-padding prompt/response widths to the largest one.
    All inputs must have rewards with the same names, or all None."""
    if not trajs:
        raise ValueError("concat_trajectories: need at least one Trajectory")
    names = [None if t.rewards is None else sorted(t.rewards) for t in trajs]
    if any(n != names[0] for n in names):
        raise ValueError(f"concat_trajectories: reward names differ between batches: {names}")
    p = max(t.prompt_ids.shape[1] for t in trajs)
    r = max(t.response_ids.shape[1] for t in trajs)

    def pad(x, width):
        x = np.asarray(x)
        return np.pad(x, ((0, 0), (0, width - x.shape[1])))

    def cat(name, width=None):
        return np.concatenate([pad(getattr(t, name), width) if width else np.asarray(getattr(t, name))
                               for t in trajs])

    rewards = None if names[0] is None else {
        k: np.concatenate([np.asarray(t.rewards[k]) for t in trajs]) for k in names[0]}
    kinds = {t.multi_turn for t in trajs}
    if len(kinds) > 1:
        raise ValueError("concat_trajectories: cannot mix multi-turn episodes with single-turn batches")
    multi = {}
    if kinds == {True}:
        turns = max(t.turn_rewards.shape[1] for t in trajs)
        multi = dict(env_mask=cat("env_mask", r), turn_ids=cat("turn_ids", r),
                     turn_rewards=cat("turn_rewards", turns))
    return Trajectory.create(**multi,
        prompt_ids=cat("prompt_ids", p), prompt_lengths=cat("prompt_lengths"),
        response_ids=cat("response_ids", r), response_mask=cat("response_mask", r),
        behaviour_logprobs=cat("behaviour_logprobs", r), versions=cat("versions", r),
        group_ids=cat("group_ids"), finished=cat("finished"), truncated=cat("truncated"),
        rewards=rewards)
