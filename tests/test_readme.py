"""The ```python snippets of the README and of every docs page run, on CPU with the tiny
model. Each file runs top to bottom in its own namespace (like a doctest session: a later
snippet uses names an earlier one on the same page defined), so a reader can copy a page's
snippets in order and run them.

A snippet that needs a model file (the SmolLM2 GGUF, ...) carries the line
`<!-- snippet: needs a model file -->` right before its fence and is skipped here; ```bash
blocks are never run. Snippets run in a temporary working directory (and temporary files go
there too), so nothing is written into the repository. A failure names the file, the line
of the snippet and the line of the statement that raised.

Also: `.ci/run` runs exactly the README's test command (the second command of its first
```bash block)."""
import tempfile
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKER = "<!-- snippet: needs a model file -->"
MIN_SNIPPETS = 19  # README + docs hold at least this many runnable snippets: finding fewer fails
MIN_FILES = 11  # ... spread over at least this many files
MAX_SKIPPED = 3  # snippets that need a model file stay few


def snippet_sources() -> list[Path]:
    """README.md, then every docs page, in a fixed order."""
    return [README] + sorted(DOCS.rglob("*.md"))


def python_snippets(path: Path) -> tuple[list[tuple[int, str]], list[int]]:
    """([(fence line, code)] of the runnable ```python blocks of `path`, [fence lines of the
    skipped ones]), in file order; line numbers are 1-based."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = path.relative_to(ROOT)
    run, skipped = [], []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{name} line {i + 1}: ```python block is never closed"
            if i > 0 and lines[i - 1].strip() == MARKER:
                skipped.append(i + 1)
            else:
                run.append((i + 1, "\n".join(lines[i + 1:end])))
            i = end + 1
        else:
            if lines[i].strip() == MARKER:
                assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", (
                    f"{name} line {i + 1}: {MARKER} must sit right before a ```python fence")
            i += 1
    return run, skipped


FILES_WITH_SNIPPETS = [p for p in snippet_sources() if python_snippets(p)[0]]


def _source_line(err: BaseException, path: Path) -> int | None:
    """The line of `path` in the innermost frame of `err` that ran code from `path`."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == str(path)]
    return frames[-1].lineno if frames else None


def test_snippets_are_found_and_few_are_skipped():
    found = {p: python_snippets(p) for p in snippet_sources()}
    runnable = sum(len(run) for run, _ in found.values())
    skipped = {str(p.relative_to(ROOT)): s for p, (_, s) in found.items() if s}
    assert runnable >= MIN_SNIPPETS, f"found only {runnable} runnable ```python snippets"
    assert len(FILES_WITH_SNIPPETS) >= MIN_FILES, (
        f"runnable snippets in only {len(FILES_WITH_SNIPPETS)} files")
    assert found[README][0], "README.md has no runnable ```python snippet"
    assert sum(map(len, skipped.values())) <= MAX_SKIPPED, (
        f"snippets that need a model file: {skipped}; keep them few")


@pytest.mark.slow  # all files together ~1-2 min on 2 cores: samplers, a run_async, train steps
@pytest.mark.parametrize("path", FILES_WITH_SNIPPETS,
                         ids=[str(p.relative_to(ROOT)) for p in FILES_WITH_SNIPPETS])
def test_python_snippets_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace = {"__name__": "snippets"}
    name = path.relative_to(ROOT)
    for fence, code in python_snippets(path)[0]:
        # Pad so that line numbers in tracebacks are the file's own.
        compiled = compile("\n" * fence + code, str(path), "exec")
        try:
            exec(compiled, namespace)  # noqa: S102 - running the docs is the point
        except Exception as err:  # noqa: BLE001 - any failure, reported with its line
            pytest.fail(f"{name}: snippet at line {fence} failed at line "
                        f"{_source_line(err, path)}: {type(err).__name__}: {err}", pytrace=False)


def readme_commands() -> list[str]:
    """The command lines (comments dropped) of the README's first ```bash block."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index("```bash")
    end = lines.index("```", start + 1)
    return [ln.strip() for ln in lines[start + 1:end] if ln.strip() and not ln.startswith("#")]


def test_ci_runs_the_readme_test_command():
    commands = readme_commands()
    assert len(commands) == 2, f"the README's first bash block should hold the two commands: {commands}"
    install_and_run, test = commands
    assert install_and_run.endswith("python -m experiments.train"), install_and_run
    assert test.endswith("python -m pytest -q -n 2 --dist worksteal tests"), test
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.lstrip().startswith("#")]
    assert ci[-1] == test, f".ci/run runs {ci[-1]!r}, the README's test command is {test!r}"


def test_the_suite_time_sentences_read_the_committed_record():
    """The README's and the development page's suite figures come from
    experiments/results/test_suite_time.json."""
    import json

    root = Path(__file__).resolve().parents[1]
    rec = json.loads((root / "experiments/results/test_suite_time.json").read_text())
    minutes = f"{rec['headline']['value'] / 60:.1f} min"
    readme = " ".join((root / "README.md").read_text().split())
    assert f"({rec['tests']['total']:,} tests, {minutes} on 2 cores" in readme
    dev = " ".join((root / "docs/development.md").read_text().split())
    assert f"{rec['tests']['total']:,} tests took **{minutes}** wall " \
           f"({round(rec['headline']['value']):,} s)" in dev
    slow = sorted(rec["slowest_s"].values(), reverse=True)
    assert f"took {slow[0]:.0f} s and {slow[1]:.0f} s there" in dev
