"""Refit plans executed over real gloo between processes that play both sides.

Each case starts one OS process per refit-group rank; layout ranks are spread over them so
that some process holds a source shard and a destination shard at once (colocated
trainer and vLLM). Every destination box must end bit-equal to the global tensor, and the
byte counts must be exactly the plan's. A killed or silent peer must make the others
raise within the deadline, naming it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hpc_rl.refit.execute import Holdings, RefitWalk
from hpc_rl.refit.layout import Layout, Piece, expert_parallel, merge, tensor_parallel
from hpc_rl.refit.planner import plan_refit
from hpc_rl.refit.transport import RefitError, TorchP2P
from hpc_rl.refit.transports import make_transport

SPECS = {
    "model.embed_tokens.weight": ((64, 16), "float32"),
    "model.layers.0.self_attn.q_proj.weight": ((16, 16), "float32"),
    "model.layers.0.self_attn.o_proj.weight": ((16, 16), "bfloat16"),
    "model.layers.0.mlp.down_proj.weight": ((16, 48), "float32"),
    "model.layers.0.input_layernorm.weight": ((16,), "float32"),
}
EXPERTS = {f"model.layers.0.mlp.experts.{e}.{w}.weight": ((8, 16) if w != "down_proj" else (16, 8), "float32")
           for e in range(8) for w in ("gate_proj", "up_proj", "down_proj")}
EXPERTS["model.layers.0.mlp.gate.weight"] = ((8, 16), "float32")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def truth(name: str, shape, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


class _BatchedGloo(TorchP2P):
    """TEST-ONLY: a gloo transport that takes several buffers as one message, as the CUDA IPC
    transport does on GPUs (batches_direct), so the walk's multi-buffer messages run here."""

    batches_direct = True

    def send_many(self, bufs, peer, tag):
        return [self.send(b, peer, tag) for b in bufs]

    def recv_many(self, bufs, peer, tag):
        return [self.recv(b, peer, tag) for b in bufs]

    def wait(self, handle, peer, deadline, what):
        for h in handle if isinstance(handle, list) else [handle]:
            super().wait(h, peer, deadline, what)


def _proc(me, world, port, src, dst, proc_of, domain_of, direct_min, misbehave, kind, out):
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=(me == 0), timeout=timedelta(seconds=30),
                              wait_for_workers=False)
        names = {p: f"proc:{p}" for p in range(world)}
        if kind == "gloo_batched":  # TEST-ONLY: the walk's several-buffer messages (CUDA IPC's) over gloo
            transport = _BatchedGloo.gloo(store, "refit/test", me, world, names, 30)
        else:
            transport = make_transport(kind, store, "refit/test", me, world, names, timeout_s=30)
        plan = plan_refit(src, dst, domain_of, bucket_bytes=2048)
        mine = [r for r, p in proc_of.items() if p == me]
        holdings = Holdings(dst=Holdings.allocate(dst, mine))
        for name, t in src.tensors.items():
            full = truth(name, t.shape, t.dtype)
            for piece in t.pieces:
                if piece.rank in mine:
                    view = full[tuple(slice(a, b) for a, b in zip(piece.start, piece.stop))].clone()
                    held = holdings.src.setdefault(piece.rank, {})
                    if name in held:  # several boxes of one tensor on one rank: a list of them
                        held[name] = [*(held[name] if isinstance(held[name], list) else [held[name]]),
                                      (piece.start, view)]
                    else:
                        held[name] = (piece.start, view)
        walk = RefitWalk(plan, holdings, proc_of, me, transport, direct_min=direct_min)
        if misbehave == "train4":  # still training for 4 s, longer than the 3 s deadline, then ready
            time.sleep(4.0)
        transport.ready(3.0)  # the deadline counts from here: every rank is ready
        if misbehave == "die":
            time.sleep(0.3)
            os._exit(9)
        if misbehave == "hang":
            time.sleep(30)
            return
        t0 = time.monotonic()
        try:
            stats = walk.run(time.monotonic() + 3.0)
            transport.barrier(time.monotonic() + 3.0)
        except RefitError as exc:
            out.put((me, "error", str(exc), time.monotonic() - t0))
            return
        bad = []
        for rank, tensors in holdings.dst.items():
            for name, boxes in tensors.items():
                t = dst.tensors[name]
                full = truth(name, t.shape, t.dtype)
                for start, tensor in boxes:
                    want = full[tuple(slice(a, a + n) for a, n in zip(start, tensor.shape))]
                    if not torch.equal(tensor, want):
                        bad.append((rank, name, start))
        expect_in = sum(tr.nbytes for tr in plan.transfers if proc_of[tr.dst] == me and proc_of[tr.src] != me)
        expect_out = sum(tr.nbytes for tr in plan.transfers if proc_of[tr.src] == me and proc_of[tr.dst] != me)
        out.put((me, "ok", {"bad": bad, "received": stats.bytes_received, "sent": stats.bytes_sent, "messages": stats.messages,
                            "expect_in": expect_in, "expect_out": expect_out}, time.monotonic() - t0))
    except BaseException:
        out.put((me, "crash", traceback.format_exc(), 0.0))


