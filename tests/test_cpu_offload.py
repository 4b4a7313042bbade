"""trainer.cpu_offload on the fsdp2 backend (issue #44): FSDP2's CPUOffloadPolicy on every
sharded module, and a train step with offload equal to one without, over 2 gloo ranks.

On a CPU cluster FSDP2's offload copies are CPU to CPU, so the run with offload does the same
fp32 arithmetic in the same order as the run without: it is expected to agree to the bit. The
tolerance allows a few ulp of fp32 (the order of a reduction may differ where FSDP2 moves
gradients between buffers; on GPUs the optimizer steps on the CPU instead of the device, which
is where a real difference would come from). Measured here: 0.0 for loss, grad norm and every
weight after two optimizer steps (dp 2 and cp 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig
from backend_batches import masked_batch, masked_loss
from gloo_ranks import run_ranks

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
OPT = OptimConfig(lr=1e-2, grad_clip=1.0)
# a few ulp of fp32 relative to the values compared (see the module docstring)
RTOL = 8 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)


def _offload_policies(model) -> list:
    """Every FSDP2 module's offload policy class name (the layers and the root)."""
    return [type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
            for m in [*model.model.layers, model]]


def _worker(rank: int, world: int, ckpt: str, out: str) -> None:
    ids, attn = masked_batch(4, 12)
    mine = [0, 2] if rank == 0 else [1, 3]  # each rank its rows, as the trainer role gives them
    res = {}
    for layout, parallel in (("dp", None), ("cp", {"cp": 2})):
        for offload in (False, True):
            b = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OPT, parallel=parallel, cpu_offload=offload)
            rows = list(range(4)) if layout == "cp" else mine  # cp ranks share their rows
            steps = [b.train_step(ids[rows], attn[rows], masked_loss(attn[rows])) for _ in range(2)]
            state = {n: p.to_local().device.type for n, p in b.model.named_parameters()}
            optim = {t.device.type for s in b.optimizer.state.values() for t in s.values() if torch.is_tensor(t)}
            res[(layout, offload)] = {"steps": steps, "weights": b.full_state_dict(), "policies": _offload_policies(b.model),
                                      "param_devices": set(state.values()), "optim_devices": optim}
    if rank == 0:
        torch.save(res, out)


def test_a_train_step_with_cpu_offload_equals_one_without(tiny_ckpt, tmp_path):
    out = tmp_path / "offload.pt"
    run_ranks(_worker, 2, tmp_path / "store", str(tiny_ckpt), str(out))
    got = torch.load(out)
    for layout in ("dp", "cp"):
        plain, off = got[(layout, False)], got[(layout, True)]
        # the policy is on every sharded module, and only when asked for
        assert set(off["policies"]) == {"CPUOffloadPolicy"}, off["policies"]
        assert set(plain["policies"]) == {"OffloadPolicy"}, plain["policies"]
        # parameters (their shards) and the optimizer's state in host memory
        assert off["param_devices"] == {"cpu"} and off["optim_devices"] == {"cpu"}
        for a, b in zip(plain["steps"], off["steps"]):
            assert b["loss"] == pytest.approx(a["loss"], rel=RTOL, abs=0)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=RTOL, abs=0)
        assert set(off["weights"]) == set(plain["weights"])
        for name, w in plain["weights"].items():
            scale = float(w.abs().max())
            assert torch.allclose(off["weights"][name], w, rtol=0, atol=RTOL * max(scale, 1e-3)), (layout, name)
        # the steps moved the weights: the comparison is not between two untouched models
        assert plain["steps"][1]["loss"] < plain["steps"][0]["loss"]


def test_cpu_offload_without_fsdp2_is_refused_by_the_backend(tiny_ckpt):
    # one rank: no FSDP2 wraps the model (dp x cp = 1), so there is nothing to offload with;
    # validation refuses it first (config/support_memory.py), the backend does not go on without it
    with pytest.raises(ValueError, match="trainer.cpu_offload needs FSDP2 over 2\\+ ranks"):
        FSDP2Backend(str(tiny_ckpt), optim=OPT, cpu_offload=True)
    # an inference-only backend (a teacher) ignores it: it is the student's key
    assert not FSDP2Backend(str(tiny_ckpt), train=False, cpu_offload=True).cpu_offload


def test_offload_combinations_fsdp2_cannot_run_are_refused_naming_why():
    from hpc_rl.config import load_config
    from hpc_rl.config.support import unsupported

    def refused(*overrides):
        return {v.problem: v for v in unsupported(load_config(["+recipe=tiny_mopd", "trainer.cpu_offload=true", *overrides]))
                if v.key == "trainer.cpu_offload"}

    assert refused("trainer.tasks_per_node=2") == {}  # dp 2: runs (the test above)
    assert refused("trainer.tasks_per_node=2", "trainer.parallel.cp=2") == {}
    one = refused()  # tiny_mopd's trainer is one rank
    assert len(one) == 1 and "dp x cp = 1" in next(iter(one))
    tp = refused("trainer.tasks_per_node=4", "trainer.parallel.tp=2")
    assert len(tp) == 1 and "tensor parallel" in next(iter(tp)) and "trainer.parallel.tp=1" in next(iter(tp.values())).fix
    ep = refused("trainer.tasks_per_node=2", "trainer.parallel.ep=2", "model.architecture=qwen3_moe", "model.num_experts=4")
    assert len(ep) == 1 and "ignored_params" in next(iter(ep))
    for v in (*one.values(), *tp.values(), *ep.values()):
        assert "trainer.cpu_offload=false" in v.fix
