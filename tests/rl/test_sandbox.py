"""The sandboxed Python tool (rl/envs/sandbox.py) against hostile programs, in both
isolation modes, and the interpreter environment (rl/envs/python_tool.py) with SmolLM2's
real tokenizer. Each hostile program must come back as an observation within its limit,
nothing written outside its temp dir, this process alive. References: the files and
processes of this machine (checked from outside the sandbox), the chat template itself."""
import os
import tempfile
import time

import pytest

from rl.envs.sandbox import SandboxLimits, isolation, run_python

L = SandboxLimits(cpu_s=2, wall_s=4, memory_mb=1024, processes=16, output_bytes=4096)
MODES = ["bubblewrap", "rlimits"]
HOSTILE = {  # name -> (code, what the observation must say, per mode when they differ)
    "infinite loop": ("while True: pass", "killed: over 2 s of CPU time"),
    "sleep forever": ("import time; time.sleep(100)", "killed: over 4 s wall time"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()",  # the children's tracebacks
                  {"bubblewrap": ("Resource temporarily unavailable", "killed: over 4096"),
                   "rlimits": "os.fork is not allowed"}),
    "10 GB allocation": ("x = bytearray(10 * 1024 ** 3)", "killed: over 1024 MB of memory"),
    "100 MB of output": ("import sys; sys.stdout.write('a' * 100_000_000)",
                         "killed: over 4096 bytes of output"),
    "no newline ever": ("import sys\nwhile True: sys.stdout.write('x')",
                        "killed: over 4096 bytes of output"),
    "read /etc/shadow": ("print(open('/etc/shadow').read())",
                         {"bubblewrap": "No such file", "rlimits": "not allowed"}),
    "read the run dir": (f"print(open({os.path.abspath(__file__)!r}).read())",
                         {"bubblewrap": "No such file", "rlimits": "not allowed"}),
    "socket": ("import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
               {"bubblewrap": "Connection refused", "rlimits": "socket.__new__ is not allowed"}),
    "kill the parent": ("import os; os.kill(os.getppid(), 9)",
                        {"bubblewrap": "Operation not permitted", "rlimits": "os.kill is not allowed"}),
    "C-level crash": ("import ctypes; ctypes.string_at(0)",
                      {"bubblewrap": "killed: signal SIGSEGV", "rlimits": "ctypes is not allowed"}),
    "huge file": ("open('f', 'w').write('x' * (64 << 20))", "File too large"),
}


def _mode_or_skip(mode):
    if mode == "bubblewrap" and isolation() != "bubblewrap":
        pytest.skip("bubblewrap is not installed here (the project's setup and .ci/run "
                    "install it)")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(mode, name, tmp_path, monkeypatch):
    _mode_or_skip(mode)
    code, expect = HOSTILE[name]
    expect = expect[mode] if isinstance(expect, dict) else expect
    outside = tmp_path / "outside.txt"
    temps = tmp_path / "temps"
    temps.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temps))  # where the sandbox's dir goes
    t0 = time.monotonic()
    result = run_python(code, L, mode=mode)
    assert time.monotonic() - t0 < L.wall_s + 3
    expect = (expect,) if isinstance(expect, str) else expect
    assert any(e in result.observation() for e in expect), result
    assert not result.ok and result.isolation == mode
    assert not outside.exists()
    assert os.listdir(temps) == []  # the temp dir is removed
    assert run_python("print(6 * 7)", L, mode=mode).observation() == "42"  # still works


@pytest.mark.parametrize("mode", MODES)
def test_writes_stay_in_the_temp_dir(mode, tmp_path):
    _mode_or_skip(mode)
    target = tmp_path / "escape.txt"
    code = (f"open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())\n"
            f"open({str(target)!r}, 'w').write('x')")
    result = run_python(code, L, mode=mode)
    assert result.stdout.strip() == "ok" and not target.exists()
    assert result.exit_code == 1 and ("not allowed" in result.stderr
                                      or "No such file" in result.stderr)


def test_the_fallback_says_so_once():
    from rl.envs import sandbox
    sandbox._warn_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="bubblewrap is not available"):
        run_python("print(1)", L, mode="rlimits")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_python("print(1)", L, mode="rlimits")  # one line per process, not per call


# ----------------------------------------------------------------------------- the env
@pytest.fixture(scope="module")
def tok():
    from gguf import GGUFReader

    from models.assets import smollm2_gguf_path
    from models.gguf_loader import read_metadata
    from models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_metadata(GGUFReader(smollm2_gguf_path())))


def test_python_env_runs_code_and_checks_the_answer(tok):
    from rl.envs import make_env
    from rl.envs.python_tool import find_code

    env = make_env("python:dataset=basic_arithmetic", tokenizer=tok)
    train, evals = env.train_prompts(0, 4), env.eval_prompts(4)
    assert not {p.text for p in train} & {p.text for p in evals}
    assert [p.text for p in env.train_prompts(2, 2)] == [p.text for p in train[2:]]
    p = train[0]
    text = tok.decode(list(p.ids), skip_special_tokens=False)
    assert p.text in text and "```python" in text  # the worked example shows the tool
    ep = env.reset(p)
    expr = p.text.removeprefix("Calculate ").rstrip(".")
    r = ep.step(f"```python\nprint({expr})\n```<|im_end|>")
    assert not r.done and r.info == {"tool_calls": 1, "tool_errors": 0}
    assert f"Output:\n{p.answer}" in r.observation
    assert r.observation.endswith("<|im_start|>assistant\n")
    r = ep.step("```python\nwhile True: pass\n```<|im_end|>")
    assert "killed: over" in r.observation and r.info["tool_errors"] == 1
    r = ep.step(f"The answer is \\boxed{{{p.answer}}}.<|im_end|>")
    assert r.done and ep.outcome() == {"correct": 1.0}
    wrong = env.reset(p)
    wrong.step("\\boxed{123456789}<|im_end|>")
    assert wrong.outcome() == {"correct": 0.0}
    # every block, in the order the turn wrote them, both spellings
    assert find_code("x <python>print(1)</python> y ```python\nprint(2)\n```") == ["print(1)",
                                                                                 "print(2)"]
    assert find_code("```python\nprint(3)") == ["print(3)"]  # cut at the turn budget
    no_tool = make_env("python:dataset=basic_arithmetic,tool=false", tokenizer=tok)
    ep = no_tool.reset(p)
    r = ep.step("```python\nprint(1)\n```<|im_end|>")
    assert r.done  # without the tool every turn is the final answer
