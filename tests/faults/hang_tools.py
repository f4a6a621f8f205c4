"""Tool functions for tests/faults/test_time_limits.py, imported by rl.envs.tools.ToolWorker
in its worker process (not a test module)."""
import os
import time


def echo(text):
    return f"echo {text}"


def sleep_for(seconds):
    time.sleep(float(seconds))
    return "woke"


def fail(text):
    raise ValueError(f"cannot do {text!r}")


def die(text):
    os._exit(3)
