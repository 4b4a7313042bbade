"""The RL loop end to end with real components: FSDP2 trainer, vLLM generator (CPU), two
inference-only teachers and an env rank, as local processes and as Slurm het jobs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rl.rundir import RunDir
from hpc_rl.slurm.executor import job_from_run_dir
import neighbour
from slow_train_step import check_slow_train_step_was_waited_for

SMALL = ["algo.prompts_per_step=32", "trainer.global_batch_size=32", "data.samples_per_task=32",
         "data.eval_prompts_per_task=8"]


def _launch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "hpc_rl.launch", *args], capture_output=True, text=True, timeout=timeout)


def _steps(run: Path) -> list:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check_rollouts(run: Path, steps: int, routes: dict) -> None:
    with h5py.File(run / "rollouts.h5", "r") as f:
        assert sorted(f) == [f"step_{s:06d}" for s in range(1, steps + 1)]
        for s in range(1, steps + 1):
            g = f[f"step_{s:06d}"]
            for name in ("input_ids", "attention_mask", "response_mask", "generation_logprobs", "teacher_logprobs",
                         "student_logprobs", "advantages", "rewards", "agents", "teachers"):
                assert name in g, name
            mask = g["response_mask"][:].astype(bool)
            assert mask.any(axis=1).all()  # every sample has generated tokens
            # every sampled token was scored by a teacher (a logprob is never exactly 0 here)
            assert (g["teacher_logprobs"][:][mask] < 0).all()
            assert (g["teacher_logprobs"][:][~mask] == 0).all() and (g["advantages"][:][~mask] == 0).all()
            agents = [a.decode() for a in g["agents"][:]]
            teachers = [t.decode() for t in g["teachers"][:]]
            assert [routes[a] for a in agents] == teachers  # exactly one teacher per sample, by its agent
            # The generator sampled with the weights the trainer had at that step: after each
            # refit vLLM's logprobs equal the trainer's recomputation (fp32 on both sides).
            diff = np.abs(g["generation_logprobs"][:][mask] - g["student_logprobs"][:][mask])
            assert float(np.exp(diff).mean()) <= 1.001, f"step {s}: refit left vLLM and the trainer apart"
            assert g.attrs["weight_version"] == s - 1


@pytest.mark.slow
def test_tiny_mopd_three_steps_locally(tiny_mopd_three_steps):
    run, proc = tiny_mopd_three_steps  # tests/shared_runs.py: shared with tests/test_observe.py
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_slow_train_step_was_waited_for(run)
    assert "reverse KL to teacher" in proc.stdout and "accuracy (greedy)" in proc.stdout
    # the engine's KV cache as vLLM sized it (engines/kv_capacity.py): the tiny model's fits a step
    kv = re.search(r"engine 0: KV cache of (\d+) tokens", (run / "logs" / "generator.0.err").read_text()
                   + (run / "logs" / "generator.0.out").read_text())
    assert kv and int(kv.group(1)) >= 64 * 128, "the generator's log names its KV cache size"
    rows = _steps(run)
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("step", 1), ("step", 2), ("step", 3), ("eval", 3)]
    for r in rows[1:4]:
        assert set(r["reverse_kl"]) == {"add", "mul", "mean"}
        assert r["token_mult_prob_error"] <= 1.001
        assert set(r["accuracy"]) == {"add_agent", "mul_agent"} and 0.0 <= r["reward_mean"] <= 1.0
        # 32 prompts x 2 generations = 64 samples in minibatches of trainer.global_batch_size=32
        assert r["optimizer_steps"] == 2 and r["grad_norm"] > 0
        # packed (shared_runs.PACKED): each minibatch's 32 samples (~20 tokens) in a few micro-batches
        # of <= 256 tokens (the padded path would run 32 of trainer.micro_batch_size=1);
        # token_mult_prob_error above compares the packed trainer's log-probs to vLLM's
        assert 2 <= r["micro_batches"] <= 8 and 0 <= r["padding_share"] < 1
        assert {"generate_s", "score_s", "train_s", "refit_s", "step_s"} <= set(r["timing"])
    assert rows[0]["teacher_accuracy"] == {"add_agent": 1.0, "mul_agent": 1.0}
    _check_rollouts(run, 3, {"add_agent": "add", "mul_agent": "mul"})
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and set(summary["start"]["reverse_kl"]) == {"add", "mul", "mean"}
    assert len(summary["final_weights_sha256"]) == 64 and int(summary["final_weights_sha256"], 16) >= 0
    # checkpoints at step 2 and the last step, keep_last=1 leaves the newest
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000003"]
    assert (run / "FINISHED").exists()
    assert (run / "final_hf" / "config.json").exists() and list((run / "final_hf").glob("*.safetensors"))
    for log in ("trainer", "generator", "teacher-add", "teacher-mul", "env"):
        assert "setup done" in (run / "logs" / f"{log}.0.out").read_text()


STALL_S = 120  # trainer:0 holds step 3 at most this long (the test releases it once it has watched the live job)
ROLES = ["trainer", "generator", "teacher/add", "teacher/mul", "env"]


def _watch(run: Path, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "hpc_rl.slurm.watch", str(run), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _watch_the_stalled_job(run: Path, env) -> None:
    """`hpc_rl.slurm.watch` on the running job while trainer:0 stalls at the start of step 3
    (everyone else waits for it), then followed to the end."""
    deadline = time.monotonic() + 400
    steps = []
    while time.monotonic() < deadline:
        steps = [r["step"] for r in _steps(run) if r["kind"] == "step"] if RunDir(run).metrics.exists() else []
        if 2 in steps or RunDir(run).finished.exists():
            break
        time.sleep(0.5)
    assert steps == [1, 2], f"the job did not reach step 2 in time (steps {steps})"
    now = run / "timing" / "trainer.0.0.now.json"  # trainer:0's current phase (observe/timing.py)

    def stalled():
        try:
            cur = json.loads(now.read_text())
        except (OSError, ValueError):  # not yet written, or being replaced
            return False
        return (cur.get("phase"), cur.get("step")) == ("start", 3)

    while not stalled() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stalled(), f"trainer:0 never showed its stall at step 3: {now.read_text() if now.exists() else 'no file'}"
    snap = _watch(run, "--once", env=env)
    assert snap.returncode == 0, snap.stderr
    view = snap.stdout
    assert re.search(r"job \d+ RUNNING \((sacct|squeue|sacct\+squeue)\): trainer=RUNNING", view), view
    # key metrics of the steps done so far: step time, reverse KL, reward, mismatch
    assert re.search(r"^\s+2\s+\d+\.\d\d\s+\d\.\d{4}\s+\d\.\d{3}\s+\d\.\d{5}", view, re.M), view
    # a phase per role (the trainer's two ranks), and the stalled trainer rank seen in its step
    for role in ROLES:
        ranks = 2 if role == "trainer" else 1
        assert re.search(rf"^{re.escape(role)}\s+{ranks}\s+\w+@[23] x\d", view, re.M), (role, view)
    # trainer:0 held in its step's start by the stall
    assert re.search(r"^trainer\s+2\s+(\w+@[23] x1\s+)?start@3 x1", view, re.M), view
    # the slowest rank of each role, for each finished step
    assert "slowest rank per role" in view
    for role in ROLES:
        assert re.search(rf"^(step [12] +| +){re.escape(role)}\s+{re.escape(role)}:\d\s+\d+\.\d\d \(", view, re.M), \
            (role, view)
    RunDir(run).stall_release.touch()  # the snapshot is taken: the stall has served (hpc_rl/runtime/faults.py)
    follow = _watch(run, "--poll", "1", env=env, timeout=600)  # to the end
    assert follow.returncode == 0, follow.stdout[-3000:] + follow.stderr[-3000:]
    final = follow.stdout
    assert re.search(r"job \d+ COMPLETED", final) and "2/2 ranks succeeded" in final
    assert "slowest rank per role" in final[final.rindex("summary:"):]  # the run's summary follows
    last_view = final[final.rindex(f"{run}: "):]
    assert re.search(r"^\s+4\s+\d+\.\d\d", last_view, re.M), last_view
    for role in ROLES:
        ranks = 2 if role == "trainer" else 1
        assert re.search(rf"^{re.escape(role)}\s+{ranks}\s+done x{ranks}", last_view, re.M), (role, last_view)


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_mopd_as_a_het_job_with_fsdp_over_two_trainer_nodes_watched_live(local_slurm, tmp_path):
    """Also issue 29's attack test: while the job runs, a process that is not one of its ranks
    (tests/neighbour.py) reaches its store without the job's secret and forges (a) a pickle
    that would create a file, under the refit keys the ranks wait on, (b) abort verdicts,
    (c) rank registrations. The run must finish as usual, nothing unpickled, every forged
    value a rank read counted in summary.json. And the live view of the running job
    (`python -m hpc_rl.slurm.watch`): trainer:0 stalls at the start of step 3 (a real
    straggler of the real job) until the test has watched it."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    args = [sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_mopd", "cluster=local_slurm", "launcher=slurm",
            "launcher.wait=true", "trainer.nodes=2", "run.max_steps=4", f"run.dir={run}", *SMALL,
            f"ft.inject_failure=trainer:0:stall{STALL_S}@3"]
    forged = {}

    def neighbour_attacks():
        try:
            # 6 ranks; the refit group: 2 trainer ranks + the engine's one worker; 4 refits
            forged.update(neighbour.attack(run, proc, marker, world=6, refit_world=3, refits=4))
        except AssertionError as exc:
            forged["error"] = str(exc)

    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(args, stdout=fo, stderr=fe, text=True)
        attacker = threading.Thread(target=neighbour_attacks, daemon=True)
        attacker.start()
        try:
            _watch_the_stalled_job(run, local_slurm.env())
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                _watch(run, "--cancel", env=local_slurm.env())
                proc.kill()
        attacker.join(timeout=120)
    assert proc.returncode == 0, out.read_text()[-3000:] + err.read_text()[-3000:]
    assert "error" not in forged, forged
    # (b) no rank acted on a forged verdict: the first attempt ran to the end (a verdict
    # accepted aborts it, and the batch shell's requeue would hide that behind rc 0)
    errors = sorted(p.name for p in (run / "errors").glob("*")) if (run / "errors").exists() else []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 0 and not errors, (errors, summary.get("restarts"))
    job = job_from_run_dir(run)
    roles = [r["role"] for r in job.results()]
    assert roles == ["trainer", "trainer", "generator", "teacher/add", "teacher/mul", "env"]
    assert all(r["steps"] == 4 for r in job.results())
    _check_rollouts(run, 4, {"add_agent": "add", "mul_agent": "mul"})
    assert "student" in (run / "logs" / "trainer.0.out").read_text() and "fsdp2 over 2 ranks" in (run / "logs" / "trainer.0.out").read_text()
    # the neighbour found the job's real store from public facts
    host, port = forged["address"]
    assert f"rendezvous at {host}:{port} " in (run / "logs" / "trainer.0.out").read_text()
    # (a) never unpickled; (c) only the job's ranks joined (the roles above, all from restart 0)
    assert len(forged["ready_planted"]) == 3 * 4 and not marker.exists()
    kinds, by_role = summary["auth_rejected_by_kind"], summary["auth_rejected_by_role"]
    # every rank's heartbeat read the forged verdict at least once; the generator read the
    # forged readiness of every refit while the trainers trained
    assert kinds.get("hb/*/abort", 0) >= 6 and kinds.get("refit/*/ready/*/*", 0) >= 4, summary
    assert all(by_role[r] >= 1 for r in ROLES), by_role
    if len(forged["rdzv_landed"]) >= 2:  # (c) landed before those ranks announced themselves: the ranks
        # already waiting (told by the bumped counter to look) read them until the owners overwrote them
        assert kinds.get("rdzv/*/*", 0) >= 1, summary
    assert summary["auth_rejected"] == sum(kinds.values()) == sum(by_role.values())
    assert "auth_reports_missing" not in summary
    assert "rejected without the job's MAC" in out.read_text()  # the launcher's summary says so
    # tiny_mopd's engine is tp=1 on CPU: its one worker runs in the generator rank (vLLM's uni
    # executor, refit/vllm_engine.py), so the worker's signing is the rank's own and no worker
    # process reports apart (the TP-2 engine of test_tensor_parallel_rl's het job checks those)
    report = json.loads((run / "auth" / "generator.0.0.json").read_text())
    assert "'distributed_executor_backend': 'uni'" in (run / "logs" / "generator.0.out").read_text()
    assert report["engine_workers"]["ops"] == {} and report["ops"].get("signs", 0) > 0, report
    print(f"neighbour: {forged}; rejected {summary['auth_rejected']}: {kinds}")


