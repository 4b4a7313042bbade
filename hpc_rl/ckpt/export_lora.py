"""Export a LoRA student's adapters as a PEFT adapter directory (`trainer.lora`).

`adapter_config.json` + `adapter_model.safetensors` (models/lora.py write_adapter_dir): loads with
`PeftModel.from_pretrained(<base>, dir)` and serves as a vLLM LoRA adapter. The merged Hugging Face
checkpoint, on request (trainer.lora.export_merged), is ckpt/export.py's export of the merged weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch.distributed as dist

from hpc_rl.durable import publish_dir


def export_adapter(backend, out_dir, base_path: str, group: Optional[dist.ProcessGroup] = None) -> Path:
    """Write the backend's adapters to `out_dir`; every rank of a sharded backend calls it (the
    adapters are gathered), rank 0 of `group` writes. The directory appears atomically."""
    from hpc_rl.models.lora import full_adapters, write_adapter_dir

    out_dir = Path(out_dir)
    adapters = full_adapters(backend.model)  # a collective under FSDP2
    if group is not None and dist.is_initialized() and dist.get_rank(group) != 0:
        dist.barrier(group=group)
        return out_dir
    try:
        with publish_dir(out_dir, "adapter") as tmp:
            write_adapter_dir(backend.model, adapters, tmp, base_path)
    finally:
        if group is not None and dist.is_initialized():
            dist.barrier(group=group)
    return out_dir
