"""The rollout side: prompts in, a `rl.trajectory.Trajectory` of sampled responses out.

    sampler_state    SamplingConfig, the fixed-slot SamplerState, init_state, sample_keys
    sampler_core     the token draw and the pure jitted prefill / segment-decode bodies
    sampler          host API: prefill, decode_segment, read_slots, load_samples, generate
    sharded_sampler  the same sampler on a device mesh (explicit shardings)
    engine           RolloutEngine: continuous batching over the sampler, extract / resume
    april            rollout strategies: APRIL (over-provision + FIFO), static, continuous
    april_episodes   APRIL rounds of multi-turn episodes, carried in the engine
    pruning          online rollout pruning (ARRoL): quality head, balancing rule, Pruner
    multiturn        MultiTurnEngine: multi-turn episodes of an rl.envs Environment, continuous
                     batching across turns, observations appended to the KV cache
    multiturn_config MultiTurnConfig, TimeLimits, MultiTurnStepInfo (the engine's config)
    tool_calls       how tool calls run beside decoding: the pool, parked episodes, the
                     slot / tool statistics
    append           append_tokens: a prefill of just the new tokens at a slot's position
    episodes         guarded environment calls, EpisodeRecord, episodes -> Trajectory
    tree_sampler     one decode step with top-m candidates, token rewrites, forks in a block
    latr             LATR tree rollouts: branch at uncertain tokens, look ahead, prune
    trace            TRACE: turn-level anchors of episodes, replay through a prefix, the
                     allocator of a batch's second stage (most likely mixed outcomes)

May import: `models`, `kernels`, `rl.trajectory`, `rl.runtime`, `rl.envs` (the environment
protocol, and its Prompt) — not `rl.learner` nor `rl.loops` (the learner never runs here;
the loops drive both sides).

    from rl.rollout import SamplingConfig, generate, RolloutEngine, RolloutConfig
"""
from rl.rollout.sampler_state import (KV_LAYOUTS, SamplerState, SamplingConfig, as_key_data,  # noqa: I001
                                      init_state, sample_keys, slot_bucket,
                                      state_logical_axes)
from rl.rollout.sampler_core import (ReplicatedFill, SegmentedFill, decode_segment_impl, fill_impl,
                                     sample_tokens)
from rl.rollout.sampler import (GenerationResult, PartialSample, decode_segment, generate,
                                load_samples, prefill, read_slots)
from rl.rollout.pruning import Pruner, PruneConfig, QualityHead, balanced_prune
from rl.rollout.engine import PartialGroup, RolloutConfig, RolloutEngine, StepInfo
from rl.rollout.sharded_sampler import ShardedSampler
from rl.rollout.append import append_tokens
from rl.rollout.episodes import EpisodeBatch, EpisodeRecord
from rl.rollout.multiturn import MultiTurnConfig, MultiTurnEngine, MultiTurnStepInfo
from rl.rollout.april import (AprilConfig, AprilRollout, ContinuousRollout, StaticRollout,
                              offpolicy_prefix_mask)
from rl.rollout.april_episodes import EpisodeAprilRollout

__all__ = [
    "KV_LAYOUTS", "SamplerState", "SamplingConfig", "as_key_data", "init_state", "sample_keys",
    "slot_bucket", "state_logical_axes", "ReplicatedFill", "SegmentedFill", "decode_segment_impl", "fill_impl",
    "sample_tokens", "GenerationResult", "PartialSample", "decode_segment", "generate",
    "load_samples", "prefill", "read_slots", "PartialGroup", "RolloutConfig", "RolloutEngine",
    "StepInfo", "ShardedSampler", "AprilConfig", "AprilRollout", "ContinuousRollout",
    "StaticRollout", "offpolicy_prefix_mask", "Pruner", "PruneConfig", "QualityHead",
    "balanced_prune", "append_tokens", "EpisodeBatch", "EpisodeRecord",
    "MultiTurnConfig", "MultiTurnEngine", "MultiTurnStepInfo", "EpisodeAprilRollout",
]
