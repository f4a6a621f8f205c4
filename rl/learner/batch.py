"""The learner's pytrees: `TrainState` (params, optimizer state, counters, rng) and
`TrainBatch` (one batch of rows [prompt, response, padding]), and `batch_from_trajectory`,
the host-side bridge from the rollout side's `rl.trajectory.Trajectory` to a TrainBatch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import ModelConfig
from models.packed import PackedGroups, groups_share_prompts, pack_groups
from models.tree import TreeGroups, tree_groups
from rl.learner.config import TrainConfig, make_optimizer
from rl.objectives.turn_credit import TurnCreditConfig, token_turn_advantages
from rl.runtime.mesh import batch_sharding, mesh_axes
from rl.trajectory import Trajectory

Params = Any


# ----------------------------------------------------------------------------- pytrees
@struct.dataclass
class TrainState:
    """params; opt_state (optax state of make_optimizer(config.optimizer, config.vcpo)); step int32 []
    (optimizer updates so far); version int32 [] (policy version of `params`; +1 per
    update); rng uint32 [2] (raw key data, for the loop's sampling seeds)."""

    params: Params
    opt_state: Any
    step: jax.Array
    version: jax.Array
    rng: jax.Array


def init_train_state(params: Params, config: TrainConfig, rng: Any = 0) -> TrainState:
    """A fresh state at step 0 / version 0. rng: int seed or PRNG key."""
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        key = jax.random.PRNGKey(int(rng))
    else:
        key = jnp.asarray(rng)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise ValueError(f"rng must be an int seed or a PRNG key, got dtype {key.dtype} shape {key.shape}")
    opt_state = make_optimizer(config.optimizer, config.vcpo).init(params)
    return TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32),
                      version=jnp.zeros((), jnp.int32), rng=key)


@struct.dataclass
class TrainBatch:
    """One learner batch; every array field has the B rows first (they shard over
    ("data", "fsdp")). Row b = [prompt, response, padding] contiguous; per-token fields
    are aligned with `tokens` (index t describes token t, predicted by the logit at t-1).

    tokens [B, T] int32; positions [B, T] int32; loss_mask [B, T] bool (True at response
    tokens); behaviour_logprobs [B, T] float32 (log μ of each response token, 0 elsewhere);
    versions [B, T] int32 (policy version that sampled each token, 0 elsewhere);
    rewards [B, K] float32 (one column per name in `reward_names`); proximal_logprobs:
    None or [B, T] float32 aligned like behaviour_logprobs (log π_prox of each response
    token, computed outside the step; used by TrainConfig.old_logp="proximal", and, when
    given, as π_prox of the ratio-decomposition metrics whatever old_logp is);
    loss_weights: None or [B, T] float32 >= 0 aligned like loss_mask (a per-token factor on
    the policy loss, e.g. a buffer down-weighting stale tokens; multiplies any off-policy
    weights; the aggregation's normaliser still counts the mask). Static: group_size
    (contiguous groups of that many rows), reward_names. packed: None, or the same batch
    as PackedGroups with G = B / group_size groups first (G shards over ("data", "fsdp"))
    and rows[g, n] = g * group_size + n (what batch_from_trajectory builds). tree: None, or
    each group's rows as one prefix tree (models.tree.TreeGroups; TrainConfig.tree;
    models.tree.tree_groups_stats counts what it saves)."""

    tokens: jax.Array
    positions: jax.Array
    loss_mask: jax.Array
    behaviour_logprobs: jax.Array
    versions: jax.Array
    rewards: jax.Array
    group_size: int = struct.field(pytree_node=False)
    reward_names: tuple[str, ...] = struct.field(pytree_node=False)
    packed: PackedGroups | None = None
    proximal_logprobs: jax.Array | None = None
    loss_weights: jax.Array | None = None
    token_advantages: jax.Array | None = None
    tree: TreeGroups | None = None


class NonFiniteError(ValueError):
    """A reward, log-prob, loss or gradient is NaN or inf (raised by the batch builders on
    host data and by the checked step, rl.learner.checked, under jit)."""


def _reward_columns(rewards: Any, batch: int, group_size: int | None = None
                    ) -> tuple[tuple[str, ...], np.ndarray]:
    """{name: [B]} or [B] -> (names, [B, K] float32), with clear errors."""
    if rewards is None:
        raise ValueError("rewards are missing: attach them to the Trajectory (with_rewards) "
                         "or pass rewards={name: [B]}")
    if not isinstance(rewards, Mapping):
        rewards = {"reward": rewards}
    if not rewards:
        raise ValueError("rewards is an empty mapping; give at least one named reward")
    names = tuple(str(k) for k in rewards)
    cols = []
    for name in names:
        col = np.asarray(rewards[name], dtype=np.float64)
        if col.ndim != 1 or col.shape[0] != batch:
            raise ValueError(f"rewards[{name!r}] must be a list of {batch} numbers (one per "
                             f"response), got shape {col.shape}")
        bad = ~np.isfinite(col)
        if bad.any():
            rows = np.flatnonzero(bad)
            groups = "" if not group_size else (
                f" (groups {sorted(set((rows // group_size).tolist()))[:8]})")
            raise NonFiniteError(f"rewards[{name!r}] has non-finite values (NaN or inf) at rows "
                                 f"{rows.tolist()[:8]}{groups}; the reward function must "
                                 "return finite numbers")
        cols.append(col)
    return names, np.stack(cols, axis=1).astype(np.float32)


