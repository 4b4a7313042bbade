"""The reshard planner over synthetic layouts, executed on numpy arrays: every destination
box ends up holding exactly the global tensor's values, no rank receives bytes it does not
keep, and each byte crosses into a destination domain at most once."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from hpc_rl.refit.layout import Layout, LayoutError, Piece, expert_parallel, fsdp2, merge, tensor_parallel
from hpc_rl.refit.planner import gather_broadcast_bytes, plan_refit

SPECS = {
    "model.embed_tokens.weight": ((12, 8), "float32"),
    "model.layers.0.self_attn.q_proj.weight": ((8, 8), "float32"),
    "model.layers.0.self_attn.o_proj.weight": ((8, 8), "float32"),
    "model.layers.0.mlp.down_proj.weight": ((8, 6), "float32"),
    "model.layers.0.input_layernorm.weight": ((8,), "float32"),
}


def _values(layout: Layout) -> dict:
    return {n: np.arange(np.prod(t.shape), dtype=np.float64).reshape(t.shape) + 1000 * i
            for i, (n, t) in enumerate(sorted(layout.tensors.items()))}


def _sl(start, stop):
    return tuple(slice(a, b) for a, b in zip(start, stop))


def execute(src: Layout, dst: Layout, plan) -> dict:
    """Run the plan on arrays: (rank, name) -> array of the global shape, NaN where the rank
    holds nothing. Checks on the way that each transfer's source really has the bytes."""
    truth = _values(src)
    held = {}
    for n, t in src.tensors.items():
        for p in t.pieces:
            arr = held.setdefault((p.rank, n), np.full(t.shape, np.nan))
            arr[_sl(p.start, p.stop)] = truth[n][_sl(p.start, p.stop)]
    got = {}
    for bucket in plan.buckets:
        for tr in bucket:
            store = held if tr.stage == 0 else got
            block = store[(tr.src, tr.name)][_sl(tr.start, tr.stop)]
            assert not np.isnan(block).any(), f"{tr}: the sender does not have these bytes yet"
            got.setdefault((tr.dst, tr.name), np.full(src.tensors[tr.name].shape, np.nan))[_sl(tr.start, tr.stop)] = block
    # every destination box is complete and exact
    for n, t in dst.tensors.items():
        for p in t.pieces:
            arr = got[(p.rank, n)]
            np.testing.assert_array_equal(arr[_sl(p.start, p.stop)], truth[n][_sl(p.start, p.stop)])
    return got


def _kept_only(dst: Layout, plan) -> None:
    """No destination rank receives an element outside its own boxes."""
    for tr in plan.transfers:
        boxes = [p for p in dst.tensors[tr.name].pieces if p.rank == tr.dst]
        assert any(all(a >= s and b <= e for a, b, s, e in zip(tr.start, tr.stop, p.start, p.stop)) for p in boxes), tr


def test_tp2_to_tp1_and_tp1_to_tp2():
    tp2, tp1 = tensor_parallel(SPECS, [0, 1]), tensor_parallel(SPECS, [10])
    plan = plan_refit(tp2, tp1)
    execute(tp2, tp1, plan)
    _kept_only(tp1, plan)
    total = sum(np.prod(s) * 4 for s, _ in SPECS.values())
    # each byte once: norms are replicated on both TP ranks, one copy is sent
    assert plan.stats["bytes"] == total
    back = plan_refit(tp1, tensor_parallel(SPECS, [20, 21]))
    execute(tp1, tensor_parallel(SPECS, [20, 21]), back)
    _kept_only(tensor_parallel(SPECS, [20, 21]), back)
    assert back.bytes_received()[20] == tensor_parallel(SPECS, [20, 21]).bytes_on(20)


def test_fsdp_over_two_ranks_to_vllm_tp1_moves_each_byte_once():
    src, dst = fsdp2(SPECS, [0, 1]), tensor_parallel(SPECS, [5])
    plan = plan_refit(src, dst)
    execute(src, dst, plan)
    assert plan.bytes_received() == {5: dst.bytes_on(5)}
    assert gather_broadcast_bytes(dst) == dst.bytes_on(5)  # one destination: a broadcast moves the same


