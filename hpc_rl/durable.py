"""Writes that survive a crash: a file or a directory appears whole under its name, or not at
all, and is on disk before its name says so. The run directory's records (rundir.py and the
modules that write there), checkpoints (ckpt/checkpoint.py) and exports (ckpt/export.py,
ckpt/export_lora.py) use these."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union


def fsync_dir(path: Union[str, Path]) -> None:
    """Make a rename or a new entry in directory `path` durable; not every filesystem allows
    it (some FUSE mounts refuse to open or fsync a directory), and then there is nothing to do."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Union[str, Path]) -> None:
    """Every file and directory under `path`, and `path` itself, on disk: for a directory about
    to be renamed into place, whose name then promises complete contents."""
    for p in sorted(Path(path).rglob("*")):
        if p.is_symlink():
            continue
        if p.is_dir():
            fsync_dir(p)
        elif p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def write_atomic(path: Path, text: str, durable: bool = True) -> None:
    """Write through a temporary file and rename, so readers never see half a file.

    durable: the bytes reach the disk before the rename, and the rename after it, so a node
    that crashes leaves the old file or the new one (ext4 and XFS may otherwise persist the
    rename before the data: an empty job.json or resume record). Only files that are stale
    the moment their writer dies (a rank's current phase) pass durable=False."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


@contextmanager
def publish_dir(out_dir: Union[str, Path], kind: str) -> Iterator[Path]:
    """A directory published at `out_dir` whole: the caller fills the yielded temporary sibling
    (`.tmp_<kind>_<name>_<random>`, made here with its missing parents); on leaving, it goes to
    disk (fsync_tree), an older `out_dir` is removed, and it is renamed into place (the rename
    made durable). On any error the temporary directory is removed and the error raised."""
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".tmp_{kind}_{out_dir.name}_{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsync_tree(tmp)  # on disk before its name says it is complete
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
