"""tiny_mopd end to end with a tensor-parallel (or context-parallel) student and teacher: the
refit from the trainer's shards into vLLM, the teacher's scores and greedy answers, as local
processes and as a Slurm het job. Both launches sample with a tensor-parallel-2 vLLM engine
(#14), each worker a refit rank receiving only its slices of the trainer's shards: locally
one generator task starts both workers; in the het job the engine spans two generator tasks
(engines/spanning.py). The two launches cross the layouts (issue #30: one launch each, no
layout left out): locally a cp=2 student and a tp=2 teacher, in the het job a tp=2 student
(with sequence parallelism) and a cp=2 teacher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

SMALL = ["algo.prompts_per_step=32", "trainer.global_batch_size=32", "data.samples_per_task=32",
         "data.eval_prompts_per_task=8", "trainer.micro_batch_size=8"]
TP_STUDENT = ["trainer.parallel.tp=2", "trainer.sequence_parallel=true"]
CP_STUDENT = ["trainer.parallel.cp=2"]
ENGINE_TP2 = ["generator.parallel.tp=2"]
LOCAL = [*CP_STUDENT, "+teachers.add.parallel.tp=2", *ENGINE_TP2]
HET = [*TP_STUDENT, "+teachers.add.parallel.cp=2", *ENGINE_TP2]
# tp=2 trainer into a TP-2 engine: 14 attention/MLP matrices split alike on both sides (2 each),
# 5 whole norms to both workers (2 each), and the embedding and lm_head (3 each): vLLM pads the
# 104-token vocabulary to 128, so engine worker 0's rows 0-63 come from both trainer ranks (0-51, 52-103)
TRANSFERS_TP = 14 * 2 + 5 * 2 + 2 * 3
# cp=2 trainer (FSDP2's Shard(0) over both ranks: every tensor's rows halved) into a TP-2 engine:
# the 10 column-parallel matrices (q, k, v, gate, up) split by rows alike on both sides (2 each);
# the 4 row-parallel ones (o, down) split by columns in the engine: each worker takes from both
# trainer ranks (4 each); the 5 norms go whole to both workers from both ranks (4 each); the
# embedding and lm_head as above (3 each)
TRANSFERS_CP = 10 * 2 + 4 * 4 + 5 * 4 + 2 * 3


def _launch(*args, layout, timeout=900):
    return subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_mopd", *args, *SMALL, *layout],
                          capture_output=True, text=True, timeout=timeout)


def _check(run: Path, steps: int, mesh: str, transfers: int, n_trainers: int = 2) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0)] + [("step", s) for s in range(1, steps + 1)] + [("eval", steps)]
    for r in rows[1:-1]:
        # vLLM sampled with the weights the trainer's shards refitted: fp32 on both sides
        assert r["token_mult_prob_error"] <= 1.001
        assert r["optimizer_steps"] == 2 and r["grad_norm"] > 0 and r["micro_batches"] == 4  # 32 rows per rank (dp 1) in pieces of 8
        assert set(r["reverse_kl"]) == {"add", "mul", "mean"}
    # the 2-rank teacher answers greedily like its dp-only self (tests/test_rl_loop.py: 1.0 each)
    assert rows[0]["teacher_accuracy"] == {"add_agent": 1.0, "mul_agent": 1.0}
    log = (run / "logs" / "trainer.0.out").read_text()
    assert mesh in log
    # each weight's bytes leave one rank (TRANSFERS_TP, TRANSFERS_CP)
    assert f"refit plan: {transfers} transfers" in log
    gen = (run / "logs" / "generator.0.out").read_text()
    engine_tp = 2
    assert f"'tensor_parallel_size': {engine_tp}" in gen
    # engine 0's workers are refit ranks n_trainers + 0*tp + j
    assert f"engine 0 joined the refit group: {engine_tp} worker(s) as refit ranks {list(range(n_trainers, n_trainers + engine_tp))}" in gen
    # a TP-2 engine's workers are processes of their own (vLLM's multiprocessing executor; only a
    # tp=1 CPU engine's worker runs in the generator rank): their signing reaches the rank's report
    report = json.loads((run / "auth" / "generator.0.0.json").read_text())
    assert report["engine_workers"]["ops"].get("signs", 0) > 0, report
    with h5py.File(run / "rollouts.h5", "r") as f:
        for step in range(1, steps + 1):
            assert f[f"step_{step:06d}"].attrs["weight_version"] == step - 1  # every worker stamped the refit (the engine serves the min)


@pytest.mark.slow
def test_tiny_mopd_with_a_cp2_student_a_tp2_teacher_and_a_tp2_engine_locally(tmp_path):
    run = tmp_path / "run"
    proc = _launch("run.max_steps=2", f"run.dir={run}", "trainer.tasks_per_node=2", "+teachers.add.tasks_per_node=2",
                   layout=LOCAL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check(run, 2, "dp 1 x cp 2 x tp 1", TRANSFERS_CP)


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_mopd_with_tp2_over_two_trainer_nodes_and_a_tp2_engine_as_a_het_job(local_slurm, tmp_path):
    from hpc_rl.slurm.executor import job_from_run_dir

    run = tmp_path / "run"
    # six nodes, as the cluster has: tp=2 across the two trainer nodes; the teacher's cp=2
    # runs its two ranks on one node; the TP-2 engine spans two generator tasks of one core
    # each (engines/spanning.py: the second task hosts worker tp1)
    proc = _launch("cluster=local_slurm", "launcher=slurm", "launcher.wait=true", "trainer.nodes=2",
                   "+teachers.add.tasks_per_node=2", "generator.tasks_per_node=2", "run.max_steps=2", f"run.dir={run}",
                   layout=HET)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = job_from_run_dir(run).results()
    roles = [r["role"] for r in results]
    assert roles == ["trainer", "trainer", "generator", "generator", "teacher/add", "teacher/add", "teacher/mul", "env"]
    assert [r.get("follower", False) for r in results if r["role"] == "generator"] == [False, True]
    _check(run, 2, "dp 1 x cp 1 x tp 2", TRANSFERS_TP)
    logs = "".join(p.read_text() for p in (run / "logs").glob("generator*.out"))
    assert "engine 0 task 1/2: hosting the engine's workers from tp1" in logs
