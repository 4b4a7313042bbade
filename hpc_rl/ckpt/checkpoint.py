"""Atomic, resumable trainer checkpoints.

Layout of one checkpoint, `<root>/step_<step:08d>/`:

    dcp/                       model + optimizer, torch.distributed.checkpoint (each rank writes its shards)
    extra_state_rank<r>.pt     per-rank trainer state (data position, RNG, counters, rollout buffer), torch.save
    config.yaml                the resolved run config
    manifest.json              written last: step, time, recipe, model fingerprint, every file with its size
                               (and sha256 for the non-DCP files), whether the weights were finite

A save writes everything into `<root>/.tmp_step_<step>_<uuid>/` and renames it into place
only once every rank has finished, so a kill at any moment leaves either a complete
checkpoint or a `.tmp_*` directory that resume ignores and retention deletes. After the
rename, `<root>/latest_checkpoint_status.json` (replaced atomically) names the newest one.

Resume (`find_resumable`) walks checkpoints newest first, skips (and reports) the ones that
fail verification, and refuses, loudly, a checkpoint made for another recipe or model shape.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from hpc_rl.durable import fsync_dir
from hpc_rl.models.lora import checkpoint_meta, hf_name, is_adapter, meta_mismatch
from hpc_rl.models.nonfinite import all_ranks_finite, tensors_finite
from hpc_rl.runtime import sealed

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CONFIG = "config.yaml"
DCP_DIR = "dcp"
STATUS_FILE = "latest_checkpoint_status.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp_"
# Fingerprint differences listed in an error message; the rest is counted, not printed.
_MAX_LISTED = 8

Fingerprint = Dict[str, List[int]]


class IncompatibleCheckpointError(RuntimeError):
    """The newest complete checkpoint was written for another recipe or model shape."""

    no_retry = True  # a requeue would meet the same checkpoint: the batch shell does not retry


class CorruptCheckpointError(RuntimeError):
    """A checkpoint directory failed verification (missing file, size or hash mismatch, bad manifest)."""


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def _extra_name(rank: int) -> str:
    return f"extra_state_rank{rank:05d}.pt"


# RNG state


def capture_rng_state() -> Dict[str, Any]:
    """Python, numpy and torch (CPU and, when present, every CUDA device) generator states."""
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional for the trainer; nothing to capture then
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        # A restart may see fewer devices (e.g. a different CUDA_VISIBLE_DEVICES); restore what exists.
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


# small helpers


def model_fingerprint(model: torch.nn.Module) -> Fingerprint:
    """Parameter names and *global* shapes (FSDP2 DTensors report the unsharded shape), so a
    checkpoint made on 8 ranks matches the same model on 16. A LoRA student's are its base model's
    (HF names, adapters left out): the manifest's `lora` entry describes the adapters and its base,
    checked by load_checkpoint (models/lora.py)."""
    return {hf_name(name): list(p.shape) for name, p in model.named_parameters() if not is_adapter(name)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_text_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex}")
    _write_text_durable(tmp, json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized()


def _group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if _distributed(group) else 0


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if _distributed(group) else 1


def _recipe_from_config(config_yaml: str) -> Optional[str]:
    try:
        import yaml

        data = yaml.safe_load(config_yaml)
    except Exception:  # the config text is stored verbatim whatever it is; the recipe is only a label here
        return None
    return data.get("recipe") if isinstance(data, dict) else None


def _optimizers(backend, for_save: bool) -> list:
    opt = backend.optimizer
    # get_state_dict fills an empty optimizer state with a zero-grad, lr=0 step; harmless on a
    # load template (it is overwritten) but, on a save before the first step, it would leave Adam
    # at step 1 and change the live run. Such a checkpoint simply carries no optimizer state.
    if opt is None or (for_save and not opt.state):
        return []
    return [opt]


def _dcp_state(backend, optimizers: list) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if hasattr(backend, "dcp_state"):  # backends whose shards are not DTensors (megatron) key their own
        return backend.dcp_state(bool(optimizers))
    # get_state_dict keys both dicts by parameter FQN and keeps FSDP2 DTensors sharded, so each
    # rank writes only its shards and a later load may use another world size. A LoRA student's
    # checkpoint holds the adapters and their optimizer state alone: the base is its model.path.
    return get_state_dict(backend.model, optimizers, options=_dcp_options(backend))


def _dcp_options(backend):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = getattr(backend, "lora", None) is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _weights_finite(model_sd: Dict[str, Any], group: Optional[dist.ProcessGroup]) -> bool:
    """Whether every rank's part of the weights is finite (a collective of the group): one
    reduction per tensor, far cheaper than writing it."""
    tensors = [v for v in model_sd.values() if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    return all_ranks_finite(tensors_finite(tensors), group if _distributed(group) else None, device)


def _dcp_kwargs(group: Optional[dist.ProcessGroup]) -> Dict[str, Any]:
    # group=None means this backend is not sharded: never fall back to the default (world) group,
    # which in an hpc_rl job also holds generator/teacher ranks that are not saving.
    return {"process_group": group} if _distributed(group) else {"no_dist": True}


def _dcp_call(fn, state: Dict[str, Any], checkpoint_id: Path, group: Optional[dist.ProcessGroup]) -> None:
    import warnings

    with warnings.catch_warnings():
        # Single-process saves are intended here; DCP warns about them on every call.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        fn(state, checkpoint_id=str(checkpoint_id), **_dcp_kwargs(group))


def save_checkpoint(root, step: int, backend, extra_state: Dict[str, Any], config_yaml: str,
                    group: Optional[dist.ProcessGroup] = None, recipe: Optional[str] = None,
                    before_publish: Optional[Callable[[], None]] = None) -> Path:
    """Write `<root>/step_<step:08d>` atomically; every rank of `group` must call it.

    `extra_state` is this rank's own (RNG states differ per rank); `recipe` defaults to the
    `recipe:` key of `config_yaml`. Returns the final checkpoint path on every rank.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    rank, world = _group_rank(group), _group_size(group)
    final = root / step_dirname(step)
    # Every rank must write into the same temporary directory: rank 0 draws its name.
    token = [uuid.uuid4().hex if rank == 0 else None]
    if _distributed(group):
        token[0], _ = sealed.broadcast(token[0], dist.get_global_rank(group, 0), group)  # MAC checked before loads
    tmp = root / f"{_TMP_PREFIX}step_{step}_{token[0]}"
    if rank == 0:
        tmp.mkdir(parents=True)
    if _distributed(group):
        dist.barrier(group=group)

    optimizers = _optimizers(backend, for_save=True)
    model_sd, optim_sd = _dcp_state(backend, optimizers)
    finite = _weights_finite(model_sd, group)
    state = {"model": model_sd, "optim": optim_sd} if optimizers else {"model": model_sd}
    _dcp_call(dcp.save, state, tmp / DCP_DIR, group)

    extra_path = tmp / _extra_name(rank)
    with open(extra_path, "wb") as f:
        torch.save(extra_state, f)
        f.flush()
        os.fsync(f.fileno())

    if rank == 0:
        _write_text_durable(tmp / CONFIG, config_yaml)
    if _distributed(group):
        # Every rank's shards and extra state are on disk before rank 0 hashes and publishes.
        dist.barrier(group=group)
    if before_publish is not None:  # chaos tests: die here, with everything but the manifest written
        before_publish()

    if rank == 0:
        files = {}
        for p in sorted(q for q in tmp.rglob("*") if q.is_file()):
            rel = p.relative_to(tmp).as_posix()
            entry: Dict[str, Any] = {"size": p.stat().st_size}
            # DCP shards are the bulk of a checkpoint; their sizes catch truncation without
            # re-reading terabytes. The small files get a full hash.
            if not rel.startswith(DCP_DIR + "/"):
                entry["sha256"] = _sha256(p)
            files[rel] = entry
        now = time.time()
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "time": now,
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
            "recipe": recipe if recipe is not None else _recipe_from_config(config_yaml),
            "world_size": world,
            "backend_step_count": int(getattr(backend, "step_count", 0)),
            "has_optimizer_state": bool(optimizers),
            "fingerprint": model_fingerprint(backend.model),
            "lora": checkpoint_meta(backend),  # None: full weights; else the adapters' shape and their base
            "files": files,
            # retention keeps the newest finite checkpoint, resume passes non-finite ones over
            "weights_finite": finite,
        }
        guard = getattr(backend, "nonfinite", None)  # skipped non-finite steps (models/nonfinite.py)
        if guard is not None:
            manifest["nonfinite_steps"] = guard.state_dict()
        if not finite:
            log.warning("checkpoint step %d: the weights are not finite (NaN or inf); saved and marked so", step)
        # DCP fsyncs its shards, not the directories that name them: without this a crash can
        # leave a manifest promising a shard whose directory entry never reached the disk.
        for d in sorted(q for q in tmp.rglob("*") if q.is_dir()):
            fsync_dir(d)
        # The manifest goes last: its presence is what makes the directory a checkpoint.
        _write_text_durable(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        fsync_dir(tmp)
        old = None
        if final.exists():
            # Re-saving a step (resumed from an earlier checkpoint, or this one was corrupt):
            # move the old one aside first, since rename() cannot replace a non-empty directory.
            old = root / f"{_TMP_PREFIX}old_{final.name}_{token[0]}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _write_json_atomic(root / STATUS_FILE, {"step": step, "path": str(final.resolve()), "time": now,
                                               "time_iso": manifest["time_iso"]})
        log.info("checkpoint step %d saved to %s", step, final)
    if _distributed(group):
        # No rank goes on (and maybe applies retention or exits) before the checkpoint is published.
        dist.barrier(group=group)
    return final


