"""Decoder LMs (Llama / Qwen2 / Qwen3 / SmolLM2), KV cache and weight loaders.

Import the submodule you need (nothing heavy is imported here):
  models.config     ModelConfig, PRESETS, get_config, config_from_hf, config_to_hf
  models.decoder    init_params, param_logical_axes, forward, prefill, decode_step,
                    prefill_segments
  models.kv_cache   KVCache, init_cache (dense); SegmentedKVCache, init_segmented_cache
                    (a group's prompt once + per-sample response segments), cache_bytes
  models.rope       rope_inv_freq, apply_rope (rotary embeddings, rope scaling)
  models.attention  attention (the one dense attention entry point), chunk_attention
  models.chunked_prefill  chunked_prefill (prefill C tokens at a time, bounded memory),
                    prefill_chunks (its lax.scan twin), DEFAULT_CHUNK
  models.sharding   logical axis rules, make_mesh, logical_to_mesh_sharding, mesh_context
  models.convert    params_from_hf, hf_from_params (HF tensor names <-> our pytree)
  models.hf_loader  load_hf_checkpoint, save_hf_checkpoint
  models.ghost_norms  ghost_logprob_grads (each row's exact ‖∇_θ Σ log π‖² from one
                    batched backward; VCPO's baseline weighs them)
  models.tree      pack_tree (rollout-tree leaves -> each shared prefix once), tree_mask,
                    tree_forward, tree_token_logprobs, stack_trees
  models.weight_grads  project (the projections' einsum with a CPU-friendly backward),
                    contract_tokens (weight gradients xᵀ dy as canonical dots on CPU)
"""

def _check_own_kernels() -> None:
    """`models` imports this repository's `kernels` package by that name. Another
    distribution with the same import name (Hugging Face's `kernels`, which transformers
    >= 5.25 installs) can come first on sys.path outside the repository root; then say so
    here, before a confusing "No module named 'kernels.shared_prefix'"."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("kernels")
    ours = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    if spec is not None and spec.origin and Path(spec.origin).resolve() != ours:
        raise ImportError(
            f"the package 'kernels' resolves to {spec.origin}, not Tandem's {ours}: another "
            "distribution uses the same import name (Hugging Face's `kernels`, installed by "
            "transformers >= 5.25). Uninstall it (`pip uninstall kernels`; keep transformers "
            "< 5.25), or run from the repository root, where Tandem's comes first.")


_check_own_kernels()

