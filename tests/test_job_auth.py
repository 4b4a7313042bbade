"""Only the job's own ranks can write what its ranks act on (issue 29): store values carry
a MAC keyed by the job's secret, rendezvous admits only ranks that prove it, pickled
messages are checked before unpickling, and the secret stays out of the run directory."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hpc_rl.runtime import env
from hpc_rl.runtime.signed_store import (REJECTED, MissingJobKey, SignedStore, job_key, new_job_key, rejected_total,
                                         seal)
from tests.gloo_ranks import run_ranks
from hpc_rl.launchers.local import free_port


def _store(port: int, master: bool, secret: bytes, world: int = 2) -> SignedStore:
    raw = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=master, timeout=timedelta(seconds=10),
                        wait_for_workers=False)
    return SignedStore(raw, secret)


class Payload:
    """Unpickling it creates a file: what a stranger's pickle could do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_forged_store_value_is_invisible_and_counted(tmp_path):
    secret = new_job_key().encode()
    port = free_port()
    job = _store(port, True, secret)
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))  # no secret
    before = rejected_total()
    stranger.set("hb/0/abort", "forged verdict")  # (b) a forged abort
    assert job.peek("hb/0/abort") is None and not job.check(["hb/0/abort"])
    assert REJECTED["hb/0/abort"] >= 2 and rejected_total() >= before + 2
    # (a) a pickle under a refit key: never loaded, the reader waits on for a valid value
    target = tmp_path / "pwned"
    stranger.set("refit/ipc/0-1/0/0", pickle.dumps(Payload(str(target))))
    got = []
    reader = threading.Thread(target=lambda: got.append(job.get("refit/ipc/0-1/0/0")))
    reader.start()
    job.set("refit/ipc/0-1/0/0", b"genuine")
    reader.join(10)
    assert got == [b"genuine"] and not target.exists()
    # a valid value signed for another key does not verify under this one
    job.set("gen/0/master", "10.0.0.1:1234")
    stranger.set("gen/1/master", stranger.get("gen/0/master"))
    assert job.peek("gen/1/master") is None and job.peek("gen/0/master") == b"10.0.0.1:1234"
    # a store signed with another job's secret sees nothing of this job
    other = SignedStore(stranger, new_job_key().encode())
    assert other.peek("gen/0/master") is None
    with pytest.raises(TimeoutError, match="without the job's MAC"):
        other.wait(["gen/0/master"], timedelta(seconds=0.3))


def test_compare_set_keeps_the_first_valid_reason():
    store = SignedStore(dist.HashStore(), new_job_key().encode())
    store.compare_set("refit/abort", "", "generator:0: first")
    store.compare_set("refit/abort", "", "trainer:0: second")
    assert store.peek("refit/abort") == b"generator:0: first"


def test_a_rank_without_the_key_does_not_start(tmp_path):
    from hpc_rl.runtime.worker import run_rank

    with pytest.raises(MissingJobKey, match=f"{env.JOB_KEY} is unset"):
        run_rank(str(tmp_path), environ={env.ROLE: "trainer", env.ROLE_RANK: "0"})
    with pytest.raises(MissingJobKey, match="too short"):
        job_key({env.JOB_KEY: "abc"})


def test_a_rank_with_another_secret_cannot_join_the_rendezvous():
    from hpc_rl.config import load_config
    from hpc_rl.plan import build_plan
    from hpc_rl.runtime.identity import RankIdentity
    from hpc_rl.runtime.rendezvous import RendezvousError, rendezvous

    cfg = load_config(["+recipe=comm_check"])
    plan = build_plan(cfg)
    world = sum(r.tasks for r in plan.roles)
    port = free_port()
    secret = new_job_key().encode()
    host = _store(port, True, secret, world)

    def ident(r: int) -> RankIdentity:
        return RankIdentity("trainer", r, world, r, world, r, "local0", 0, "t")

    # every rank but the last arrives with the job's secret; the last (an impostor) with another
    errors = {}

    def join(r: int, key: bytes):
        try:
            rendezvous(host if r == 0 else _store(port, False, key, world), ident(r), plan, 2.0)
        except RendezvousError as exc:
            errors[r] = str(exc)

    threads = [threading.Thread(target=join, args=(r, secret if r < world - 1 else new_job_key().encode()))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(errors) == set(range(world)), errors  # nobody was admitted with the impostor
    assert "never arrived" in errors[0] and "do not carry this job's MAC" in errors[0], errors[0]
    assert "this rank's HPC_RL_JOB_KEY is not the job's" in errors[world - 1]


def _tampered_p2p(rank: int, world: int, marker: str) -> None:
    from hpc_rl.messaging import p2p
    from hpc_rl.runtime import sealed
    import torch

    if rank == 0:
        p2p.send({"order": 1}, 1)  # genuine
        # a message framed like ours, MAC from another secret, a pickle that makes a file
        blob = seal(new_job_key().encode(), "p2p/0->1/1", pickle.dumps(Payload(marker)))
        dist.send(torch.tensor([len(blob)], dtype=torch.long), 1)
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), 1)
        # a genuine message altered on the way (one payload byte flipped)
        good = bytearray(sealed.dumps({"order": 2}, "p2p/0->1/2"))
        good[-3] ^= 1
        dist.send(torch.tensor([len(good)], dtype=torch.long), 1)
        dist.send(torch.frombuffer(good, dtype=torch.uint8), 1)
    else:
        assert p2p.recv(0) == {"order": 1}
        for _ in range(2):
            with pytest.raises(sealed.MessageRejected, match="refused before unpickling"):
                p2p.recv(0)
        assert not Path(marker).exists()


