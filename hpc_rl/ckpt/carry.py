"""Tensors of the input checkpoint that the trained model does not hold, for its HF export.

A model class may declare checkpoint tensors it drops on load: transformers' Nemotron-H
class drops the multi-token-prediction layers (`mtp.*`, see
hpc_rl/models/families/nemotron_h/mtp.py), so the trainer never sees them and an export of its weights alone would
lose them. The export copies those tensors from the checkpoint the backend loaded, byte for
byte (read and written by safetensors, never cast), with the config keys that describe them.

Which tensors: those whose names match the class's `_keys_to_ignore_on_load_unexpected`, the
list transformers itself uses to drop them without a warning. Not "every name the model lacks":
a checkpoint's names differ from the model's (`backbone.` vs `model.`, experts per tensor vs
fused), and copying by a plain name difference would write stale input copies of trained
weights beside them. A name the trained model holds is never taken from the input.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

import torch


def _describes_carried(key: str) -> bool:
    """config.json keys about MTP layers: NVIDIA's `num_nextn_predict_layers`,
    `mtp_hybrid_override_pattern`, transformers 5's `mtp_layers_block_type`, and the like."""
    return key == "num_nextn_predict_layers" or key.startswith("mtp_")


@dataclass
class Carried:
    source: Optional[Path]
    reason: str = ""
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    config: Dict[str, Any] = field(default_factory=dict)  # source config.json keys describing them

    def manifest(self) -> Dict[str, Any]:
        return {"source": str(self.source) if self.source else None, "reason": self.reason,
                "tensors": {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                "sha256": sha256(t)} for n, t in sorted(self.tensors.items())},
                "config_keys": self.config}


def sha256(t: torch.Tensor) -> str:
    """Of the tensor's bytes as stored (any dtype, bf16 included)."""
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def dropped_on_load(model) -> Optional[re.Pattern]:
    """The pattern of checkpoint names the model's class drops on load, or None."""
    patterns = sorted(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def checkpoint_files(source: Path) -> Dict[str, Path]:
    """name -> the safetensors file holding it (the index's map, or every *.safetensors)."""
    from safetensors import safe_open

    index = source / "model.safetensors.index.json"
    if index.exists():
        return {n: source / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(source.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({n: f for n in s.keys()})
    return out


def carried_from(source, model, held: Iterable[str]) -> Carried:
    """The tensors of checkpoint `source` that `model`'s class drops on load and `held` (the
    names the export writes from the trained model) does not name, read unchanged."""
    if source is None:
        return Carried(None, "no input checkpoint given")
    from safetensors import safe_open

    source = Path(source)
    pattern = dropped_on_load(model)
    cls = type(model).__name__.removeprefix("FSDP")
    if pattern is None:
        return Carried(source, f"{cls} drops no checkpoint tensors on load")
    held = set(held)
    names = {n: f for n, f in checkpoint_files(source).items() if pattern.search(n) and n not in held}
    carried = Carried(source, f"{cls} drops them on load (_keys_to_ignore_on_load_unexpected: {pattern.pattern})")
    for f in sorted(set(names.values())):
        with safe_open(str(f), "pt") as s:
            carried.tensors.update({n: s.get_tensor(n) for n in names if names[n] == f})
    if carried.tensors and (source / "config.json").exists():
        config = json.loads((source / "config.json").read_text())
        carried.config = {k: v for k, v in config.items() if _describes_carried(k)}
    return carried
