"""The schema's keys as dotted paths, and the walk that finds keys nothing accounts for.

Dict sections whose values are dataclasses (teachers) are written `teachers.*.checkpoint`:
one key per field, whatever the recipe names its entries. Used by tests/test_config_keys.py
("every config key is honoured or refused") and by support.py's refusal rules.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterable, Iterator, List, Tuple


def _entry_type(tp: Any) -> Any:
    """The dataclass a Dict[str, <dataclass>] field holds, else None."""
    if typing.get_origin(tp) is dict:
        value = typing.get_args(tp)[1]
        if dataclasses.is_dataclass(value):
            return value
    return None


def leaf_keys(cls: type, prefix: str = "") -> List[str]:
    """Every leaf key of the schema `cls` in field order: scalars, lists and plain mappings
    (routing.agents) are leaves; nested dataclasses and dict-of-dataclass sections are not."""
    out: List[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += leaf_keys(tp, key + ".")
        elif _entry_type(tp) is not None:
            out += leaf_keys(_entry_type(tp), key + ".*.")
        else:
            out.append(key)
    return out


def fixed_keys(cls: type) -> List[str]:
    """Leaf keys whose type allows one value (Literal["vllm"]): conversion refuses any other,
    so no setting of them can be ignored. A second choice makes them ordinary keys again."""
    out = []
    for key in leaf_keys(cls):
        owner = cls
        for part in key.split(".")[:-1]:
            if part != "*":
                tp = typing.get_type_hints(owner)[part]
                owner = _entry_type(tp) or tp
        tp = typing.get_type_hints(owner)[key.split(".")[-1]]
        if typing.get_origin(tp) is typing.Literal and len(typing.get_args(tp)) == 1:
            out.append(key)
    return out


def default_of(cls: type, key: str) -> Any:
    """The schema's default for `key` (a `*` step means a fresh entry of that dict section)."""
    obj: Any = cls()
    for part in key.split("."):
        if part == "*":
            continue
        tp = typing.get_type_hints(type(obj))[part]
        entry = _entry_type(tp)
        obj = entry() if entry is not None else getattr(obj, part)
    return obj


def resolve(cfg: Any, pattern: str) -> Iterator[Tuple[str, Any, str]]:
    """(concrete key, owner object, field name) for each key `pattern` names; `*` expands a
    dict section's entries in order (teachers.*.parallel.tp -> teachers.add.parallel.tp, ...)."""
    def walk(obj: Any, parts: List[str], done: List[str]) -> Iterator[Tuple[str, Any, str]]:
        head, rest = parts[0], parts[1:]
        if head == "*":
            for name, entry in obj.items():
                yield from walk(entry, rest, done + [str(name)])
        elif not rest:
            yield ".".join(done + [head]), obj, head
        else:
            yield from walk(getattr(obj, head), rest, done + [head])

    yield from walk(cfg, pattern.split("."), [])


def set_key(cfg: Any, pattern: str, value: Any) -> List[str]:
    """Set every key `pattern` names to `value`; returns the concrete keys set."""
    done = []
    for key, owner, name in resolve(cfg, pattern):
        setattr(owner, name, value)
        done.append(key)
    return done


def unaccounted(cls: type, *accounted: Iterable[str]) -> List[str]:
    """The leaf keys of `cls` in none of the `accounted` sets (read, refused, facts)."""
    known = set().union(*accounted)
    return [k for k in leaf_keys(cls) if k not in known]
