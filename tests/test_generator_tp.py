"""tiny_mopd with a tensor-parallel vLLM engine (generator.parallel.tp=2) in the RL loop, on
CPU: the engine is one generator task that starts its two TP workers (vLLM's multiprocessing
executor), and each worker is a refit rank receiving only its slices. After every refit
vLLM's sampling logprobs equal the trainer's (fp32 on both sides)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

SMALL = ["algo.prompts_per_step=32", "trainer.global_batch_size=32", "data.samples_per_task=32",
         "data.eval_prompts_per_task=8", "checkpoint.every_steps=100"]
ENGINE_TP2 = ["generator.parallel.tp=2"]


def _launch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_mopd", *ENGINE_TP2, *SMALL, *args],
                          capture_output=True, text=True, timeout=timeout)


def _check(run: Path, steps: int, n_trainers: int = 1) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0)] + [("step", s) for s in range(1, steps + 1)] + [("eval", steps)]
    for r in rows[1:-1]:
        # after every refit into both workers the engine samples with the trainer's weights
        assert r["token_mult_prob_error"] <= 1.001, r["token_mult_prob_error"]
        assert r["optimizer_steps"] == 2 and r["grad_norm"] > 0  # it trains: 64 samples, minibatches of 32
        assert set(r["reverse_kl"]) == {"add", "mul", "mean"}
    with h5py.File(run / "rollouts.h5", "r") as f:
        for s in range(1, steps + 1):
            g = f[f"step_{s:06d}"]
            assert g.attrs["weight_version"] == s - 1  # every worker stamped the refit (the engine serves the min)
            mask = g["response_mask"][:].astype(bool)
            diff = np.abs(g["generation_logprobs"][:][mask] - g["student_logprobs"][:][mask])
            assert float(np.exp(diff).mean()) <= 1.001
    gen = (run / "logs" / "generator.0.out").read_text()
    assert "'tensor_parallel_size': 2" in gen
    # engine 0's two workers are refit ranks n_trainers + 0*2 + j
    assert f"engine 0 joined the refit group: 2 worker(s) as refit ranks {[n_trainers, n_trainers + 1]}" in gen
    # every weight goes to both workers: 21 tensors x 2 (split or whole) from the trainer ranks' shards
    assert "refit plan: 42 transfers" in (run / "logs" / "trainer.0.out").read_text()


@pytest.mark.slow
def test_tiny_mopd_with_a_tp2_cpu_engine_locally(tmp_path):
    run = tmp_path / "run"
    proc = _launch("run.max_steps=3", f"run.dir={run}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check(run, 3)


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_mopd_with_a_tp2_cpu_engine_as_a_het_job(local_slurm, tmp_path):
    from hpc_rl.slurm.executor import job_from_run_dir

    run = tmp_path / "run"
    proc = _launch("cluster=local_slurm", "launcher=slurm", "launcher.wait=true", "run.max_steps=2", f"run.dir={run}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    roles = [r["role"] for r in job_from_run_dir(run).results()]
    assert roles == ["trainer", "generator", "teacher/add", "teacher/mul", "env"]
    _check(run, 2)


def test_the_refit_group_addresses_engine_g_tp_rank_j():
    # 2 trainer ranks, 2 engines of TP 2: engine g's worker j is refit rank 2 + g*2 + j
    from hpc_rl.refit.layout import Layout
    from hpc_rl.refit.vllm_engine import engine_first_rank, refit_setup

    specs = {"model.layers.0.mlp.down_proj.weight": ((8, 16), "float32"),
             "model.layers.0.input_layernorm.weight": ((8,), "float32")}
    setup = refit_setup(specs, 2, 2, "t", engine_tp=2)
    assert setup.world == 6
    assert [engine_first_rank(2, g, 2) for g in range(2)] == [2, 4]
    assert {r: setup.names[r] for r in range(2, 6)} == {2: "generator:0/tp0", 3: "generator:0/tp1",
                                                        4: "generator:1/tp0", 5: "generator:1/tp1"}
    dst = Layout.from_dict(setup.dst)
    assert dst.ranks() == [2, 3, 4, 5]  # every worker of every engine receives
