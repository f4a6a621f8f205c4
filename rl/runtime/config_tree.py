"""Trees of frozen dataclasses as data: exact JSON round trip and dotted-path overrides.

A run's configuration is a tree of frozen dataclasses (rl.loops.config.RunConfig: the
train step's TrainConfig, the loop's LoopConfig, ...), each validating itself in
`__post_init__`. This module treats any such tree generically:

    to_dict(cfg)                     JSON-ready dict (tuples -> lists, frozen mappings ->
                                     objects)
    from_dict(RunConfig, d)          the tree back; from_dict(cls, to_dict(cfg)) == cfg
    override(cfg, "loop.group_size", 4)
                                     a new tree with one leaf replaced (every dataclass on
                                     the path rebuilt, so each validates again)
    parse_value("1e-5")              a command-line string as a Python value

Conventions the round trip relies on (all configs here follow them):

  * a field typed `X | None` where X is a dataclass is a section that may be off;
    overriding a field inside it while it is None first builds `X()`;
  * a field typed `Any` may hold a frozen mapping, a tuple of (str, value) pairs (e.g.
    LossConfig.params, TrainConfig.reward_weights, task options): it is written as a JSON
    object, read back as a dict (the dataclass freezes it again), and a dotted path that
    enters it names ONE key with the rest of the path ("task.options.chain_sum.max_digits"
    sets the key "chain_sum.max_digits");
  * JSON lists read into `tuple[...]` fields, and anywhere under an `Any` field, become
    tuples (configs are hashable, so they never hold lists).

Imports nothing from the project (a leaf).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any


class ConfigPathError(ValueError):
    """A dotted path names no field of the config tree; the message lists the fields."""


# ----------------------------------------------------------------------------- types
@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """{field name: resolved type} of a dataclass (string annotations evaluated)."""
    return typing.get_type_hints(cls)


def _section_class(tp: Any) -> type | None:
    """X for a field typed X or X | None where X is a dataclass; else None."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(classes) == 1 and dataclasses.is_dataclass(classes[0]):
            return classes[0]
    return None


def _is_pairs(value: Any) -> bool:
    return isinstance(value, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value)


def deep_tuple(value: Any) -> Any:
    """Lists (and tuples) as tuples, recursively, inside mappings too: configs are hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(deep_tuple(v) for v in value)
    if isinstance(value, Mapping):
        return {k: deep_tuple(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------- dict <-> tree
def to_dict(obj: Any) -> Any:
    """The JSON-ready form of a dataclass tree (see the module docstring)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        types_ = field_types(type(obj))
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if types_[f.name] is Any and _is_pairs(value):
                value = _pairs_to_dict(value)
            out[f.name] = to_dict(value)
        return out
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot write a {type(obj).__name__} ({obj!r}) into a config: only "
                    "dataclasses, mappings, sequences, str, numbers, bools and None")


def _pairs_to_dict(pairs: tuple) -> dict:
    """A frozen mapping back as a dict; nested frozen mappings (e.g. GDPO's reward
    weights inside params) too."""
    return {k: _pairs_to_dict(v) if _is_pairs(v) and v else v for k, v in pairs}


