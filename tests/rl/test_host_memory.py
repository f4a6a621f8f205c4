"""rl.runtime.host_memory: the "lean" allocator policy hands freed memory back to the
kernel (measured by the process's own resident set, /proc/self/statm), and the config /
flag / resume plumbing of loop.host_malloc."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from experiments.common.flags import config_from_argv
from rl.loops.config import LoopConfig, RolloutOptions, RunConfig
from rl.loops.validation import ConfigError, check_resume_config, config_record
from rl.runtime import host_memory

# allocate 300 blocks of 1 MiB after one freed 1 MiB block (which lifts glibc's dynamic
# mmap threshold above 1 MiB), touch them, free all but the last (it pins the heap's top)
PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from rl.runtime.host_memory import apply_malloc_policy
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    changed = apply_malloc_policy(sys.argv[1])
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 1 << 20
    libc.free(libc.malloc(size))
    base = rss()
    blocks = [libc.malloc(size) for _ in range(300)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    held = rss() - base
    for b in blocks[:-1]:
        libc.free(b)
    print(json.dumps({"changed": changed, "held": held, "after_free": rss() - base}))
""")


def probe(policy):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, policy], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


def test_lean_policy_returns_freed_blocks_to_the_kernel():
    if host_memory.glibc_mallopt() is None:  # not glibc: "lean" must be refused, not ignored
        with pytest.raises(ValueError, match="mallopt"):
            host_memory.apply_malloc_policy("lean")
        return
    assert os.path.exists("/proc/self/statm"), "glibc without /proc: no way to read the RSS"
    default, lean = probe("default"), probe("lean")
    mib = 1 << 20
    assert default["changed"] is False and lean["changed"] is True
    for r in (default, lean):  # both really held the 300 MiB
        assert r["held"] > 280 * mib, r
    # glibc's default keeps the freed heap blocks resident; lean mapped each block and
    # unmapped it on free
    assert default["after_free"] > 250 * mib, default
    assert lean["after_free"] < 20 * mib, lean


def test_policy_names_and_platform_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="host_malloc must be one of"):
        LoopConfig(host_malloc="jemalloc")
    with pytest.raises(ValueError, match="must be one of"):
        host_memory.apply_malloc_policy("small")
    monkeypatch.setattr(host_memory, "glibc_mallopt", lambda: None)
    host_memory.check_malloc_policy("default")  # nothing to apply: fine anywhere
    with pytest.raises(ValueError, match="loop.host_malloc='default'"):
        host_memory.check_malloc_policy("lean")
    cfg = RunConfig().override("loop.host_malloc", "lean")
    with pytest.raises(ValueError, match="mallopt"):
        cfg.validate()  # refused before anything loads


def test_config_round_trip_and_low_memory_flag():
    cfg = RunConfig().override("loop.host_malloc", "lean")
    assert RunConfig.from_json(cfg.to_json()).loop.host_malloc == "lean"
    assert RunConfig().loop.host_malloc == "default"
    low, _ = config_from_argv(["--preset", "smollm2-rg", "--low-memory"])
    assert (low.train.remat, low.train.logprob_chunk, low.train.head_remat,
            low.loop.host_malloc, low.loop.eval_clear_programs) == ("full", 256, True, "lean", True)
    assert RunConfig().train.head_remat is None  # auto: kept up to 1 GiB
    assert low.loop.eval_max_rows == 8 * 8  # one train batch of rows
    # everything else is the preset's
    plain, _ = config_from_argv(["--preset", "smollm2-rg"])
    assert dataclasses.replace(low, train=plain.train, loop=plain.loop) == plain
    assert dataclasses.replace(low.loop, host_malloc="default", eval_max_rows=0,
                               eval_clear_programs=False) == plain.loop
    # the eval cap follows the batch the config ends with, --set included; an explicit
    # --set of the cap wins
    wide, _ = config_from_argv(["--preset", "smollm2-rg", "--low-memory", "--group-size", "4",
                                "--prompts-per-step", "3"])
    assert wide.loop.eval_max_rows == 12
    late, _ = config_from_argv(["--preset", "smollm2-rg", "--low-memory",
                                "--set", "loop.group_size=2"])
    assert late.loop.eval_max_rows == 16
    mine, _ = config_from_argv(["--preset", "smollm2-rg", "--low-memory",
                                "--set", "loop.eval_max_rows=5"])
    assert mine.loop.eval_max_rows == 5
    # explicit flags win over the view
    mixed, _ = config_from_argv(["--preset", "smollm2-rg", "--low-memory", "--remat", "dots",
                                 "--host-malloc", "default"])
    assert (mixed.train.remat, mixed.loop.host_malloc) == ("dots", "default")
    assert mixed.train.logprob_chunk == 256


def test_host_malloc_may_change_on_resume():
    cfg = RunConfig()
    saved = config_record(cfg.train, cfg.loop)
    lean = cfg.overrides({"loop.host_malloc": "lean", "loop.eval_max_rows": 16,
                          "loop.eval_clear_programs": True})
    check_resume_config(saved, config_record(lean.train, lean.loop))  # no error
    other = cfg.override("loop.group_size", 4)  # what is learned may not change
    with pytest.raises(ConfigError, match="group_size"):
        check_resume_config(saved, config_record(other.train, other.loop))


def test_an_eval_leaves_no_arrays_in_reference_cycles(tmp_path):
    """Tracing and compiling leave reference cycles that hold arrays until Python's cyclic
    collector runs (rl.runtime.host_memory.release_cycles); an eval, which compiles its own
    sampler programs, collects them before it returns. Checked with the collector off, by
    gc's own list of what was unreachable (DEBUG_SAVEALL), against the same eval's sampling
    without the collection (which does leave arrays behind: the test can fail)."""
    import gc

    import jax

    from models.config import get_config
    from models.decoder import init_params
    from rl.loops.evaluation import make_evaluator
    from rl.loops.rollouts import RolloutSpec, rollout_spec, sample_groups
    from rl.rollout.sampler_state import SamplingConfig
    from rl.runtime.logging import MetricsLogger
    from rl.tasks import make_task

    task = make_task("synthetic", seed=0, kind="reverse", length=3, alphabet=5)
    cfg = get_config("tiny", vocab_size=task.vocab_size)
    params = init_params(cfg, 0)

    def arrays_in_cycles(fn):
        gc.collect()
        gc.disable()
        try:
            fn()
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            return [o for o in gc.garbage if isinstance(o, jax.Array)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()

    # 11 prompts: shapes no other test compiles, so this call traces and compiles
    greedy = RolloutSpec(task, cfg, group_size=1, segment_len=3,
                         sampling=SamplingConfig(greedy=True))
    raw = arrays_in_cycles(lambda: sample_groups(params, 0, greedy, task.eval_prompts(11),
                                                 seed=0))
    assert raw, "a compiling sampler call left no arrays in cycles: nothing to check"
    run_cfg = RunConfig(loop=LoopConfig(eval_prompts=13), rollout=RolloutOptions(segment_len=3))
    loop = run_cfg.loop
    do_eval = make_evaluator(rollout_spec(cfg, task, run_cfg), loop,
                             MetricsLogger(tmp_path, wandb_mode="disabled"),
                             reward_weights={}, clock=lambda: 0.0)
    assert arrays_in_cycles(lambda: do_eval(1, params, 0)) == []
