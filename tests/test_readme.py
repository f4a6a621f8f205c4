"""The README's ```python snippets run, top to bottom, in one namespace (like a doctest
session: a later snippet uses names an earlier one defined), on CPU with the tiny model.

A snippet that needs a model file (the SmolLM2 GGUF, ...) carries the line
`<!-- snippet: needs a model file -->` right before its fence and is skipped here; ```bash
blocks are never run. Snippets run in a temporary working directory (and temporary
files go there too), so nothing is written into the repository. A failure names the
README line of the snippet and of the statement that raised."""
import tempfile
import traceback
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- snippet: needs a model file -->"
MIN_SNIPPETS = 13  # the README has this many runnable snippets: extracting fewer fails
MAX_SKIPPED = 3  # snippets that need a model file stay few


def readme_snippets() -> tuple[list[tuple[int, str]], list[int]]:
    """([(fence line, code)] of the runnable ```python blocks, [fence lines of the skipped
    ones]), in README order; line numbers are 1-based."""
    lines = README.read_text(encoding="utf-8").splitlines()
    run, skipped = [], []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"README.md line {i + 1}: ```python block is never closed"
            if i > 0 and lines[i - 1].strip() == MARKER:
                skipped.append(i + 1)
            else:
                run.append((i + 1, "\n".join(lines[i + 1:end])))
            i = end + 1
        else:
            if lines[i].strip() == MARKER:
                assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", (
                    f"README.md line {i + 1}: {MARKER} must sit right before a ```python fence")
            i += 1
    return run, skipped


def _readme_line(err: BaseException) -> int | None:
    """The README line of the innermost frame of `err` that ran README code."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == str(README)]
    return frames[-1].lineno if frames else None


@pytest.mark.slow  # ~45 s on 2 cores: a sampler, an async run and a train step compile
def test_readme_python_snippets_run(tmp_path, monkeypatch):
    run, skipped = readme_snippets()
    assert len(run) >= MIN_SNIPPETS, f"found only {len(run)} runnable ```python snippets in README.md"
    assert len(skipped) <= MAX_SKIPPED, (
        f"{len(skipped)} snippets need a model file (lines {skipped}); keep them few")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace = {"__name__": "readme"}
    for fence, code in run:
        # Pad so that line numbers in tracebacks are the README's own.
        compiled = compile("\n" * fence + code, str(README), "exec")
        try:
            exec(compiled, namespace)  # noqa: S102 - running the README is the point
        except Exception as err:  # noqa: BLE001 - any failure, reported with its README line
            pytest.fail(f"README.md snippet at line {fence} failed at README line "
                        f"{_readme_line(err)}: {type(err).__name__}: {err}", pytrace=False)
