"""One rank of the Megatron backend on CPU under the test-only shim (megatron_cpu_shim.py),
started by tests/test_megatron_cpu_forward.py with RANK, WORLD_SIZE, MASTER_PORT set.

    python tests/megatron_cpu_run.py CKPT INPUTS.pt OUT_DIR tp pp

Loads the checkpoint inference-only (as a teacher would) on a tp x pp mesh over gloo and
saves this rank's log-probs, a greedy continuation, its refit boxes and the gathered HF state.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(ckpt: str, inputs: str, out_dir: str, tp: int, pp: int) -> None:
    warnings.filterwarnings("ignore")
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    from hpc_rl.config.schema import ParallelConfig
    from hpc_rl.models.backend import parallel_sizes
    from hpc_rl.models.megatron.backend import MegatronBackend

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    b = MegatronBackend(ckpt, dist.group.WORLD, "fp32", "cpu", train=None, parallel=parallel_sizes(ParallelConfig(tp=tp, pp=pp)))
    x = torch.load(inputs)
    lp = b.logprobs(x["ids"], x["mask"])
    greedy = b.greedy(x["prompt"], torch.ones_like(x["prompt"]), 4, eos_id=-1, pad_id=0)
    shards = {k: (s, t.clone()) for k, (s, t) in b.local_shards().items()}
    full = b.full_state_dict()
    torch.save({"lp": lp, "greedy": greedy, "shards": shards, "full": full, "dp": (b.dp_rank, b.dp_size)},
               Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