# discovery, verification, retention


def list_checkpoints(root) -> List[Tuple[int, Path]]:
    """(step, path) of every `step_*` directory under root, oldest first; `.tmp_*` never appears."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_manifest(path) -> Dict[str, Any]:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: no {MANIFEST} (incomplete save)") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable {MANIFEST}: {e}") from None
    missing = [k for k in ("step", "files", "fingerprint") if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise CorruptCheckpointError(f"{path}: {MANIFEST} lacks {missing}")
    return manifest


def verify_checkpoint(path) -> Dict[str, Any]:
    """Raise CorruptCheckpointError naming the first problem; return the manifest when complete."""
    path = Path(path)
    manifest = read_manifest(path)
    for rel, entry in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CorruptCheckpointError(f"{path}: missing file {rel}")
        size = f.stat().st_size
        if size != entry.get("size"):
            raise CorruptCheckpointError(f"{path}: {rel} is {size} bytes, manifest says {entry.get('size')}")
        if "sha256" in entry and _sha256(f) != entry["sha256"]:
            raise CorruptCheckpointError(f"{path}: sha256 mismatch for {rel}")
    return manifest


def load_checkpoint(path, backend, group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """Restore model, optimizer and `backend.step_count` from `path` (every rank of `group` calls
    it; the world size may differ from the save's, DCP reshards) and return this rank's
    extra_state. Verify the checkpoint first (find_resumable does)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    manifest = read_manifest(path)
    why = meta_mismatch(manifest.get("lora"), checkpoint_meta(backend))
    if why:
        raise IncompatibleCheckpointError(f"checkpoint {path} does not match this run's LoRA: {why}; resume with "
                                          "the trainer.lora settings and model.path it was written with, or use another "
                                          "run.dir / checkpoint.dir")
    # Inference-only backends (and checkpoints saved before the first step) restore weights alone.
    optimizers = _optimizers(backend, for_save=False) if manifest.get("has_optimizer_state", True) else []
    model_sd, optim_sd = _dcp_state(backend, optimizers)  # the templates DCP loads into, sharded like this backend
    state = {"model": model_sd, "optim": optim_sd} if optimizers else {"model": model_sd}
    _dcp_call(dcp.load, state, path / DCP_DIR, group)
    if hasattr(backend, "load_dcp_state"):
        backend.load_dcp_state(state["model"], state.get("optim", {}))
    else:
        set_state_dict(backend.model, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optim", {}),
                       options=_dcp_options(backend))
    backend.step_count = int(manifest.get("backend_step_count", manifest["step"]))
    if getattr(backend, "nonfinite", None) is not None and "nonfinite_steps" in manifest:
        backend.nonfinite.load_state_dict(manifest["nonfinite_steps"])  # a skip streak goes on across a requeue

    rank = _group_rank(group)
    extra = path / _extra_name(rank)
    if not extra.exists():
        # Resumed on more ranks than saved: rank 0's counters are shared, but its RNG stream is
        # not this rank's, so say so rather than pretend the run continues bit for bit.
        log.warning("%s has no extra state for rank %d (saved on %s ranks); using rank 0's",
                    path, rank, manifest.get("world_size"))
        extra = path / _extra_name(0)
    with open(extra, "rb") as f:
        # weights_only=False: extra_state holds RNG tuples, numpy states and rollout buffers that
        # this same trainer wrote; checkpoints are trusted run artifacts, not downloads.
        return torch.load(f, weights_only=False)


def read_status(root) -> Optional[Dict[str, Any]]:
    """`latest_checkpoint_status.json` under root, or None before the first save."""
    p = Path(root) / STATUS_FILE
    return json.loads(p.read_text()) if p.exists() else None
