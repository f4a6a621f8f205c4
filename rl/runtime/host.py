"""What machine a result was measured on: one line naming the CPU (or accelerator) and
jax, and the load averages (a shared CPU makes timings pessimistic). Every results JSON
and run summary records these."""
from __future__ import annotations

import os
import platform

import jax


def machine() -> str:
    """E.g. 'AMD EPYC 7B13, 2 cores; jax 0.10.2 on cpu' (the GPU's kind on a GPU)."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # Linux: the model name ("AMD EPYC 7B13")
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    dev = jax.devices()[0]
    where = f"{cpu}, {os.cpu_count()} cores" if dev.platform == "cpu" else dev.device_kind
    return f"{where}; jax {jax.__version__} on {dev.platform}"


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]
