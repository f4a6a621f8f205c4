"""Test-wide settings: CPU only, deterministic hypothesis profile sized for 2 cores."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
# The suite's time is mostly XLA:CPU compiling thousands of small programs; at backend
# optimisation level 0 (the level tests/rl/test_trainer.py and test_sharded_sampling.py
# already use) they compile far faster (tests/rl/test_multiturn.py: 71 s -> 40 s), and
# results differ from the default level's by float rounding only (the LoRA mesh step's
# outputs: at most 1 ulp).
# Set before jax creates its CPU client; an XLA_FLAGS that names a level is respected, and
# a subprocess test passes its own XLA_FLAGS or inherits this one.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_backend_optimization_level=0").strip()

# Many tests compile the same programs (the tiny presets' train step and sampler) in new
# closures, other xdist workers or subprocesses, where jax's in-memory caches miss. A
# persistent compilation cache shared by all of them turns those recompiles into reads
# (`python -m experiments.train --steps 3`: 26 s -> 13 s with the cache warm). Keys are
# the programs' HLO and compile options, so a hit is the executable a compile would give.
# The controller makes the directory before xdist starts its workers, which (and every
# subprocess test) inherit it; pytest_unconfigure of the same process removes it. A
# JAX_COMPILATION_CACHE_DIR already set is used as it is and kept.
_MADE_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR" not in os.environ  # True in that process only
if _MADE_CACHE_DIR:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tandem-tests-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Every compiled XLA:CPU executable keeps its own memory mappings, and one process running
# the whole suite compiles thousands of programs: the mapping count reached the kernel's
# vm.max_map_count (65530 here) and the next compilation segfaulted. Between test modules,
# once the count passes half the limit, drop jax's compilation caches (the next module
# recompiles what it needs) so the suite stays within it in one process.
import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


def _map_count() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no mapping limit to respect
        return 0


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_code():
    yield
    if _map_count() > _map_limit() // 2:
        jax.clear_caches()
        gc.collect()


def pytest_unconfigure(config):
    if _MADE_CACHE_DIR:
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
