"""The documentation site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, and the
strict build fails on what it must catch: a link to a missing page, a missing anchor, a
missing results figure, an unresolved cross-reference (each a warning, which strict mode
turns into a failure), and an unknown API object (an error). The failure cases build a
small site with the same configuration (theme, plugins, validation, hook) and a broken
page, next to a control that builds.

Also: every module of models/, kernels/ and rl/ has its API reference entry, every
committed results figure is shown on a page, and every `python -m experiments...` command
of the README and the docs names a module that exists and is in the command index."""
import os
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"
RESULTS = ROOT / "experiments" / "results"
PACKAGES = ("models", "kernels", "rl")
COMMAND = re.compile(r"python3? -m (experiments(?:\.\w+)+)")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], check=False, cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # ~15 s on 2 cores: mkdocstrings renders every module
def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    proc = mkdocs_build(CONFIG, site)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    # the API reference is rendered from the docstrings
    api = (site / "api" / "rl-objectives" / "index.html").read_text()
    assert 'id="rl.objectives.losses.compute_loss"' in api
    # results figures are served from experiments/results/, and the pages point at them
    page = (site / "results" / "smollm2-rg" / "index.html").read_text()
    assert 'src="../files/smollm2_rg.png"' in page
    assert (site / "results" / "files" / "smollm2_rg.png").read_bytes() == \
        (RESULTS / "smollm2_rg.png").read_bytes()
    # no API page shows a paragraph twice (a name re-exported through a module's __all__
    # renders its docstring once more there)
    for page in sorted((site / "api").glob("*/index.html")):
        shown = repeated_paragraphs(page.read_text())
        assert not shown, f"{page.parent.name}: paragraphs shown twice: {shown}"


def repeated_paragraphs(html: str, shortest: int = 40) -> list[str]:
    """The article's <p> texts (tags stripped) of at least `shortest` characters that
    appear more than once."""
    article = html[html.find("<article"):html.find("</article>")]
    texts = [re.sub(r"<[^>]+>", "", p).strip() for p in re.findall(r"<p>(.*?)</p>", article, re.S)]
    seen: dict[str, int] = {}
    for t in texts:
        if len(t) >= shortest:
            seen[t] = seen.get(t, 0) + 1
    return [t[:80] for t, n in seen.items() if n > 1]


def test_the_repeated_paragraph_check_can_fail():
    twice = "<p>A paragraph long enough to count, shown on the page twice.</p>"
    assert repeated_paragraphs(f"<article>{twice}<p>other</p>{twice}</article>")
    assert not repeated_paragraphs(f"<article>{twice}<p>short</p><p>short</p></article>")


def small_site(tmp_path: Path, page: str) -> Path:
    """A site with the real configuration (nav left out) and two pages: index.md (links to
    a heading of page.md, a results figure, an API object) and page.md = `page`."""
    config = yaml.safe_load(CONFIG.read_text())
    config.pop("nav")
    config["docs_dir"] = str(tmp_path / "docs")
    config["hooks"] = [str(ROOT / h) for h in config["hooks"]]
    python = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    python["paths"] = [str(ROOT)]
    docs = tmp_path / "docs"
    docs.mkdir()
    figure = os.path.relpath(RESULTS / "train_default.png", docs)
    (docs / "index.md").write_text(
        f"# Home\n\nSee [the page](page.md#a-heading).\n\n![the default run]({figure})\n\n"
        "::: rl.trajectory\n")
    (docs / "page.md").write_text(f"# Page\n\n## A heading\n\n{page}\n")
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


BROKEN = {
    "a link to a missing page": ("See [there](no-such-page.md).", "no-such-page.md"),
    "a missing anchor": ("See [there](index.md#no-such-heading).", "no-such-heading"),
    "a missing results figure": ("![f](../experiments/results/no_such_figure.png)",
                                 "no_such_figure.png"),
    "an unresolved cross-reference": ("See [the loss][rl.objectives.no_such_loss].",
                                      "rl.objectives.no_such_loss"),
}


def test_the_strict_build_passes_a_sound_small_site(tmp_path):
    proc = mkdocs_build(small_site(tmp_path, "Sound: [home](index.md#home)."), tmp_path / "site")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"


