"""The package layout holds in the whole tree (kernels/, models/, rl/, experiments/): no
import circle, no import against the stated direction, no script in experiments/ importing
another script, no private name crossing a package boundary, no module over ~600 lines.

Imports are read with `ast` (nothing is imported), every import statement counts, those
inside functions too: a lazy import that closes a circle is still a circle.

Direction (docs/concepts/architecture.md): kernels <- models <- rl <- experiments, and inside rl
objectives <- learner / rollout <- loops, with tasks, trajectory and runtime as leaves.
experiments/ has three rooms: the entry points at the top, bench/ (benchmarks) and repro/
(reproductions) are scripts; common/ holds the helpers scripts share. Scripts import the
library and experiments.common only, never each other; nothing imports experiments.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "models", "rl", "experiments")
MAX_LINES = 620  # "no module over ~600 lines"
ROOMS = ("common", "bench", "repro")  # experiments/<room>/

# layer -> the layers it may import (itself always included)
ALLOWED = {
    "kernels": set(),
    "models": {"kernels"},
    "rl": set(),  # rl/__init__.py: a docstring only
    "rl.trajectory": set(),
    "rl.tasks": set(),
    "rl.envs": {"rl.tasks"},  # multi-turn environments and tools (a leaf: may read rl.tasks)
    "rl.schedulers": {"rl.tasks"},  # prompt schedulers (a leaf: may read rl.tasks)
    "rl.objectives": set(),
    "rl.runtime": {"models", "kernels"},
    "rl.rollout": {"rl.objectives", "rl.trajectory", "rl.runtime", "rl.envs", "models", "kernels"},
    "rl.learner": {"rl.objectives", "rl.trajectory", "rl.runtime", "models", "kernels"},
    "rl.loops": {"rl.objectives", "rl.trajectory", "rl.runtime", "rl.rollout", "rl.learner",
                 "rl.tasks", "rl.envs", "rl.schedulers", "models", "kernels"},
}
LIBRARY = set(ALLOWED) | {"rl.run"}  # rl.run: the run layer (lead), on top of rl.loops
ALLOWED["rl.run"] = LIBRARY - {"rl.run"}
ALLOWED["experiments.common"] = set(LIBRARY)  # the shared helpers: the library only
for _scripts in ("experiments", "experiments.bench", "experiments.repro"):
    ALLOWED[_scripts] = LIBRARY | {"experiments.common"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def collect_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            out[module_name(path, root)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Internal modules that `name` imports (module-level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            # `import a.b.c` of an internal module, or the closest internal parent
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    modules = collect_modules(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component with a cycle (Tarjan)."""
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in sccs:  # a closed path inside the component, for the message
        start = min(comp)
        path, seen = [start], {start}
        while True:
            nxt = min(w for w in graph[path[-1]] if w in comp)
            if nxt in seen:
                cycles.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def layer(module: str) -> str:
    """rl.<subpackage>, experiments.<room>, experiments (the entry points at the top), or
    the top-level package."""
    parts = module.split(".")
    if parts[0] == "rl" and len(parts) > 1:
        return ".".join(parts[:2])
    if parts[0] == "experiments" and len(parts) > 1 and (len(parts) > 2 or parts[1] in ROOMS):
        return ".".join(parts[:2])
    return parts[0]


def is_script(module: str, path: Path) -> bool:
    """A module of experiments/ outside experiments/common/ (package __init__s aside, but
    for a script that is a package of its own, experiments/<room>/<name>/__init__.py)."""
    if module.split(".")[0] != "experiments" or layer(module) == "experiments.common":
        return False
    parts = module.split(".")
    return path.name != "__init__.py" or (len(parts) == 3 and parts[1] in ROOMS)


