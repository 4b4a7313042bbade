"""Mapping -> typed dataclasses, collecting every unknown key and type error at once.

OmegaConf's structured configs stop at the first bad key; users fixing a 224-node recipe
want the whole list in one go, so the conversion walks the schema itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict, List, Tuple, Type, TypeVar, get_args, get_origin

from .errors import Violation
from .trace import stamp

T = TypeVar("T")
_SCALAR_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_MISSING = object()


def _describe(tp: Any) -> str:
    if tp is Any:
        return "any value"
    origin = get_origin(tp)
    if origin is typing.Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(_describe(a) for a in args) + " or null"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, List):
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin in (dict, Dict):
        return f"a mapping of {_describe(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return _SCALAR_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, value: Any, key: str, errors: List[Violation]) -> Any:
    """Convert `value` to type `tp`; on failure record a violation and return _MISSING."""
    if tp is Any:  # a passthrough value (generator.engine_args): the receiver checks it
        return value
    origin = get_origin(tp)
    if origin is typing.Union:
        if value is None and type(None) in get_args(tp):
            return None
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _convert(inner[0], value, key, errors)
    if origin is typing.Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        errors.append(Violation(key, value, f"must be {_describe(tp)}", f"{hint}set {key} to one of {list(choices)}"))
        return _MISSING
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(Violation(key, value, "must be a mapping", f"give {key} as a mapping of its fields"))
            return _MISSING
        return from_mapping(tp, value, errors, prefix=key)
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            errors.append(Violation(key, value, f"must be {_describe(tp)}", f"write {key} as a YAML list"))
            return _MISSING
        (item_tp,) = get_args(tp)
        out = [_convert(item_tp, v, f"{key}[{i}]", errors) for i, v in enumerate(value)]
        return _MISSING if any(v is _MISSING for v in out) else out
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            errors.append(Violation(key, value, f"must be {_describe(tp)}", f"write {key} as a YAML mapping"))
            return _MISSING
        _, val_tp = get_args(tp)
        out = {str(k): _convert(val_tp, v, f"{key}.{k}", errors) for k, v in value.items()}
        return _MISSING if any(v is _MISSING for v in out.values()) else out
    # scalars; bool is checked before int because bool is an int subclass in Python
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        # YAML and the override grammar read 23.11 or 2405 as numbers; a version is text
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif isinstance(value, tp):
        return value
    errors.append(Violation(key, value, f"must be {_describe(tp)}", f"set {key} to {_describe(tp)}"))
    return _MISSING


def from_mapping(cls: Type[T], data: Dict[str, Any], errors: List[Violation], prefix: str = "") -> T:
    """Build `cls` from `data`; unknown keys and bad values are appended to `errors`.

    Fields that failed keep their defaults so that later validation still runs on the rest.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: Dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"remove it; {prefix or 'the top level'} accepts {sorted(fields)}"
            errors.append(Violation(key, value, "unknown key", fix))
            continue
        converted = _convert(hints[name], value, key, errors)
        if converted is not _MISSING:
            kwargs[name] = converted
    return cls(**kwargs)


def to_typed(cls: Type[T], data: Dict[str, Any]) -> Tuple[T, List[Violation]]:
    errors: List[Violation] = []
    obj = from_mapping(cls, data, errors)
    # Paths let the schema record which keys runtime code reads (trace.py).
    return stamp(obj), errors


def to_yaml(cfg: Any) -> str:
    """A typed config as YAML (the run's config.yaml). Here, not in compose.py, so that what
    writes the run directory (rundir.py) needs nothing of composition and validation."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))