@pytest.mark.slurm
@pytest.mark.slow
def test_scaled_down_ultra_mopd_starts_every_role_and_completes_two_steps(local_slurm, tmp_path):
    # The recipe's models are the trained tiny Nemotron-H set (minutes to build on a fresh
    # machine); random checkpoints of the same shape and tokenizer run the same code paths
    # (Nemotron-H trainer, teachers, engine and refit) in seconds.
    from hpc_rl.models.assets import NemotronHModelSpec, save_untrained

    ckpt = {name: save_untrained(tmp_path / name, NemotronHModelSpec(), seed=seed)
            for seed, name in enumerate(("student", "teacher_add", "teacher_mul"))}
    teachers = {"general": "teacher_add", "rlhf": "teacher_add", "ifbench": "teacher_add",
                "reasoning": "teacher_mul", "swe": "teacher_mul"}
    run = tmp_path / "run"
    proc = _launch("+recipe=ultra_mopd_tiny", "launcher.wait=true", f"run.dir={run}", f"model.path={ckpt['student']}",
                   *(f"teachers.{alias}.checkpoint={ckpt[name]}" for alias, name in teachers.items()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the flagship's family end to end: the trainer ran NemotronHForCausalLM, the engine took its refits
    assert "(NemotronHForCausalLM) loaded" in (run / "logs" / "trainer.0.out").read_text()
    job = job_from_run_dir(run)
    assert [r["role"] for r in job.results()] == ["trainer", "generator", "teacher/general", "teacher/reasoning", "env"]
    rows = [r for r in _steps(run) if r["kind"] == "step"]
    assert [r["step"] for r in rows] == [1, 2]
    # add_agent falls to the default alias (general), mul_agent is listed under reasoning
    _check_rollouts(run, 2, {"add_agent": "general", "mul_agent": "reasoning"})
    general_log = (run / "logs" / "teacher-general.0.out").read_text()
    assert "aliases ['general', 'rlhf', 'ifbench']" in general_log
    assert "aliases ['reasoning', 'swe']" in (run / "logs" / "teacher-reasoning.0.out").read_text()
    assert "reverse KL to teacher" in proc.stdout
