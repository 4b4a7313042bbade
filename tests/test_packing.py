"""Sequence packing (hpc_rl/models/packing.py, forward_passes.py, mamba_segments.py; issue 44):
packed and padded rows give the same log-probs, loss and gradients on a dense Llama, Qwen3-MoE
and Nemotron-H (hybrid Mamba), one process and FSDP2 over 2 gloo ranks with uneven shares;
the Mamba state reset is what makes Nemotron-H agree (without it, planted here, it does not).

Tolerances from the arithmetic: both layouts compute the same float32 sums, in another order
(one packed row of all samples against padded rows: other matmul shapes and blockings, the
attention's softmax over a longer masked row, the Mamba scan's chunk boundaries at other
offsets). Each value is a few float32 roundings (eps32 = 1.2e-7) of activations of size ~1
through a 2-4 layer model and a log-softmax over V = 128..1000 (|log p| <= ~7): within 2e-5
absolute; gradients, sums over ~100 tokens of such terms, within 1e-4 of the largest entry.
Measured: at most 5e-7 (values, loss) and 3e-7 (gradients) on all three families; the Mamba
leak it must catch moved a log-prob by 0.18 (the planted test).
"""

from __future__ import annotations

import pytest
import torch

from hpc_rl.models.assets import ModelSpec, MoeModelSpec, NemotronHModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend
from hpc_rl.models.packing import first_fit_bins, micro_batches, pack, row_lengths, unpack
from gloo_ranks import run_ranks

SPECS = {"llama": ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=128),
         "qwen3_moe": MoeModelSpec(hidden=64, expert_intermediate=32, layers=2),
         "nemotron_h": NemotronHModelSpec()}
VALUE_TOL = 2e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    return {name: str(save_untrained(root / name, spec, seed=0)) for name, spec in SPECS.items()}


def rl_batch(rows: int = 7, width: int = 40, seed: int = 0):
    """Right-padded rows of uneven lengths (4..width tokens), like rollouts of one batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 100, (rows, width), generator=g)
    lengths = torch.randint(4, width + 1, (rows,), generator=g)
    lengths[0] = width
    attn = (torch.arange(width)[None] < lengths[:, None]).long()
    return ids * attn, attn


def loss_of(mask):
    """A masked sum of log-probs over the whole batch's tokens (micro-batches add up)."""
    def fn(lp, rows):
        m = mask[rows].float().to(lp.device)  # lp on the backend's device (tests/gpu/packing_check.py: CUDA)
        return -(lp * m).sum() / mask.float().sum(), {"tokens": float(m.sum())}
    return fn


def _grads(model) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _grad_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    scale = max(float(g.abs().max()) for g in a.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def _step_grads(backend: FSDP2Backend, ids, attn, micro_batch_size=None):
    """The train step's loss and gradients, without the optimizer's update (read before it)."""
    seen = {}
    orig = backend.optimizer.step

    def capture(*a, **k):
        seen.update(_grads(backend.model))
        return orig(*a, **k)

    backend.optimizer.step = capture
    out = backend.train_step(ids, attn, loss_of(attn), micro_batch_size=micro_batch_size)
    return out, seen


def test_bins_pack_unpack_roundtrip():
    ids, attn = rl_batch()
    lengths = row_lengths(attn)
    width = ids.shape[1]
    bins = first_fit_bins(lengths, width)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= width for b in bins) and len(bins) < len(lengths)
    assert first_fit_bins(lengths, 0) == [list(range(len(lengths)))]
    # micro-batches: rows x the longest row within the budget, at least one row each, every sample once
    parts = micro_batches(lengths, width, 2 * width)
    assert sorted(i for part in parts for row in part for i in row) == list(range(len(lengths)))
    assert all(len(part) <= 2 for part in parts) and len(parts) > 1
    p = pack(ids, lengths, parts[0], multiple=8)
    assert p.input_ids.shape[1] % 8 == 0 and p.input_ids.shape[1] <= width + 7
    assert p.tokens == sum(lengths[i] for row in parts[0] for i in row)
    for (r, o, n), i in zip(p.places, p.samples):
        # each sample's tokens and position ids (restarting at 0) in its packed row
        assert p.position_ids[r, o:o + n].tolist() == list(range(n))
        assert p.input_ids[r, o:o + n].tolist() == ids[i, :n].tolist()
    # spans cover each packed row exactly (samples, then the row's own pad span)
    for r, spans in enumerate(p.spans):
        assert spans[0][0] == 0 and spans[-1][1] == p.input_ids.shape[1]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # unpacking the packed rows' own token ids as "log-probs" returns each sample's ids after position 0
    back = unpack(p, p.input_ids.float(), width)
    for k, i in enumerate(p.samples):
        assert back[k, 1:lengths[i]].tolist() == ids[i, 1:lengths[i]].float().tolist()
        assert back[k, 0] == 0 and not back[k, lengths[i]:].any()
    attn_holes = attn.clone()
    attn_holes[1, 0] = 0
    with pytest.raises(ValueError, match="holes"):
        row_lengths(attn_holes)


