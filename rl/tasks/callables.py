"""Callables named by a spec string, so that a run config stays JSON: a reward function
(rl.tasks.rewards) or an environment factory (rl.envs.make_env) of your own.

    "my_module:name"          module my_module (importable: on sys.path, e.g. the working
                              directory), attribute name (dotted: "Class.method")
    "path/to/file.py:name"    a file, loaded by path (once per process)
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def is_callable_spec(spec: Any) -> bool:
    """True for a string of the form 'module:name' or 'file.py:name'."""
    if not isinstance(spec, str):
        return False
    module, colon, attr = spec.rpartition(":")
    return bool(colon and module and attr and "=" not in attr)


def import_module(module: str, spec: str, what: str, error: type[Exception] = ValueError):
    """The module a spec names: an importable module or a .py file (loaded by path)."""
    if module.endswith(".py"):
        path = Path(module).expanduser()
        if not path.is_file():
            raise error(f"{what} {spec!r}: file {module!r} not found")
        name = f"_tandem_user_{zlib.crc32(str(path.absolute()).encode())}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(mod)
        except Exception as err:
            raise error(f"{what} {spec!r}: loading {module!r} raised "
                        f"{type(err).__name__}: {err}") from err
        sys.modules[name] = mod
        return mod
    try:
        return importlib.import_module(module)
    except Exception as err:  # ImportError, or the module's own code failing
        raise error(f"{what} {spec!r}: cannot import module {module!r} "
                    f"({type(err).__name__}: {err}); is it on sys.path (run from its "
                    "directory) or give the file: 'path/to/file.py:name'") from err


def load_callable(spec: str, what: str, error: type[Exception] = ValueError) -> Callable[..., Any]:
    """The callable 'module:name' or 'file.py:name' names; `error` (with a message that
    starts with `what` and the spec) if it cannot be imported, is missing or not callable."""
    module, colon, attr = spec.rpartition(":")
    if not colon or not module or not attr:
        raise error(f"{what} {spec!r} is not 'module:name' or 'file.py:name'")
    fn: Any = import_module(module, spec, what, error)
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise error(f"{what} {spec!r}: {module!r} has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise error(f"{what} {spec!r} is not callable ({fn!r})")
    return fn
