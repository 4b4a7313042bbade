"""Export the trainer's weights as a Hugging Face checkpoint directory.

The result (`config.json`, `model.safetensors` or shards plus `model.safetensors.index.json`,
tokenizer files when given) loads with `AutoModelForCausalLM.from_pretrained` and serves with
vLLM. Works for plain and FSDP2-sharded backends: the full weights are gathered on every rank
(`backend.full_state_dict()` is a collective), rank 0 of `group` writes.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from hpc_rl.durable import publish_dir

# Tokenizer files a HF tokenizer directory may hold; copied verbatim.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# The size at which HF itself starts a new safetensors shard.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
MANIFEST = "export_manifest.json"  # what the export holds and where each part came from

log = logging.getLogger(__name__)


def _tied_output_names(model: torch.nn.Module) -> List[str]:
    """Names of the output-embedding weights that HF ties to the input embeddings; they are
    left out, as save_pretrained does, and from_pretrained re-ties them."""
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not getattr(text_cfg, "tie_word_embeddings", False):
        return []
    out = model.get_output_embeddings()
    return [f"{name}.weight" if name else "weight" for name, m in model.named_modules() if m is out]


def _shards(state: Dict[str, torch.Tensor], max_bytes: int) -> List[Dict[str, torch.Tensor]]:
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def export_hf(backend, out_dir, tokenizer_dir=None, group: Optional[dist.ProcessGroup] = None,
              dtype: Optional[torch.dtype] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              overwrite: bool = False, state: Optional[Dict[str, torch.Tensor]] = None, source_dir=None) -> Path:
    """Write the backend's full weights to `out_dir` as a HF checkpoint; every rank of a sharded
    backend calls it. `dtype` casts on the way out (e.g. torch.bfloat16 for serving; default:
    the fp32 master weights). The directory appears atomically (written beside it, then renamed).
    `state`: the full state dict when the caller already gathered it (no second gather).
    `source_dir`: the checkpoint whose dropped-on-load tensors are carried over (default: the
    one the backend loaded, its `checkpoint_dir`)."""
    out_dir = Path(out_dir)
    # A collective on sharded backends: every rank takes part, whichever rank writes.
    state = dict(state) if state is not None else backend.full_state_dict()
    if group is not None and dist.is_initialized() and dist.get_rank(group) != 0:
        dist.barrier(group=group)
        return out_dir
    try:
        # Rank 0 only; the others wait at the barrier below, which rank 0 reaches even on error
        # so that a refused export fails the job instead of hanging it.
        # a backend whose model is not a HF module (megatron) names one for the config and tied names
        source = source_dir if source_dir is not None else getattr(backend, "checkpoint_dir", None)
        _write(getattr(backend, "export_model", backend.model), state, out_dir, tokenizer_dir, dtype, max_shard_bytes,
               overwrite, source)
    finally:
        if group is not None and dist.is_initialized():
            dist.barrier(group=group)
    return out_dir


def _write(model, state, out_dir: Path, tokenizer_dir, dtype, max_shard_bytes: int, overwrite: bool, source) -> None:
    from safetensors.torch import save_file

    from .carry import carried_from

    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True or choose another directory")
    from hpc_rl.models.parallel.expert_names import to_checkpoint_names

    for name in _tied_output_names(model):
        state.pop(name, None)
    state = to_checkpoint_names(state)  # MoE: one tensor per expert, as HF and vLLM load them
    # safetensors refuses tensors that share storage or are non-contiguous views; clone to own each.
    state = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().clone() for k, v in state.items()}
    dtype_name = str(dtype or next(iter(state.values())).dtype).removeprefix("torch.")
    # after the cast: carried tensors keep the input's bytes and dtype
    carried = carried_from(source, model, state)
    state.update(carried.tensors)

    # the export is the run's product: on disk before its name says it is complete
    with publish_dir(out_dir, "export") as tmp:
        config = model.config.to_dict()
        # fully_shard swaps the model's class for a generated FSDP<Name> subclass; name the HF one.
        config["architectures"] = config.get("architectures") or [type(model).__name__.removeprefix("FSDP")]
        config.update(carried.config)  # the input's own description of the carried tensors
        config["torch_dtype"] = dtype_name
        if "dtype" in config:
            config["dtype"] = dtype_name
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)

        shards = _shards(state, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")

        manifest = {"dtype": dtype_name, "tensors_from_model": len(state) - len(carried.tensors),
                    "carried_from_input": carried.manifest()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")

        if tokenizer_dir is not None:
            tok = Path(tokenizer_dir)
            copied = [f for f in TOKENIZER_FILES if (tok / f).is_file()]
            if not copied:
                raise FileNotFoundError(f"{tok}: no tokenizer files (looked for {list(TOKENIZER_FILES)})")
            for f in copied:
                shutil.copy2(tok / f, tmp / f)

    if carried.tensors:
        log.info("export %s: %d tensors carried unchanged from %s (%s): %s; config keys %s", out_dir,
                 len(carried.tensors), carried.source, carried.reason, _summary(sorted(carried.tensors)),
                 sorted(carried.config))


def carried_note(out_dir) -> str:
    """A log line's tail naming what an export carried from its input (empty when nothing)."""
    path = Path(out_dir) / MANIFEST
    carried = json.loads(path.read_text())["carried_from_input"] if path.exists() else {}
    names = sorted(carried.get("tensors", {}))
    if not names:
        return ""
    return (f"; {len(names)} tensors carried unchanged from {carried['source']} ({_summary(names)}), "
            f"listed in {MANIFEST}")


def _summary(names: List[str], first: int = 4) -> str:
    return ", ".join(names[:first]) + (f" and {len(names) - first} more" if len(names) > first else "")