def script_of(module: str) -> str:
    """The script a module belongs to: itself, or for the modules of a script package
    (experiments/<room>/<name>/...: its parts) that package."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 and parts[1] in ROOMS else module


def direction_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        here = layer(src)
        if here not in ALLOWED:
            bad.append(f"{src}: layer {here!r} has no stated place in the import direction")
            continue
        for t in sorted(targets):
            there = layer(t)
            if there != here and there not in ALLOWED[here]:
                bad.append(f"{src} imports {t} ({here} may import only "
                           f"{sorted(ALLOWED[here]) or 'nothing else'})")
    return bad


def script_imports(root: Path, packages=PACKAGES) -> list[str]:
    """'a imports b' for every script of experiments/ that imports another script."""
    modules = collect_modules(root, packages)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    return [f"{src} imports {t} (a script: move what they share into experiments.common)"
            for src in sorted(graph) if is_script(src, modules[src])
            for t in sorted(graph[src]) if is_script(t, modules[t])
            and script_of(t) != script_of(src)]  # a script package's own parts


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> str | None:
    """'a.b.c' for the expression a.b.c (names and attributes only), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Private names (`_x`, dunders aside) that module `name` takes from an internal module
    of another layer (package boundary: rl.<subpackage>, experiments.<room>, or a top-level
    package): `from m import _x` and `m._x` on an imported module m. 'line: what' each."""
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}  # local name -> internal module it is bound to
    found = []

    def crosses(target: str) -> bool:
        return layer(target) != layer(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    bound[a.asname] = a.name
                else:  # `import a.b.c` binds `a`; a.b.c is reached by attributes
                    bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules:
                    bound[a.asname or a.name] = full
                if base in modules and _is_private(a.name) and crosses(base):
                    found.append(f"{node.lineno}: from {base} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            dotted = _dotted(node.value)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            if head not in bound:
                continue
            target = ".".join(filter(None, [bound[head], rest]))
            if target in modules and crosses(target):
                found.append(f"{node.lineno}: {target}.{node.attr}")
    return sorted(set(found), key=lambda x: int(x.split(":")[0]))


def private_name_violations(root: Path, packages=PACKAGES) -> list[str]:
    modules = collect_modules(root, packages)
    return [f"{modules[name].relative_to(root)}:{hit}" for name in sorted(modules)
            for hit in private_imports_of(name, modules[name], modules)]


# ----------------------------------------------------------------------------- the checks
def test_no_import_circle():
    cycles = find_cycles(import_graph(ROOT))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_follow_the_direction():
    bad = direction_violations(import_graph(ROOT))
    assert not bad, "imports against the stated direction:\n" + "\n".join(bad)


def test_no_script_imports_another_script():
    bad = script_imports(ROOT)
    assert not bad, "scripts importing scripts:\n" + "\n".join(bad)


def test_no_private_name_crosses_a_package_boundary():
    bad = private_name_violations(ROOT)
    assert not bad, "private names used across a package boundary:\n" + "\n".join(bad)


def test_every_rl_subpackage_says_what_lives_there_and_what_it_may_import():
    for init in sorted((ROOT / "rl").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(ROOT)} has no docstring"
        assert "import" in doc.lower(), f"{init.relative_to(ROOT)}'s docstring does not say " \
            "what it may import"


def test_no_module_over_about_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in collect_modules(ROOT).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


ARCHITECTURE = ROOT / "docs" / "concepts" / "architecture.md"


def layout_section(text: str) -> str:
    """The "## Layout" section of the architecture page (up to the next "## " heading)."""
    assert "\n## Layout\n" in text, "the architecture page has no '## Layout' section"
    return text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def unnamed_rl_modules(section: str, root: Path = ROOT) -> list[str]:
    """Files of rl/ whose module stem (or, for an __init__, package name) the section does
    not name as a word."""
    missing = []
    for path in sorted((root / "rl").rglob("*.py")):
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        if not re.search(rf"(?<![\w.]){re.escape(stem)}(?!\w)", section):
            missing.append(str(path.relative_to(root)))
    return missing


def test_architecture_layout_names_every_rl_subpackage_and_module():
    missing = unnamed_rl_modules(layout_section(ARCHITECTURE.read_text()))
    assert not missing, f"the Layout section of {ARCHITECTURE.relative_to(ROOT)} does not " \
        f"name: {missing}"


def test_layout_check_can_fail(tmp_path):
    root = _tree(tmp_path, {"rl/__init__.py": "", "rl/loops/__init__.py": "",
                            "rl/loops/sync.py": "", "rl/loops/synchrony.py": ""})
    section = layout_section("# A\n\n## Layout\nrl/\n  loops/  synchrony\n## Next\nsync\n")
    assert unnamed_rl_modules(section, root) == ["rl/loops/sync.py"]  # a longer word does not count


# ----------------------------------------------------------------------------- the checker can fail
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_checker_finds_a_lazy_circle_and_a_relative_one(tmp_path):
    root = _tree(tmp_path, {
        "models/__init__.py": "",
        "models/a.py": "def f():\n    from models.b import g\n",   # lazy import
        "models/b.py": "import models.a\n",
        "kernels/__init__.py": "",
        "kernels/x/__init__.py": "from .y import z\n",
        "kernels/x/y.py": "from kernels.x import w\n",
        "rl/__init__.py": "",
    })
    cycles = find_cycles(import_graph(root))
    assert sorted(sorted(set(c)) for c in cycles) == [["kernels.x", "kernels.x.y"],
                                                      ["models.a", "models.b"]]


def test_checker_flags_imports_against_the_direction(tmp_path):
    root = _tree(tmp_path, {
        "kernels/__init__.py": "from models.config import C\n",
        "models/__init__.py": "", "models/config.py": "C = 1\n",
        "rl/__init__.py": "",
        "rl/objectives/__init__.py": "", "rl/objectives/loss.py": "from rl.learner import step\n",
        "rl/learner/__init__.py": "", "rl/learner/step.py": "from rl.objectives import loss\n",
        "rl/loops/__init__.py": "from rl.learner.step import x\n",
    })
    bad = direction_violations(import_graph(root))
    assert len(bad) == 2, bad
    assert bad[0].startswith("kernels imports models.config")
    assert bad[1].startswith("rl.objectives.loss imports rl.learner")


@pytest.mark.parametrize("src,ok", [("from rl.trajectory import T", True),
                                    ("from rl.rollout import generate", False)])
def test_checker_learner_may_read_trajectory_but_not_rollout(tmp_path, src, ok):
    root = _tree(tmp_path, {"rl/__init__.py": "", "rl/trajectory.py": "T = 1\n",
                            "rl/rollout/__init__.py": "generate = 1\n",
                            "rl/learner/__init__.py": src + "\n",
                            "models/__init__.py": "", "kernels/__init__.py": ""})
    assert (direction_violations(import_graph(root)) == []) == ok


def test_checker_finds_a_circle_through_experiments(tmp_path):
    root = _tree(tmp_path, {
        "experiments/__init__.py": "",
        "experiments/export.py": "from experiments import export_lora\n",
        "experiments/export_lora.py": "def f():\n    from experiments.export import E\n",
        "experiments/common/__init__.py": "", "experiments/common/plots.py": "import rl\n",
        "rl/__init__.py": "", "models/__init__.py": "", "kernels/__init__.py": "",
    })
    assert [sorted(set(c)) for c in find_cycles(import_graph(root))] == [
        ["experiments.export", "experiments.export_lora"]]


def test_checker_flags_the_library_or_a_helper_importing_experiments(tmp_path):
    root = _tree(tmp_path, {
        "experiments/__init__.py": "", "experiments/train.py": "from rl.loops import run\n",
        "experiments/common/__init__.py": "",
        "experiments/common/seeds.py": "from experiments.train import main\n",
        "experiments/common/plots.py": "from rl.runtime.logging import w\n",
        "experiments/repro/__init__.py": "",
        "experiments/repro/x.py": "from experiments.common.plots import p\nimport models\n",
        "experiments/bench/__init__.py": "",
        "experiments/bench/y.py": "from experiments.common import seeds\nimport kernels\n",
        "experiments/attic/z.py": "import rl\n",
        "rl/__init__.py": "", "rl/loops/__init__.py": "from experiments.common import plots\n",
        "rl/runtime/__init__.py": "", "rl/runtime/logging.py": "w = 1\n",
        "models/__init__.py": "", "kernels/__init__.py": "",
    })
    bad = direction_violations(import_graph(root))
    assert [b.split(" (")[0] for b in bad] == [
        "experiments.attic.z: layer 'experiments.attic' has no stated place in the import "
        "direction",
        "experiments.common.seeds imports experiments.train",
        "rl.loops imports experiments.common.plots"], bad


def test_checker_flags_a_script_importing_a_script(tmp_path):
    root = _tree(tmp_path, {
        "experiments/__init__.py": "", "experiments/train.py": "x = 1\n",
        "experiments/common/__init__.py": "", "experiments/common/seeds.py": "y = 1\n",
        "experiments/repro/__init__.py": "",
        "experiments/repro/a.py": "from experiments.common.seeds import y\n",  # fine
        "experiments/repro/b.py": "def f():\n    from experiments.repro import a\n",
        "experiments/bench/__init__.py": "",
        "experiments/bench/c.py": "import experiments.train\nimport experiments.bench\n",
        # a script that is a package: its own parts import each other freely
        "experiments/bench/pkg/__init__.py": "from experiments.bench.pkg.part import z\n",
        "experiments/bench/pkg/part.py": "from experiments.bench.pkg.other import w\nz = 1\n",
        "experiments/bench/pkg/other.py": "w = 1\n",
        "experiments/bench/d.py": "from experiments.bench.pkg.part import z\n",  # not fine
    })
    assert script_imports(root) == [
        "experiments.bench.c imports experiments.train (a script: move what they share into "
        "experiments.common)",
        "experiments.bench.d imports experiments.bench.pkg.part (a script: move what they "
        "share into experiments.common)",
        "experiments.repro.b imports experiments.repro.a (a script: move what they share into "
        "experiments.common)"]


def test_checker_flags_private_names_across_a_boundary_only(tmp_path):
    root = _tree(tmp_path, {
        "models/__init__.py": "", "kernels/__init__.py": "", "rl/__init__.py": "",
        "models/decoder.py": "def _jit(): pass\n__version__ = 1\n",
        "models/loader.py": "from models.decoder import _jit\n",  # same package: fine
        "rl/rollout/__init__.py": "", "rl/rollout/sampler.py": "def _width(): pass\n",
        "rl/rollout/append.py": "from .sampler import _width\n",  # same subpackage: fine
        "rl/rollout/core.py": ("import models.decoder\nfrom models import decoder as d\n"
                               "a = models.decoder._jit\nb = d._jit\nc = d.__version__\n"),
        "rl/loops/__init__.py": "", "rl/loops/sync.py": "from ..rollout.sampler import _width\n",
        "experiments/__init__.py": "",
        "experiments/common/__init__.py": "", "experiments/common/plots.py": "def _s(): pass\n",
        "experiments/repro/__init__.py": "",
        "experiments/repro/r.py": ("def f():\n    from experiments.common.plots import _s\n"
                                   "    import numpy as np\n    np._core\n"),
    })
    assert private_name_violations(root) == [
        "experiments/repro/r.py:2: from experiments.common.plots import _s",
        "rl/loops/sync.py:1: from rl.rollout.sampler import _width",
        "rl/rollout/core.py:3: models.decoder._jit",
        "rl/rollout/core.py:4: models.decoder._jit"]


def test_the_line_limit_covers_experiments():
    modules = collect_modules(ROOT)
    assert "experiments.common.benchmarking" in modules and "experiments.repro.smollm2_rg" in modules


def test_a_foreign_kernels_package_first_on_the_path_is_named(tmp_path):
    """Hugging Face's `kernels` (a dependency of transformers >= 5.25) has the import name of
    this repository's kernels/: when it comes first, `import models` says so in one line."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.19.1'\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(root)])}
    out = subprocess.run([sys.executable, "-c", "import models"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: the package 'kernels' resolves to ")
    assert str(fake / "__init__.py") in last and "pip uninstall kernels" in last
    env["PYTHONPATH"] = str(root)  # Tandem's own kernels: imports fine
    ok = subprocess.run([sys.executable, "-c", "import models"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
