"""The memory savers' combinations this version cannot run, beside support.py (which adds them
to `unsupported`): each key alone is honoured or refused by a support.RULES row; these are
settings that one backend honours alone but not with another setting of the config.

trainer.cpu_offload (FSDP2's CPUOffloadPolicy, models/fsdp2.py) works where FSDP2 wraps the
whole student over a 1-D mesh of 2+ ranks: data parallel, context parallel (measured on 2 gloo
ranks: a train step with offload equals one without, tests/test_cpu_offload.py).
"""

from __future__ import annotations

from typing import List

from .errors import Violation
from .resources import world_size
from .schema import RunConfig


def memory_combinations(cfg: RunConfig) -> List[Violation]:
    t = cfg.trainer
    if cfg.run.program != "rl" or t.backend != "fsdp2" or not t.cpu_offload:
        return []
    out: List[Violation] = []
    p = t.parallel
    n = world_size(t, cfg.cluster) // max(p.tp, 1)  # dp x cp
    if n < 2:
        out.append(Violation("trainer.cpu_offload", True,
                             f"the fsdp2 backend wraps the student in FSDP2 only when it shards it over 2+ ranks "
                             f"(dp x cp = {n} here): one rank holds the whole model without "
                             "FSDP2, so there is no offload policy to apply and nothing would leave the device",
                             "set trainer.cpu_offload=false, or give the trainer 2+ ranks (trainer.nodes, trainer.tasks_per_node) so that "
                             "dp x cp >= 2"))
    if p.tp > 1:
        out.append(Violation("trainer.cpu_offload", True,
                             "with tensor parallel FSDP2 shards the dp dimension of a 2-D mesh whose groups are "
                             "NCCL only on GPUs; the norm of gradients held in host memory (clipping) and the full "
                             "state dict need a CPU backend in every mesh dimension, which this version builds only "
                             "for the 1-D FSDP2 mesh (data and context parallel)",
                             "set trainer.cpu_offload=false, or trainer.parallel.tp=1 (offload runs with data and context parallel)"))
    if p.ep > 1:
        out.append(Violation("trainer.cpu_offload", True,
                             "expert parallel's routed experts are outside FSDP2 (ignored_params: "
                             "models/parallel/expert_parallel.py owns them), so the experts, their gradients and "
                             "their optimizer state, most of an MoE model's memory, would stay on the device",
                             "set trainer.cpu_offload=false, or trainer.parallel.ep=1 (FSDP2 then shards and offloads the experts too)"))
    return out
