"""Tandem's RL side, in subpackages that follow the data flow of one training step:

    rl.tasks        prompts and verifiable rewards (leaf; multi-turn environments will be
                    the sibling leaf rl.envs)
    rl.rollout      the sampler and the rollout engine + strategies (APRIL): prompts -> Trajectory
    rl.trajectory   the Trajectory that rollout hands to the learner (leaf data type)
    rl.objectives   advantages, losses, off-policy corrections, VCPO's math (pure functions
                    of arrays)
    rl.learner      the train step, its configs / state / batch, proximal log-probs, snapshots
    rl.loops        the synchronous and asynchronous loops and the buffer between them
    rl.runtime      run plumbing: meshes, processes, checkpoints, metrics logging (leaf)

Import direction (checked by tests/test_layout.py): objectives <- learner, rollout <- loops;
tasks, trajectory and runtime are leaves that import nothing else from `rl`. Everything may
import `models` and `kernels`; nothing here imports `experiments`.
"""