def test_experts_resplit_between_different_expert_parallel_sizes():
    specs = {f"model.layers.0.mlp.experts.{e}.{w}.weight": ((6, 4), "bfloat16") for e in range(8) for w in ("up_proj", "down_proj")}
    specs["model.layers.0.mlp.gate.weight"] = ((8, 4), "bfloat16")
    src, dst = expert_parallel(specs, [0, 1, 2, 3], 8), expert_parallel(specs, [10, 11], 8)
    plan = plan_refit(src, dst)
    execute(src, dst, plan)
    _kept_only(dst, plan)
    # experts 0-3 go to rank 10 from ranks 0 and 1 only
    assert {t.src for t in plan.transfers if t.dst == 10 and ".experts." in t.name} == {0, 1}


def test_replicas_cross_into_each_domain_once_and_fan_out_over_nvlink():
    # two trainer replicas in domain A; vLLM: two TP2 instances, in domains B and C; each
    # instance's shards are also replicated on a second rank of the same domain
    src = merge(fsdp2(SPECS, [0, 1]), fsdp2(SPECS, [2, 3]))
    dst = merge(tensor_parallel(SPECS, [10, 11]), tensor_parallel(SPECS, [12, 13]),
                tensor_parallel(SPECS, [20, 21]), tensor_parallel(SPECS, [22, 23]))
    domain = {0: "A", 1: "A", 2: "A", 3: "A", 10: "B", 11: "B", 12: "B", 13: "B", 20: "C", 21: "C", 22: "C", 23: "C"}
    plan = plan_refit(src, dst, domain_of=domain)
    execute(src, dst, plan)
    _kept_only(dst, plan)
    model = sum(np.prod(s) * 4 for s, _ in SPECS.values())
    inter = defaultdict(int)
    for t in plan.transfers:
        if t.inter_domain:
            inter[domain[t.dst]] += t.nbytes
    # each destination domain needs the whole model once (its ranks hold all of it between them)
    assert dict(inter) == {"B": model, "C": model}
    assert all(not t.inter_domain for t in plan.transfers if t.stage == 1)
    # the two source replicas share the sending
    sent = defaultdict(int)
    for t in plan.transfers:
        if t.stage == 0:
            sent[t.src] += t.nbytes
    assert min(sent.values()) > 0 and len(sent) == 4


def test_plan_is_deterministic_and_buckets_respect_the_budget():
    src = merge(fsdp2(SPECS, [0, 1]), fsdp2(SPECS, [2, 3]))
    dst = merge(tensor_parallel(SPECS, [10, 11]), tensor_parallel(SPECS, [12, 13]))
    dom = {r: ("A" if r < 10 else "B") for r in (0, 1, 2, 3, 10, 11, 12, 13)}
    a, b = plan_refit(src, dst, dom, bucket_bytes=64), plan_refit(src, dst, dom, bucket_bytes=64)
    assert a.transfers == b.transfers and [len(x) for x in a.buckets] == [len(x) for x in b.buckets]
    for bucket in a.buckets:
        assert sum(t.nbytes for t in bucket) <= 64 or len(bucket) == 1
    execute(src, dst, a)  # bucket order delivers every forward's bytes first


def test_bad_layouts_are_refused_at_setup_naming_every_problem():
    src = tensor_parallel(SPECS, [0, 1])
    dst = tensor_parallel(SPECS, [10])
    dst.tensors["model.layers.0.mlp.down_proj.weight"].shape = (8, 7)
    dst.tensors["model.embed_tokens.weight"].dtype = "bfloat16"
    dst.add("model.layers.0.mlp.up_proj.weight", (8, 8), "float32", [Piece(10, (0, 0), (8, 8))])
    src.tensors["model.layers.0.self_attn.q_proj.weight"].pieces.pop()  # rank 1's half is gone
    with pytest.raises(LayoutError) as err:
        plan_refit(src, dst)
    text = str(err.value)
    assert "down_proj.weight: shape (8, 6) (source) vs (8, 7) (destination)" in text
    assert "embed_tokens.weight: dtype float32 (source) vs bfloat16 (destination)" in text
    assert "up_proj.weight: the destination needs it, the source has no such parameter" in text
    assert "q_proj.weight (source): no rank holds the elements from (4, 0)" in text
