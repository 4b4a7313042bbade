"""Which config keys this process's runtime code actually reads.

"Every config key is honoured or refused" needs evidence of honouring: a key that is
validated, planned and rendered but that no rank ever looks at is silently ignored.
`to_typed` stamps every schema dataclass with its dotted path (`trainer.parallel`, dict
entries as `teachers.*`); the schema's `Traced` base records `path.field` when code reads a
field. Only reads by this package's runtime code count: not those of hpc_rl.config itself
(composition, conversion, validation and the refusal table read every key), of the dry
run's display, of tests, scripts or library machinery (dataclasses, copy, omegaconf). Helpers in
`hpc_rl.config.resources` (role sections, derived dp, teacher groups) read on behalf of
whoever called them, so their caller decides.

Each rank dumps its reads with `write_reads` (runtime/worker.py), the launch process with
`write_launch_reads`; tests/test_config_keys.py joins them against the schema.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, Optional, Set, Tuple, Union

PATH_ATTR = "_cfg_path"  # the instance attribute holding the dotted path

# Only this package's runtime code honours keys: reads from anywhere else (tests, scripts,
# dataclasses/copy/omegaconf machinery) are not evidence.
PACKAGE = "hpc_rl."
# Parts of the package whose reads do not honour a key: this package (compose, convert,
# validate, support, and schema, whose dataclass-generated __init__/__eq__/__repr__ run with
# the schema module's globals) and the dry run's display.
NOT_HONOURING = ("hpc_rl.config.", "hpc_rl.plan.report")
# Helpers that read for their caller (role sections, derived dp, teacher groups; the memory
# model's inputs): the first frame outside them decides.
ON_BEHALF = ("hpc_rl.config.resources", "hpc_rl.config.memory_inputs")

_reads: Dict[Tuple[str, str], Set[str]] = {}  # (path, field) -> modules that read it
_UNSEEN = object()
# module __name__ -> the reader's module name to record, "" (not honouring) or None (its caller decides)
_verdicts: Dict[str, Optional[str]] = {}


def _verdict(globs: dict) -> Optional[str]:
    module = globs.get("__name__", "")
    if module == "__main__":  # `python -m hpc_rl.launch`: the spec has the real name
        spec = globs.get("__spec__")
        module = spec.name if spec is not None else module
    if module.startswith(ON_BEHALF):
        return None
    honours = module.startswith(PACKAGE) and not module.startswith(NOT_HONOURING)
    return module if honours else ""


def _record(path: str, name: str, frame: Any) -> None:
    while frame is not None:
        globs = frame.f_globals
        reader = _verdicts.get(globs.get("__name__", ""), _UNSEEN)
        if reader is _UNSEEN:  # the first read from this module
            reader = _verdicts[globs.get("__name__", "")] = _verdict(globs)
        if reader is None:  # a helper reading for its caller
            frame = frame.f_back
            continue
        if reader:
            modules = _reads.get((path, name))
            if modules is None:
                modules = _reads[(path, name)] = set()
            modules.add(reader)
        return


class Traced:
    """Base of the schema dataclasses: records reads of fields, see the module docstring."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        # Fields live in the instance __dict__; methods, dunders (pickle, copy) and instances
        # `to_typed` did not stamp (configs built in code) take the plain path.
        d = object.__getattribute__(self, "__dict__")
        path = d.get(PATH_ATTR)
        if path is None or name not in d or name == PATH_ATTR:
            return object.__getattribute__(self, name)
        _record(path, name, sys._getframe(1))
        return d[name]


def stamp(obj: Any, path: str = "") -> Any:
    """Give `obj` and every dataclass below it its dotted path; dict entries become `*`."""
    fields = getattr(type(obj), "__dataclass_fields__", None)
    if fields is None:
        return obj
    object.__setattr__(obj, PATH_ATTR, path)
    for name in fields:
        value = obj.__dict__.get(name)
        sub = f"{path}.{name}" if path else name
        if isinstance(value, dict):
            for entry in value.values():
                stamp(entry, f"{sub}.*")
        else:
            stamp(value, sub)
    return obj


def _key(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def reads() -> Dict[str, Set[str]]:
    """This process's reads so far: key -> reading modules."""
    # list(): one C-level copy, safe while another thread (heartbeats) records
    return {_key(*k): set(v) for k, v in list(_reads.items())}


def reset() -> None:
    _reads.clear()


@contextlib.contextmanager
def capture() -> Iterator[Dict[str, Set[str]]]:
    """Collect the reads made inside the block into the yielded dict (key -> modules); the
    process's own record keeps them too."""
    before = {k: set(v) for k, v in _reads.items()}
    _reads.clear()
    got: Dict[str, Set[str]] = {}
    try:
        yield got
    finally:
        got.update(reads())
        for k, v in before.items():
            _reads.setdefault(k, set()).update(v)


def write_reads(path: Union[str, Path]) -> Path:
    """Dump this process's reads as JSON ({"reads": {key: [modules]}}). Never raises: a rank
    that fails must report its own error, not this one."""
    path = Path(path)
    try:
        data = {k: sorted(v) for k, v in sorted(reads().items())}
        path.parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: a rank cancelled while writing left an empty file (seen), which
        # the suite's check of every run's reads could not parse
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"reads": data}, indent=1) + "\n")
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001 (a full or read-only run directory, ...)
        print(f"hpc_rl: could not write {path}: {exc}", file=sys.stderr)
    return path


def reads_dir(run_dir: Union[str, Path]) -> Path:
    return Path(run_dir) / "config_reads"


def write_rank_reads(run_dir: Union[str, Path], role_file: str, role_rank: int, restart: int) -> Path:
    """For every rank when its program returns or raises; role_file is the role's name in
    file names (hpc_rl.plan.job_plan.role_file_name: teacher/math -> teacher-math)."""
    return write_reads(reads_dir(run_dir) / f"{role_file}.{role_rank}.{restart}.json")


def write_launch_reads(run_dir: Union[str, Path]) -> Path:
    """For launch.py's main, after the launcher returns: planning, rendering and launching
    read keys too (cluster.partition, launcher.kill_grace_s, ...)."""
    return write_reads(reads_dir(run_dir) / "launch.json")


def load_reads(files: Iterable[Union[str, Path]]) -> Dict[str, Set[str]]:
    """The union of dumped reads: key -> modules."""
    out: Dict[str, Set[str]] = {}
    for f in files:
        for key, modules in json.loads(Path(f).read_text())["reads"].items():
            out.setdefault(key, set()).update(modules)
    return out