def test_a_tampered_message_is_refused_before_unpickling(tmp_path):
    marker = tmp_path / "pwned"
    run_ranks(_tampered_p2p, 2, tmp_path / "store", str(marker))
    assert not marker.exists()


PLANTED = "5eed" * 16  # the launch's secret, planted so the run directory can be searched for it


def test_the_secret_never_reaches_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    code = (f"import sys, hpc_rl.launchers.local as local; local.new_job_key = lambda: {PLANTED!r}; "
            f"from hpc_rl.launch import main; sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code, "+recipe=comm_check", "launcher=local", f"run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=240, env={k: v for k, v in __import__("os").environ.items()
                                                                            if k != env.JOB_KEY})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 5 and any(p.name.endswith("_result.pkl") for p in files)
    needles = [PLANTED.encode(), PLANTED.upper().encode(), bytes.fromhex(PLANTED)]
    leaked = [str(p) for p in files for n in needles if n in p.read_bytes()]
    assert not leaked, leaked
    assert PLANTED not in proc.stdout + proc.stderr


def test_the_store_host_listens_on_the_plans_address_only():
    import socket

    from hpc_rl.runtime.rendezvous import listen_on

    port = free_port()
    fd = listen_on("127.0.0.1", port)
    view = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a dup: the store keeps its own
    assert view.getsockname() == ("127.0.0.1", port)
    view.close()
    host = SignedStore(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                                     timeout=timedelta(seconds=10)), b"k" * 64)
    peer = SignedStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)), b"k" * 64)
    peer.set("x", "1")
    assert host.get("x") == b"1"


def test_rejections_are_reported_per_rank_and_summed_for_the_job(tmp_path):
    """Each rank's report (its engine workers' rejections included) and the job-wide sum
    that summary.json holds (runtime/auth_stats.py)."""
    import json
    import os

    from hpc_rl.config import load_config
    from hpc_rl.plan import build_plan
    from hpc_rl.rl.records import update_summary
    from hpc_rl.runtime import auth_stats

    assert auth_stats.kind("refit/0/ready/2/1") == "refit/*/ready/*/*"
    assert auth_stats.kind("p2p/0->1/3") == "p2p/*->*/*" and auth_stats.kind("gather/0123456789abcdef/4/2") == "gather/*/*/*"
    store = SignedStore(dist.HashStore(), new_job_key().encode())
    dist.HashStore.set(store.raw, "hb/0/abort", b"forged")
    before = auth_stats.rank_report()
    assert store.peek("hb/0/abort") is None
    # an engine worker in another process rejected twice; one in this process is not counted twice
    auth_stats.add_workers([{"pid": os.getpid() + 1, "rejected": {"refit/0/ready/1/0": 2}, "ops": {"signs": 3}},
                            {"pid": os.getpid(), "rejected": dict(REJECTED), "ops": {}}])
    rep = auth_stats.rank_report()
    assert rep["rejected_total"] == before["rejected_total"] + 1 + 2
    assert rep["engine_workers"] == {"rejected_by_kind": {"refit/*/ready/*/*": 2}, "ops": {"signs": 3}}
    assert rep["ops"]["peek"] >= 1 and rep["ops"]["verifies"] >= 1

    plan = build_plan(load_config(["+recipe=tiny_mopd"]))
    run = tmp_path / "run"
    (run / "summary.json").parent.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 2}))
    written = [("trainer", 0, 0), ("generator", 0, 0), ("env", 0, 0), ("teacher/add", 0, 1)]
    for role, rank, restart in written:
        path = auth_stats.RunDir(run).auth_report(role, rank, restart)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"rejected_total": 3, "rejected_by_kind": {"hb/*/abort": 3}}))
    totals = auth_stats.job_totals(run, plan, restart=1)
    # restart 0's missing files belong to an earlier attempt; restart 1's are named
    assert totals["auth_rejected"] == 12 and totals["auth_rejected_by_kind"] == {"hb/*/abort": 12}
    assert totals["auth_rejected_by_role"]["teacher/add"] == 3 and totals["auth_rejected_by_role"]["teacher/mul"] == 0
    assert set(totals["auth_reports_missing"]) == {"trainer:0", "generator:0", "teacher/mul:0", "env:0"}
    assert update_summary(run, totals)["steps"] == 2 and json.loads((run / "summary.json").read_text())["auth_rejected"] == 12