def from_dict(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    """An instance of dataclass `cls` from to_dict's form. Unknown keys raise
    ConfigPathError naming the known ones; each dataclass validates in its constructor."""
    if not isinstance(data, Mapping):
        raise ValueError(f"config {where or cls.__name__}: expected a JSON object for "
                         f"{cls.__name__}, got {type(data).__name__}")
    types_ = field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ConfigPathError(f"config {where or cls.__name__}: unknown field(s) {unknown}; "
                              f"{cls.__name__} has {sorted(types_)}")
    kw = {name: _read_value(types_[name], value, f"{where}.{name}".lstrip("."))
          for name, value in data.items()}
    return cls(**kw)


def _read_value(tp: Any, value: Any, where: str) -> Any:
    section = _section_class(tp)
    if section is not None and isinstance(value, Mapping):
        return from_dict(section, value, where)
    if tp is Any or typing.get_origin(tp) is tuple or tp is tuple:
        return deep_tuple(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def to_json(obj: Any) -> str:
    return json.dumps(to_dict(obj), indent=2, sort_keys=False) + "\n"


def from_json(cls: type, text: str) -> Any:
    return from_dict(cls, json.loads(text))


# ----------------------------------------------------------------------------- overrides
class _Updates(dict):
    """{field: new value | _Updates} for one dataclass: applied in one replace()."""


def override(obj: Any, path: str, value: Any, aliases: Mapping[str, str] | None = None) -> Any:
    """A copy of dataclass tree `obj` with the leaf at dotted `path` set to `value`
    (coerced to the field's type: int -> float, list -> tuple, a dict into a section).
    `aliases` renames first path components (e.g. {"async": "asynchronous"}).
    ConfigPathError for a path that names no field; the dataclasses' own ValueError for a
    value they refuse."""
    return override_many(obj, [(path, value)], aliases)


def override_many(obj: Any, assignments: Sequence[tuple[str, Any]],
                  aliases: Mapping[str, str] | None = None) -> Any:
    """override() for several (path, value) pairs at once: every dataclass on the paths is
    rebuilt once with all of its new fields, so fields that must change together (e.g. a
    rollout mode and an option that needs it) never meet a half-changed section. A later
    assignment of the same path wins."""
    updates = _Updates()
    for path, value in assignments:
        parts = path.split(".")
        if not path or any(not p for p in parts):
            raise ConfigPathError(f"config path {path!r} is not of the form section.field")
        if aliases and parts[0] in aliases:
            parts[0] = aliases[parts[0]]
        _plan(type(obj), parts, value, updates, "")
    return _apply(obj, updates, "")


def _plan(cls: type, parts: list[str], value: Any, updates: _Updates, where: str) -> None:
    """Record `value` at `parts` (below dataclass `cls`) in the nested `updates`."""
    types_ = field_types(cls)
    name, rest = parts[0], parts[1:]
    here = f"{where}.{name}".lstrip(".")
    if name not in types_:
        raise ConfigPathError(f"config path {here!r}: {cls.__name__} has no field {name!r}; "
                              f"its fields are {sorted(types_)}")
    tp = types_[name]
    if not rest:
        updates[name] = value
        return
    if tp is Any:  # a frozen mapping: the rest of the path is one key
        keys = updates.setdefault(name, _MapUpdates())
        if not isinstance(keys, _MapUpdates):
            raise ConfigPathError(f"config path {here!r} is set whole and by key; give one")
        keys[".".join(rest)] = deep_tuple(value)
        return
    section = _section_class(tp)
    if section is None:
        raise ConfigPathError(f"config path {here!r} is a value ({tp}), not a section: "
                              f"{'.'.join(rest)!r} cannot go under it")
    sub = updates.get(name)
    if not isinstance(sub, _Updates):
        if name in updates:
            raise ConfigPathError(f"config path {here!r} is set whole and field by field; "
                                  "give one")
        sub = updates[name] = _Updates()
    _plan(section, rest, value, sub, here)


class _MapUpdates(dict):
    """{key: value} set inside a frozen-mapping field."""


def _apply(obj: Any, updates: _Updates, where: str) -> Any:
    types_ = field_types(type(obj))
    new = {}
    for name, change in updates.items():
        here = f"{where}.{name}".lstrip(".")
        current = getattr(obj, name)
        if isinstance(change, _MapUpdates):
            mapping = dict(_pairs_to_dict(current) if _is_pairs(current) else current or {})
            mapping.update(change)
            new[name] = mapping
        elif isinstance(change, _Updates):
            base = current if current is not None else _section_class(types_[name])()
            new[name] = _apply(base, change, here)
        else:
            new[name] = _coerce(types_[name], change, here)
    return dataclasses.replace(obj, **new)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    section = _section_class(tp)
    if section is not None:
        if value is None or isinstance(value, section):
            return value
        if isinstance(value, Mapping):
            return from_dict(section, value, where)
        raise ValueError(f"config {where!r} is a {section.__name__} section: set its fields "
                         f"({where}.FIELD=VALUE), a JSON object, or None; got {value!r}")
    return _read_value(tp, value, where)


def parse_value(text: str) -> Any:
    """A command-line value: a Python literal when it parses as one (1e-5, 4, True, None,
    (1, 2), {"a": 1}), JSON's true / false / null, else the string itself."""
    words = {"true": True, "false": False, "null": None}  # "none" stays a string (a mode name)
    if text.strip() in words:
        return words[text.strip()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def parse_assignment(text: str) -> tuple[str, Any]:
    """"path=value" -> (path, parse_value(value)); ValueError without "="."""
    path, sep, raw = text.partition("=")
    if not sep or not path.strip():
        raise ValueError(f"expected PATH=VALUE (e.g. train.optimizer.learning_rate=1e-5), "
                         f"got {text!r}")
    return path.strip(), parse_value(raw.strip())