def test_the_strict_build_fails_on_each_broken_reference(tmp_path):
    """One page with every fault of BROKEN: strict mode reports each as a warning (and a
    warning aborts the build), so one build shows that each fault alone fails it."""
    faults = {case: text for case, (text, _) in BROKEN.items()}
    faults["a missing results figure"] = faults["a missing results figure"].replace(
        "../experiments/results", os.path.relpath(RESULTS, tmp_path / "docs"))
    proc = mkdocs_build(small_site(tmp_path, "\n\n".join(faults.values())), tmp_path / "site")
    assert proc.returncode != 0, f"the strict build accepted a broken page:\n{proc.stderr}"
    warnings = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "WARNING" in ln]
    unreported = [case for case, (_, named) in BROKEN.items()
                  if not any(named in ln for ln in warnings)]
    assert not unreported, f"not reported as warnings: {unreported}\n" + "\n".join(warnings)


def test_the_strict_build_fails_on_an_unknown_api_object(tmp_path):
    # an error, not a warning: mkdocstrings stops the build at the first one
    proc = mkdocs_build(small_site(tmp_path, "::: rl.objectives.no_such_module"), tmp_path / "site")
    assert proc.returncode != 0, f"the build accepted an unknown API object:\n{proc.stderr}"
    assert "rl.objectives.no_such_module could not be found" in proc.stdout + proc.stderr


def modules(root: Path = ROOT) -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append(".".join(parts))
    return out


def test_every_module_has_an_api_reference_entry():
    directives = set()
    for page in (DOCS / "api").glob("*.md"):
        directives |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), re.MULTILINE))
    missing = [m for m in modules() if m not in directives]
    unknown = sorted(directives - set(modules()))
    assert not missing, ("modules without a `::: module` entry in docs/api/*.md (add one to "
                         f"the page of their package): {missing}")
    assert not unknown, f"docs/api names modules that do not exist: {unknown}"


def doc_sources() -> list[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def test_every_committed_results_figure_is_shown():
    text = "\n".join(p.read_text() for p in doc_sources())
    shown = set(re.findall(r"!\[[^\]]*\]\([^)]*experiments/results/([\w.-]+\.png)\)", text))
    missing = sorted(p.name for p in RESULTS.glob("*.png") if p.name not in shown)
    assert not missing, f"results figures no docs page shows: {missing}"


def module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_experiment_commands_exist_and_are_indexed():
    index = set(COMMAND.findall((DOCS / "commands.md").read_text()))
    used = {}
    for path in doc_sources():
        for name in COMMAND.findall(path.read_text()):
            used.setdefault(name, str(path.relative_to(ROOT)))
    missing = {n: where for n, where in used.items() if not module_exists(n)}
    unindexed = sorted(set(used) - index)
    assert not missing, f"commands name modules that do not exist: {missing}"
    assert not unindexed, f"commands missing from docs/commands.md: {unindexed}"
    assert len(used) >= 20, f"found only {len(used)} distinct experiment modules in the docs"


def test_the_command_check_can_fail():
    assert COMMAND.findall("run `python -m experiments.bench.sampler --parts x`") == \
        ["experiments.bench.sampler"]
    assert not module_exists("experiments.no_such_script")
    assert module_exists("experiments.train")


def test_docstrings_hold_no_sphinx_roles():
    """mkdocstrings renders a Sphinx role (:func:`x`) as raw text: the API pages would show
    it; a name in backticks renders as code."""
    role = re.compile(r":(?:func|class|meth|mod|attr|data|obj):`")
    found = [f"{path.relative_to(ROOT)}:{n}" for pkg in ("rl", "models", "kernels")
             for path in sorted((ROOT / pkg).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if role.search(line)]
    assert not found, f"Sphinx roles in docstrings (write `name` instead): {found}"


def test_docstring_lists_start_after_a_blank_line():
    """Markdown renders "text\n* item" as one paragraph: a docstring's list must follow a
    blank line to render as a list on the API pages."""
    item = re.compile(r"^\s*[*-] \S")
    found = []
    for pkg in ("rl", "models", "kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef,
                                         ast.AsyncFunctionDef)):
                    continue
                in_list, prev = False, ""
                for line in (ast.get_docstring(node, clean=True) or "").splitlines():
                    if item.match(line):
                        if prev.strip() and not in_list:
                            found.append(f"{path.relative_to(ROOT)}: {line.strip()[:40]}")
                        in_list = True
                    elif not line.strip():
                        in_list = False
                    prev = line
    assert not found, f"lists glued to the line before them: {found}"