def batch_from_trajectory(
    traj: Trajectory,
    *,
    group_size: int,
    model_config: ModelConfig,
    rewards: Mapping[str, Any] | None = None,
    seq_len: int | None = None,
    packed: bool = False,
    turn_credit: TurnCreditConfig | None = None,
    tree: bool = False,
) -> TrainBatch:
    """Host-side: pack a Trajectory into a TrainBatch (numpy on host; jit moves it).

    Row b becomes tokens [prompt_ids[b, :P_b], response_ids[b, :R_b], 0...] of width
    seq_len (default P_max + R_max of the trajectory: a fixed width keeps one compiled
    step). rewards default to traj.rewards. Groups must be contiguous blocks of
    `group_size` rows with one group id each (what RolloutEngine.harvest returns).
    packed=True also attaches the packed shared-prefix layout (TrainBatch.packed, widths
    P_max and R_max of the trajectory: one compiled shape) when every group shares its
    prompt, some response is non-empty and P_max + R_max fits the model; otherwise
    TrainBatch.packed stays None and the step uses the naive rows. tree=True attaches
    each group's rows as one prefix tree instead (TrainBatch.tree, models.tree.tree_groups;
    single-turn batches whose groups share their prompt, like packed).
    Multi-turn episodes (traj.env_mask given): the loss mask holds the model's tokens only
    (observations are context, never targets); turn_credit (rl.objectives.turn_credit;
    None or name "outcome": nothing) fills TrainBatch.token_advantages with the turn-level
    term λ · Â of each model token from traj.turn_rewards (a single-turn trajectory with
    turn credit on is a ValueError).
    Raises ValueError for an empty batch, bad group layout, missing / NaN / inf /
    wrongly sized rewards, or a sequence longer than seq_len or the model's maximum.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    group_size = int(group_size)
    b = int(traj.response_ids.shape[0])
    if b == 0:
        raise ValueError("the batch is empty (0 responses): nothing to train on; sample at least "
                         "one group (e.g. dynamic sampling dropped every group)")
    if b % group_size:
        raise ValueError(f"batch of {b} responses is not a whole number of groups of size {group_size}")
    names, reward_cols = _reward_columns(traj.rewards if rewards is None else rewards, b,
                                         group_size)
    gids = np.asarray(traj.group_ids).reshape(-1, group_size)
    if not (gids == gids[:, :1]).all():
        raise ValueError(f"group_ids must be contiguous blocks of group_size={group_size} equal ids "
                         f"(one group per block), got {np.asarray(traj.group_ids).tolist()[:16]}")
    plen = np.asarray(traj.prompt_lengths)
    rmask = np.asarray(traj.response_mask)
    rlen = rmask.sum(axis=1)
    total = plen + rlen
    width = traj.prompt_ids.shape[1] + traj.response_ids.shape[1] if seq_len is None else int(seq_len)
    longest = int(total.max())
    if longest > width:
        raise ValueError(f"a sequence has {longest} tokens (prompt + response), longer than "
                         f"seq_len={width}; raise seq_len")
    if width > model_config.max_position_embeddings:
        raise ValueError(
            f"sequences of {width} tokens (prompt + response) exceed the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}; shorten "
            "max_prompt_len / max_new_tokens")
    targets = np.asarray(traj.model_mask)  # multi-turn: observation tokens are context only
    tokens, mask, behaviour, versions = row_layout(traj, targets, plen, rlen, width)
    if tokens.max() >= model_config.vocab_size:
        raise ValueError(f"token ids must be < vocab_size={model_config.vocab_size}, got {tokens.max()}")
    token_adv = None
    if turn_credit is not None and turn_credit.enabled:
        token_adv = turn_credit_rows(traj, turn_credit, targets, plen, rlen, width, group_size)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (b, width)).copy()
    groups = None
    p_w, r_w = traj.prompt_ids.shape[1], traj.response_ids.shape[1]
    gid = np.asarray(traj.group_ids)
    if packed and p_w + r_w <= model_config.max_position_embeddings \
            and groups_share_prompts(tokens, plen, rlen, gid):
        # contiguous groups (checked above) => rows[g, n] = g * group_size + n
        groups = pack_groups(tokens, plen, rlen, gid, prompt_width=p_w, response_width=r_w)
    trees = tree_layout(traj, tokens, plen, rlen, group_size, packed) if tree else None
    return TrainBatch(tokens=tokens, positions=positions, loss_mask=mask,
                      behaviour_logprobs=behaviour, versions=versions, rewards=reward_cols,
                      group_size=group_size, reward_names=names, packed=groups,
                      token_advantages=token_adv, tree=trees)


def row_layout(traj: Trajectory, targets: np.ndarray, plen: np.ndarray, rlen: np.ndarray,
               width: int) -> tuple[np.ndarray, ...]:
    """tokens, loss mask, behaviour log-probs, versions [B, width]: row b is
    [prompt_b, response_b, 0...] (batch_from_trajectory's layout); targets [B, R] marks the
    response tokens the loss counts."""
    b = plen.shape[0]
    prompt_ids, resp_ids = np.asarray(traj.prompt_ids), np.asarray(traj.response_ids)
    blp, ver = np.asarray(traj.behaviour_logprobs), np.asarray(traj.versions)
    tokens = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width), bool)
    behaviour = np.zeros((b, width), np.float32)
    versions = np.zeros((b, width), np.int32)
    for i in range(b):
        p, r = int(plen[i]), int(rlen[i])
        tokens[i, :p] = prompt_ids[i, :p]
        tokens[i, p:p + r] = resp_ids[i, :r]
        mask[i, p:p + r] = targets[i, :r]
        behaviour[i, p:p + r] = blp[i, :r]
        versions[i, p:p + r] = ver[i, :r]
    return tokens, mask, behaviour, versions


def turn_credit_rows(traj: Trajectory, turn_credit: TurnCreditConfig, targets: np.ndarray,
                     plen: np.ndarray, rlen: np.ndarray, width: int, group_size: int
                     ) -> np.ndarray:
    """[B, width] float32: the turn-level term λ · Â of each model token (turn_credit),
    0 outside the responses; ValueError for a single-turn trajectory."""
    if not traj.multi_turn:
        raise ValueError(f"turn_credit {turn_credit.name!r} needs multi-turn episodes "
                         "(Trajectory.turn_rewards); this batch is single-turn: use "
                         "TurnCreditConfig() (outcome only)")
    per = np.asarray(token_turn_advantages(turn_credit, traj.turn_rewards, traj.turn_ids,
                                           targets, group_size), np.float32)
    token_adv = np.zeros((plen.shape[0], width), np.float32)
    for i in range(plen.shape[0]):
        p, r = int(plen[i]), int(rlen[i])
        token_adv[i, p:p + r] = per[i, :r]
    return token_adv


def tree_layout(traj: Trajectory, tokens: np.ndarray, plen: np.ndarray, rlen: np.ndarray,
                group_size: int, packed: bool) -> TreeGroups:
    """batch_from_trajectory's tree=True: the rows tokens [B, T] as one prefix tree per
    group, after the checks that make it the same batch (one layout, single-turn groups
    sharing their prompt, some response token)."""
    if packed:
        raise ValueError("batch_from_trajectory: tree=True and packed=True are two layouts; "
                         "pick one")
    if traj.multi_turn or rlen.max() == 0 or not groups_share_prompts(
            tokens, plen, rlen, np.asarray(traj.group_ids)):
        raise ValueError("tree=True packs single-turn groups that share their prompt and have "
                         "some response token; this batch is not that: build it with "
                         "tree=False")
    return tree_groups(tokens, plen, rlen, group_size)


# ----------------------------------------------------------------------------- many processes
def _rows_per_process(mesh: jax.sharding.Mesh, global_rows: int) -> int:
    """Rows of a ("data", "fsdp")-sharded batch that one process holds."""
    sharding = batch_sharding(mesh)
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    starts = {idx[0].indices(global_rows)[:2] for idx in index_map.values()}
    return sum(stop - start for start, stop in starts)


def global_batch(local: TrainBatch, mesh: jax.sharding.Mesh) -> TrainBatch:
    """Assemble the global TrainBatch from each process's local rows (rows first in every
    field, laid out as rl.runtime.mesh.batch_sharding(mesh)): process i's rows become global
    rows [i*b, (i+1)*b) when the batch axis splits over processes, or the whole batch when
    each process holds it all (e.g. a tensor axis spanning processes). Every process must
    call it with the same shapes. ValueError for packed batches (their group indices are
    per process) and when the rows do not fit the mesh."""
    if not isinstance(local, TrainBatch):
        raise ValueError(f"global_batch takes a TrainBatch, got {type(local).__name__}")
    if local.packed is not None and jax.process_count() > 1:
        raise ValueError("packed (shared-prefix) batches hold per-process group indices and "
                         "cannot be assembled across processes; run without packing")
    b = int(np.shape(local.tokens)[0])
    rows = mesh_axes(mesh)["data"] * mesh_axes(mesh)["fsdp"]
    procs = len({d.process_index for d in mesh.devices.flat})
    # The process's rows out of the global batch: 1/procs of it, or all of it.
    per = _rows_per_process(mesh, rows)  # shards of one row per data*fsdp slot
    global_rows = b * rows // per
    if global_rows % rows:
        raise ValueError(f"the global batch of {global_rows} rows is not divisible by "
                         f"data*fsdp = {rows}; make the per-process batch a multiple of "
                         f"{max(1, rows // procs)}")
    sharding = batch_sharding(mesh)

    def put(x):
        if x is None:
            return None
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])

    return jax.tree.map(put, local)