def run_case(src: Layout, dst: Layout, proc_of, domain_of=None, direct_min=256, misbehave=None, kind="torch",
             expect_all=False):
    world = max(proc_of.values()) + 1
    port = _free_port()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_proc, args=(p, world, port, src, dst, proc_of, domain_of, direct_min,
                                             (misbehave or {}).get(p), kind, out)) for p in range(world)]
    for p in procs:
        p.start()
    expected = world if expect_all else world - len(misbehave or {})
    results = {}
    deadline = time.monotonic() + 60
    while len(results) < expected and time.monotonic() < deadline:
        try:
            me, kind, payload, secs = out.get(timeout=1)
            results[me] = (kind, payload, secs)
        except Exception:
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return results


def _assert_exact(results, world):
    assert len(results) == world, results
    for me, (kind, payload, _) in results.items():
        assert kind == "ok", f"process {me}: {payload}"
        assert payload["bad"] == [], f"process {me}: wrong bytes in {payload['bad']}"
        assert payload["received"] == payload["expect_in"] and payload["sent"] == payload["expect_out"], payload


@pytest.mark.parametrize("kind", ["torch", "nixl"])
def test_tp2_to_tp1_with_a_process_holding_both_sides(kind):
    src, dst = tensor_parallel(SPECS, [0, 1]), tensor_parallel(SPECS, [10])
    _assert_exact(run_case(src, dst, {0: 0, 1: 1, 10: 1}, kind=kind), 2)


def test_tp1_to_tp2_packed_and_direct_messages():
    src, dst = tensor_parallel(SPECS, [0]), tensor_parallel(SPECS, [10, 11])
    for direct_min in (1 << 30, 64):  # everything packed, then most slices sent on their own
        _assert_exact(run_case(src, dst, {0: 0, 10: 1, 11: 2}, direct_min=direct_min), 3)


def test_several_direct_slices_to_one_peer_travel_as_one_message():
    """With a transport that batches (CUDA IPC: one store round trip per message), a bucket's
    large slices to one peer are one message of several buffers: bytes exact, fewer messages."""
    src, dst = tensor_parallel(SPECS, [0]), tensor_parallel(SPECS, [10, 11])
    batched = run_case(src, dst, {0: 0, 10: 1, 11: 2}, direct_min=64, kind="gloo_batched")
    _assert_exact(batched, 3)
    plain = run_case(src, dst, {0: 0, 10: 1, 11: 2}, direct_min=64)
    _assert_exact(plain, 3)
    sender = lambda results: results[0][1]["messages"]  # noqa: E731
    assert sender(batched) < sender(plain), (sender(batched), sender(plain))


def test_expert_parallel_to_a_different_expert_split():
    src = expert_parallel(EXPERTS, [0, 1, 2, 3], num_experts=8)
    dst = expert_parallel(EXPERTS, [10, 11], num_experts=8)
    _assert_exact(run_case(src, dst, {0: 0, 1: 0, 2: 1, 3: 1, 10: 2, 11: 1}), 3)


def test_a_source_rank_holding_several_boxes_of_one_tensor_sends_each():
    """A Megatron TP rank's Mamba in_proj is its piece of each of z, x, B, C, dt: several boxes
    of one HF tensor (models/megatron/nemotron_h_refit.py). Here rank 0 holds rows 0-4 and
    8-12, rank 1 rows 4-8 and 12-16, into a tp=2 and a tp=1 destination."""
    name, (shape, dtype) = "model.layers.0.self_attn.q_proj.weight", SPECS["model.layers.0.self_attn.q_proj.weight"]
    src = Layout()
    src.add(name, shape, dtype, [Piece(0, (0, 0), (4, 16)), Piece(0, (8, 0), (12, 16)),
                                 Piece(1, (4, 0), (8, 16)), Piece(1, (12, 0), (16, 16))])
    specs = {name: (shape, dtype)}
    dst = merge(tensor_parallel(specs, [10, 11]), tensor_parallel(specs, [12]))
    _assert_exact(run_case(src, dst, {0: 0, 1: 1, 10: 1, 11: 2, 12: 2}), 3)


