"""Run plumbing, the same for every loop: import the module you need (nothing is imported
here, so a sampler-only user does not load orbax or wandb).

    rl.runtime.mesh         mesh presets (make_mesh_preset), validate_mesh, shardings of
                            params and batches, collective counting in compiled HLO
    rl.runtime.distributed  many processes: initialize_distributed, process_shard,
                            process_local, is_main_process, the CLI flags
    rl.runtime.checkpoint   Checkpointer (orbax; async, atomic, restores onto any mesh),
                            CheckpointError
    rl.runtime.host_memory  the host allocator's policy (LoopConfig.host_malloc: "lean"
                            returns freed blocks to the kernel: a lower CPU peak)
    rl.runtime.logging      MetricsLogger (jsonl + wandb offline), atomic file writes
    rl.runtime.preemption   SIGTERM / Ctrl-C stop a run at a safe point (stop_signals,
                            RunControl, Preempted), the exit statuses
    rl.runtime.storage      StorageError (a failed write in one line), free-space check

A leaf: imports `models` (configs, logical axis rules) and nothing else from `rl`.
"""
