"""Trainer checkpoints (atomic save, verified resume, retention) and Hugging Face export."""

from hpc_rl.ckpt.checkpoint import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    capture_rng_state,
    list_checkpoints,
    load_checkpoint,
    model_fingerprint,
    read_status,
    restore_rng_state,
    save_checkpoint,
    step_dirname,
    verify_checkpoint,
)
from hpc_rl.ckpt.export import export_hf
from hpc_rl.ckpt.retention import apply_retention
from hpc_rl.ckpt.resume import MixedRunsError, ResumeScan, find_resumable, fresh_start_conflict, fresh_start_fix

__all__ = [
    "CorruptCheckpointError", "IncompatibleCheckpointError", "MixedRunsError", "ResumeScan", "apply_retention",
    "capture_rng_state", "export_hf", "find_resumable", "fresh_start_conflict", "fresh_start_fix", "list_checkpoints",
    "load_checkpoint", "model_fingerprint", "read_status", "restore_rng_state", "save_checkpoint", "step_dirname", "verify_checkpoint",
]
