"""Builds megatron-core GPTModels on CPU (local layer spec, one gloo rank) for Hugging Face
configs and prints {config name: {parameter: shape}} as JSON. megatron-core builds on CPU
but cannot run its forward there (NOTES.md), so this checks names and shapes only.
Run in its own process by tests/test_megatron_mapping.py: it initialises
torch.distributed and Megatron's global parallel state.

    python tests/megatron_names.py CONFIGS.json
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch


def one_gloo_rank() -> None:
    """torch.distributed and Megatron's parallel state as one gloo rank on a free port: what
    building a megatron-core model needs (also used by tests/megatron_names_nemotron_h.py)."""
    import socket

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)


def main(path: str) -> None:
    warnings.filterwarnings("ignore")
    one_gloo_rank()
    from megatron.core.models.gpt import GPTModel

    from hpc_rl.models.megatron import config_map
    from hpc_rl.models.megatron.shards import Parallel

    out = {}
    for name, hf in json.load(open(path)).items():
        kw = config_map.transformer_kwargs(hf, Parallel(), sequence_parallel=False, precision="fp32", te=False, cpu_init=True)
        # alltoall (our dispatcher) creates a CUDA stream when built; allgather builds on CPU.
        # Dispatchers hold no parameters, so the names and shapes are the same.
        kw.update(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
        cfg = config_map.transformer_config(kw)
        model = GPTModel(cfg, config_map.layer_spec(cfg, te=False), **config_map.model_kwargs(hf, Parallel(), 64))
        out[name] = {k: list(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
