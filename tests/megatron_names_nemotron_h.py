"""Builds megatron-core's Nemotron-H model (MambaModel, its Transformer Engine stack spec) on
CPU for Hugging Face configs, with TEST-ONLY stand-ins for Transformer Engine and mamba-ssm
(tests/te_mamba_stand_in.py) and the CPU shim (tests/megatron_cpu_shim.py), and prints
{config name: {parameter: [shape, dtype]}} as JSON, built in bf16 (what stays fp32 shows).
Names, shapes and dtypes only: nothing runs a forward.
Run in its own process by tests/test_megatron_nemotron_h.py (it installs import hooks and
initialises torch.distributed and Megatron's global parallel state).

    python tests/megatron_names_nemotron_h.py CONFIGS.json
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import te_mamba_stand_in  # noqa: E402

te_mamba_stand_in.install()



def main(path: str) -> None:
    warnings.filterwarnings("ignore")
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    from megatron_names import one_gloo_rank

    one_gloo_rank()
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    from hpc_rl.models.megatron import config_map
    from hpc_rl.models.megatron.shards import Parallel

    out = {}
    for name, hf in json.load(open(path)).items():
        kw = config_map.transformer_kwargs(hf, Parallel(), sequence_parallel=False, precision="bf16", te=True, cpu_init=True)
        kw.update(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)  # no CUDA stream at build
        cfg = config_map.transformer_config(kw)
        model = MambaModel(cfg, mamba_stack_spec, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                           **config_map.model_kwargs(hf, Parallel(), 64))
        out[name] = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in model.state_dict().items()
                     if not k.endswith("_extra_state")}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
