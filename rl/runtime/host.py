"""What machine a result was measured on: one line naming the CPU (or accelerator) and
jax, and the load averages (a shared CPU makes timings pessimistic). Every results JSON
and run summary records these."""
from __future__ import annotations

import os
import platform


def cpu_name(cpuinfo: str) -> str | None:
    """The first processor's name in /proc/cpuinfo text: its "model name" with its family
    and model numbers ("AMD EPYC 7B13 (family 25 model 1)"). A VM may report only "AMD
    EPYC" or "Intel(R) Xeon(R) CPU @ 2.20GHz", and two such machines can differ 2x in
    speed; the numbers tell them apart. None when the text names no processor."""
    first = cpuinfo.strip().split("\n\n", 1)[0]  # processors are blank-line separated
    fields = {key.strip(): value.strip() for key, _, value in
              (line.partition(":") for line in first.splitlines())}
    name = fields.get("model name")
    if not name:
        return None
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    return name


def machine() -> str:
    """E.g. 'AMD EPYC 7B13 (family 25 model 1), 2 cores; jax 0.10.2 on cpu' (the GPU's
    kind on a GPU)."""
    import jax  # here, not at the top: a script may set up its environment (XLA_FLAGS) first

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # Linux
        with open("/proc/cpuinfo") as f:
            cpu = cpu_name(f.read()) or cpu
    dev = jax.devices()[0]
    where = f"{cpu}, {os.cpu_count()} cores" if dev.platform == "cpu" else dev.device_kind
    return f"{where}; jax {jax.__version__} on {dev.platform}"


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]