def test_attn_implementation_is_honoured_on_packed_rows(ckpts):
    """trainer.attn_implementation reaches the model (eager here: the kernel with no fused path) and
    packed rows still keep each sample's attention to itself under it."""
    ids, attn = rl_batch()
    padded = FSDP2Backend(ckpts["llama"], precision="fp32", train=False)
    packed = FSDP2Backend(ckpts["llama"], precision="fp32", train=False, packing=True, logprob_batch_tokens=64,
                          attn_implementation="eager")
    assert packed.model.config._attn_implementation == "eager" != padded.model.config._attn_implementation
    mask = attn.bool()
    assert float((padded.logprobs(ids, attn) - packed.logprobs(ids, attn))[mask].abs().max()) <= VALUE_TOL


@pytest.mark.parametrize("family", list(SPECS))
def test_packed_equals_padded_one_rank(ckpts, family):
    ids, attn = rl_batch()
    padded = FSDP2Backend(ckpts[family], precision="fp32", train=True)
    packed = FSDP2Backend(ckpts[family], precision="fp32", train=True, packing=True, micro_batch_tokens=64,
                          logprob_batch_tokens=64)
    lp_pad, lp_pack = padded.logprobs(ids, attn), packed.logprobs(ids, attn)
    mask = attn.bool()
    assert float((lp_pad - lp_pack)[mask].abs().max()) <= VALUE_TOL
    assert not lp_pack[~mask].any()  # nothing past a sample's end
    out_pad, g_pad = _step_grads(padded, ids, attn, micro_batch_size=2)
    out_pack, g_pack = _step_grads(packed, ids, attn)
    assert out_pack["micro_batches"] == len(micro_batches(row_lengths(attn), ids.shape[1], 64)) > 1
    # the forwards' padding: the padded rows' is the batch's, the packed rows' only their tails
    assert out_pack["padding_share"] < out_pad["padding_share"] and out_pad["padding_share"] > 0.2
    assert abs(out_pad["loss"] - out_pack["loss"]) <= VALUE_TOL
    assert _grad_gap(g_pad, g_pack) <= GRAD_RTOL
    # the updated weights too (same gradients, same Adam step)
    for (n, a), b in zip(padded.model.state_dict().items(), packed.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), n


def test_packed_with_activation_checkpointing_nemotron_h(ckpts):
    """Checkpointing recomputes the Mamba mixers in the backward: the spans must hold there too."""
    ids, attn = rl_batch()
    plain = FSDP2Backend(ckpts["nemotron_h"], precision="fp32", train=True, packing=True, micro_batch_tokens=64)
    ac = FSDP2Backend(ckpts["nemotron_h"], precision="fp32", train=True, packing=True, micro_batch_tokens=64,
                      activation_checkpointing=True)
    (o1, g1), (o2, g2) = _step_grads(plain, ids, attn), _step_grads(ac, ids, attn)
    assert abs(o1["loss"] - o2["loss"]) <= VALUE_TOL
    assert _grad_gap(g1, g2) <= GRAD_RTOL


def test_planted_no_mamba_reset_fails(ckpts, monkeypatch):
    """Packing without the Mamba state reset (planted: the mixers are not wrapped) leaks one
    sample's state into the next: the comparison above must fail by far."""
    import hpc_rl.models.mamba_segments as ms

    monkeypatch.setattr(ms, "install", lambda model, use_seq_idx=None: 0)
    ids, attn = rl_batch()
    padded = FSDP2Backend(ckpts["nemotron_h"], precision="fp32", train=False)
    leaky = FSDP2Backend(ckpts["nemotron_h"], precision="fp32", train=False, packing=True, logprob_batch_tokens=256)
    gap = float((padded.logprobs(ids, attn) - leaky.logprobs(ids, attn))[attn.bool()].abs().max())
    assert gap > 100 * VALUE_TOL, gap