@pytest.mark.parametrize("kind", ["torch", "nixl"])
def test_replicas_across_domains_forward_inside_the_domain(kind):
    src = tensor_parallel(SPECS, [0, 1])
    dst = merge(tensor_parallel(SPECS, [10, 11]), tensor_parallel(SPECS, [12, 13]))
    domain = {0: "A", 1: "A", 10: "B", 11: "B", 12: "B", 13: "B"}
    plan = plan_refit(src, dst, domain)
    assert any(t.stage == 1 for t in plan.transfers), "replicas in one domain should be fed by forwards"
    _assert_exact(run_case(src, dst, {0: 0, 1: 0, 10: 1, 11: 2, 12: 3, 13: 3}, domain_of=domain, kind=kind), 4)


@pytest.mark.parametrize("kind", ["torch", "nixl"])
@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_dead_or_silent_receiver_makes_the_sender_raise_within_the_deadline(how, kind):
    src, dst = tensor_parallel(SPECS, [0]), tensor_parallel(SPECS, [10, 11])
    results = run_case(src, dst, {0: 0, 10: 1, 11: 2}, misbehave={2: how}, kind=kind)
    kind, payload, secs = results[0]
    assert kind == "error", f"the sender should fail, got {kind}: {payload}"
    assert "proc:2" in payload, payload
    assert secs < 3.0 + 2.0, f"the sender took {secs:.1f}s (deadline 3 s)"
    # the healthy receiver does not hang either
    kind1, payload1, secs1 = results[1]
    assert kind1 == "error" and secs1 < 5.0, (kind1, payload1, secs1)
    if how == "hang":  # the message names the setting and what the late peer was doing, for how long
        assert "refit.timeout_s=3 from the moment every rank of the refit group was ready" in payload, payload
        assert "proc:2 was in refit 1 for" in payload, payload


def test_a_peer_still_training_past_the_deadline_is_waited_for():
    """Issue 31: the deadline bounds the transfer, not a peer's train step. The sender is
    ready 4 s after the receivers, past the 3 s deadline, and every byte still lands."""
    src, dst = tensor_parallel(SPECS, [0]), tensor_parallel(SPECS, [10, 11])
    results = run_case(src, dst, {0: 0, 10: 1, 11: 2}, misbehave={0: "train4"}, expect_all=True)
    _assert_exact(results, 3)


def test_a_barrier_rank_blames_where_the_chain_of_waits_ends_not_a_live_sender():
    """The ordering a CI run hit: receiver 1 fails in the end-of-refit barrier while sender 0
    (not arrived, still alive) is only about to record that it lost receiver 2. Rank 1 must
    name proc:2, not the first rank missing from the barrier."""
    import threading
    from hpc_rl.refit.transport import RefitError, _Named

    from hpc_rl.runtime.signed_store import SignedStore, job_key

    store = SignedStore(torch.distributed.HashStore(), job_key())  # the job's store: values signed
    names = {0: "proc:0", 1: "proc:1", 2: "proc:2"}

    def side(rank):
        t = _Named()
        t.rank, t.world, t.names, t.store, t.prefix, t.epoch = rank, 3, names, store, "refit", 1
        return t

    store.set("refit/arrived/1/1", "1")  # only rank 1 reached the barrier
    barrier_rank, sender = side(1), side(0)
    # the sender's wait on rank 2 fails 0.3 s later, in its own process
    later = threading.Timer(0.3, lambda: store.set("refit/waiting/0", "2"))
    later.start()
    with pytest.raises(RefitError) as err:
        barrier_rank._fail(None, "in the end-of-refit barrier, waiting for", ConnectionError("Connection closed by peer"),
                           missing=barrier_rank._not_arrived)
    later.join()
    assert "proc:2" in str(err.value) and "proc:0" not in str(err.value), err.value
    # the sender, failing second, reports the barrier rank's reason, which names proc:2
    with pytest.raises(RefitError) as err0:
        sender._fail(2, "sending to", ConnectionError("Connection closed by peer"))
    assert "proc:2" in str(err0.value), err0.value
