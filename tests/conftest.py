"""Test-wide settings: CPU only, deterministic hypothesis profile sized for 2 cores."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
# The suite's time is mostly XLA:CPU compiling thousands of small programs, so tests
# compile with two flags that make compiling faster and change results by float rounding
# only:
#  * backend optimisation level 0 (tests/rl/test_multiturn.py: 71 s -> 40 s; the LoRA mesh
#    step's outputs move by at most 1 ulp);
#  * the older LLVM IR fusion emitters instead of the MLIR fusion emitters XLA:CPU uses by
#    default in jax 0.10, which compile fusions several times slower
#    (tests/rl/test_trainer_packed.py: 50 -> 24 CPU seconds; the suite: see
#    docs/development.md). Both are XLA's own code generators for the same HLO.
# Set before jax creates its CPU client; a flag already named in XLA_FLAGS is respected.
# XLA aborts the process on a flag it does not know, so a flag newer than the oldest jaxlib
# we accept is added only once a child process has started jax with it (~1 s, in the
# process that starts the suite; the xdist workers inherit the result). Subprocess tests
# append their device count to this XLA_FLAGS, so they compile the way the process that
# checks their results does.
FAST_COMPILE_FLAGS = {"xla_backend_optimization_level": "0",
                      "xla_cpu_use_fusion_emitters": "false"}
_CHECKED_FLAGS = ("xla_cpu_use_fusion_emitters",)


def _xla_accepts(flags: str) -> bool:
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                           env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
                           capture_output=True, timeout=120)
    return probe.returncode == 0


for _name, _value in FAST_COMPILE_FLAGS.items():
    if _name not in os.environ.get("XLA_FLAGS", ""):
        _flags = f"{os.environ.get('XLA_FLAGS', '')} --{_name}={_value}".strip()
        if _name not in _CHECKED_FLAGS or _xla_accepts(_flags):
            os.environ["XLA_FLAGS"] = _flags

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