def _two_ranks(rank, world, ckpt, res):
    import torch.distributed as dist

    ids, attn = rl_batch(rows=9)
    mine = slice(rank, None, world)  # uneven shares: 5 and 4 rows, bins of other counts
    padded = FSDP2Backend(ckpt, group=dist.group.WORLD, precision="fp32", train=True)
    packed = FSDP2Backend(ckpt, group=dist.group.WORLD, precision="fp32", train=True, packing=True,
                          micro_batch_tokens=48 if rank == 0 else 200, logprob_batch_tokens=48 if rank == 0 else 200)
    lp_gap = float((padded.logprobs(ids[mine], attn[mine]) - packed.logprobs(ids[mine], attn[mine]))[attn[mine].bool()]
                   .abs().max())
    (o1, g1), (o2, g2) = _step_grads(padded, ids[mine], attn[mine], 1), _step_grads(packed, ids[mine], attn[mine])
    torch.save({"lp_gap": lp_gap, "loss_gap": abs(o1["loss"] - o2["loss"]), "grad_gap": _grad_gap(g1, g2),
                "packed_micro_batches": o2["micro_batches"]}, f"{res}.{rank}")


def test_packed_equals_padded_fsdp2_two_ranks(ckpts, tmp_path):
    """Each rank packs its own share; their micro-batch counts differ (rank 0 a small budget),
    so the rank with fewer runs spare forwards: no hang, the same gradients."""
    run_ranks(_two_ranks, 2, tmp_path / "store", ckpts["nemotron_h"], str(tmp_path / "res"))
    out = [torch.load(tmp_path / f"res.{r}", weights_only=False) for r in range(2)]
    for r in out:
        assert r["lp_gap"] <= VALUE_TOL and r["loss_gap"] <= VALUE_TOL and r["grad_gap"] <= GRAD_RTOL, out
    assert out[0]["packed_micro_batches"] == out[1]["packed_micro_batches"] > 1


TINY = ["+recipe=tiny_mopd", "launcher=dry_run"]
REFUSED = [
    (["trainer.micro_batch_tokens=4096"], "trainer.micro_batch_tokens", "without trainer.packing"),
    (["trainer.packing=true", "trainer.micro_batch_tokens=8"], "trainer.micro_batch_tokens", "must hold the longest sample"),
    (["trainer.packing=true", "trainer.micro_batch_size=2", "trainer.global_batch_size=64"], "trainer.micro_batch_size",
     "tokens, not rows"),
    (["trainer.packing=true", "trainer.parallel.tp=2", "trainer.tasks_per_node=2"], "trainer.parallel.tp",
     "without tensor parallel"),
    (["trainer.packing=true", "+teachers.add.parallel.cp=2", "+teachers.add.tasks_per_node=2"], "teachers.add.parallel.cp",
     "without context parallel"),
    # trainer.attn_implementation (validate_packing.py check_attention)
    (["trainer.attn_implementation=flash"], "trainer.attn_implementation", "not one of"),
    (["trainer.attn_implementation=flash_attention_2"], "trainer.attn_implementation", "CUDA-only"),
    (["trainer.attn_implementation=flash_attention_2", "cluster=h100", "trainer.precision=fp32"], "trainer.precision",
     "fp16/bf16 only"),
    (["trainer.attn_implementation=flash_attention_2", "cluster=h100", "trainer.precision=bf16",
      "teachers.add.precision=fp32"], "teachers.add.precision", "fp16/bf16 only"),
]


@pytest.mark.parametrize("overrides,key,fragment", REFUSED, ids=[" ".join(o) for o, _, _ in REFUSED])
def test_packing_refusals_name_the_key_and_fix(overrides, key, fragment):
    from hpc_rl.config.compose import load_config
    from hpc_rl.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(TINY + overrides)
    found = [v for v in info.value.violations if v.key == key and fragment in v.problem]
    assert found and all(v.fix for v in found), [v.render() for v in info.value.violations]


def test_packing_on_megatron_is_refused():
    from hpc_rl.config.compose import load_config
    from hpc_rl.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(["+recipe=ultra_mopd", "trainer.packing=true"])
    assert any(v.key == "trainer.packing" and "THD" in v.problem for v in info.value.violations)


def test_packing_accepted_on_fsdp2():
    from hpc_rl.config.compose import load_config

    cfg = load_config(TINY + ["trainer.packing=true", "trainer.micro_batch_tokens=512", "trainer.micro_batch_size=1"])
    assert cfg.trainer.packing and cfg.trainer.micro_batch_tokens == 512
