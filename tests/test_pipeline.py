"""Pipelines (hpc_rl/pipeline): the DAG from the checkpoint flow, every stage checked at once,
`${stage:NAME}` resolution, states and reasons in pipeline.json, the status table, and the
shipped ultra pipeline's scripts and plan (golden files). No Slurm job runs here: the
end-to-end runs are in tests/test_pipeline_slurm.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import golden
from hpc_rl.config.errors import ConfigError
from hpc_rl.pipeline.compose import check_all, export_path
from hpc_rl.pipeline.report import render_status
from hpc_rl.pipeline.spec import PipelineSpec, Stage, load_spec, split_args
from hpc_rl.pipeline.state import PipelineRecord, StageRecord, archive_attempt, refresh
from hpc_rl.pipeline.submit import new_record
from import_checks import imported_modules


def _dry(*args):
    return split_args(["launcher=dry_run", *args])


def test_the_dag_comes_from_the_stage_references():
    spec = load_spec("tiny_pipeline")
    assert spec.order() == ["rlvr", "teacher_add", "teacher_mul", "mopd"]
    assert spec.stages["mopd"].deps() == ["rlvr", "teacher_add", "teacher_mul"]
    assert spec.dependents("teacher_add") == ["mopd"]
    assert spec.dependents("rlvr") == ["teacher_add", "teacher_mul", "mopd"]
    assert spec.check() == []


def test_cycles_and_unknown_stages_are_refused():
    spec = PipelineSpec("p", "d", {
        "a": Stage("a", "tiny_grpo", ["model.path=${stage:b}"]),
        "b": Stage("b", "tiny_grpo", ["model.path=${stage:a}"]),
        "c": Stage("c", "tiny_grpo", ["model.path=${stage:nope}"]),
    })
    problems = spec.check()
    assert [v.key for v in problems] == ["stages.c"] and "names no stage" in problems[0].problem
    del spec.stages["c"]
    assert "cycle" in spec.check()[0].problem


def test_command_line_splits_into_pipeline_stage_and_common_overrides():
    cli = split_args(["+pipeline=tiny_pipeline", "pipeline.dir=/x", "stages.mopd.run.max_steps=3", "cluster=local_slurm"])
    assert (cli.pipeline, cli.dir, cli.common, cli.per_stage) == ("tiny_pipeline", "/x", ["cluster=local_slurm"],
                                                                   {"mopd": ["run.max_steps=3"]})


def test_tiny_pipeline_composes_every_stage_with_its_inputs(tmp_path):
    spec = load_spec("tiny_pipeline")
    checks = {c.name: c for c in check_all(spec, _dry(), tmp_path)}
    mopd = checks["mopd"]
    assert mopd.inputs == {"model.path": "rlvr", "teachers.add.checkpoint": "teacher_add", "teachers.mul.checkpoint": "teacher_mul"}
    # the config it runs with reads the producers' exports; two teachers from two stages stay two groups
    assert mopd.cfg.teachers["add"].checkpoint == str(export_path(tmp_path, "teacher_add"))
    assert [r.name for r in mopd.plan.roles] == ["trainer", "generator", "teacher/add", "teacher/mul", "env"]
    assert checks["teacher_mul"].cfg.data.tasks == ["multiplication_1digit"]
    assert checks["rlvr"].cfg.run.dir == str(tmp_path / "rlvr")
    # before the producers ran, checking reads the shape their exports will have: their own input model
    assert mopd.checked.teachers["add"].checkpoint == checks["rlvr"].checked.model.path == "tiny:student"


def test_every_violation_of_every_stage_is_listed_at_once(tmp_path):
    spec = load_spec("tiny_pipeline")
    cli = _dry("stages.teacher_add.trainer.nodes=0", "stages.mopd.algo.name=nope", "stages.ghost.run.seed=1",
               "stages.rlvr.checkpoint.export_final=false")
    with pytest.raises(ConfigError) as err:
        check_all(spec, cli, tmp_path)
    keys = [v.key for v in err.value.violations]
    assert keys == ["stages.ghost"]  # a stage that does not exist is refused before anything composes
    with pytest.raises(ConfigError) as err:
        check_all(spec, _dry("stages.teacher_add.trainer.nodes=0", "stages.mopd.algo.name=nope",
                             "stages.rlvr.checkpoint.export_final=false"), tmp_path)
    keys = [v.key for v in err.value.violations]
    assert "stages.mopd.algo.name" in keys
    assert any(k.startswith("stages.teacher_add.trainer.nodes") for k in keys), keys
    # rlvr exports nothing, so its consumers that compose are refused, naming the fix
    refused = [v for v in err.value.violations if "exports no checkpoint" in v.problem]
    assert {v.key for v in refused} == {"stages.teacher_mul.model.path"}
    assert all("stages.rlvr.checkpoint.export_final=true" in v.fix for v in refused)


def test_run_dir_and_dependency_belong_to_the_pipeline(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_all(load_spec("tiny_pipeline"), _dry("run.dir=/x", "stages.mopd.launcher.slurm.dependency=afterok:1"), tmp_path)
    assert [v.key for v in err.value.violations] == ["run.dir", "launcher.slurm.dependency"]


def test_a_local_launcher_is_refused_for_a_pipeline(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_all(load_spec("tiny_pipeline"), split_args(["launcher=local"]), tmp_path, launcher_checks=False)
    assert {v.key for v in err.value.violations} == {f"stages.{s}.launcher.name" for s in ("rlvr", "teacher_add", "teacher_mul", "mopd")}


def test_consumers_are_checked_against_the_producers_input_before_it_ran(tmp_path, monkeypatch):
    """launcher=slurm's checks (models, data) on every stage; the cluster query is skipped
    (faked: this test needs no Slurm). A missing input model of rlvr is reported for rlvr and,
    through ${stage:rlvr}, for every stage that will read rlvr's export."""
    from hpc_rl.launchers.base import LAUNCHERS

    monkeypatch.setattr(LAUNCHERS["slurm"], "preflight", lambda cfg, plan: None)
    with pytest.raises(ConfigError) as err:
        check_all(load_spec("tiny_pipeline"), split_args([f"stages.rlvr.model.path={tmp_path}/missing"]), tmp_path)
    keys = sorted(v.key for v in err.value.violations)
    # the teachers' exports will have the shape of their input, rlvr's export: missing too
    assert keys == ["stages.mopd.model.path", "stages.mopd.teachers.add.checkpoint", "stages.mopd.teachers.mul.checkpoint",
                    "stages.rlvr.model.path", "stages.teacher_add.model.path", "stages.teacher_mul.model.path"]
    # once the producer has finished, its export is what is checked
    import shutil

    from hpc_rl.rl.inputs import resolve_model_ref

    shutil.copytree(resolve_model_ref("tiny:student"), export_path(tmp_path, "rlvr"))
    (tmp_path / "rlvr" / "FINISHED").write_text("")
    checks = {c.name: c for c in check_all(load_spec("tiny_pipeline"), split_args([f"stages.rlvr.model.path={tmp_path}/missing",
                                                                                   "stages.rlvr.launcher=dry_run"]), tmp_path)}
    assert checks["mopd"].checked.model.path == str(export_path(tmp_path, "rlvr"))


def _record(tmp_path) -> PipelineRecord:
    spec = load_spec("tiny_pipeline")
    return new_record(spec, check_all(spec, _dry(), tmp_path), tmp_path, ["+pipeline=tiny_pipeline"])


def test_a_failed_stage_names_its_error_and_cancels_its_dependents_with_the_reason(tmp_path):
    rec = _record(tmp_path)
    for name, jid in (("rlvr", "990001"), ("teacher_add", "990002"), ("teacher_mul", "990003"), ("mopd", "990004")):
        rec.stages[name].job_id = jid
        (tmp_path / name).mkdir(exist_ok=True)
    (tmp_path / "rlvr" / "FINISHED").write_text("")
    (tmp_path / "teacher_mul" / "FINISHED").write_text("")
    (tmp_path / "teacher_add" / "job_exit.json").write_text(json.dumps(
        {"job_id": "990002", "restart": 0, "exit_code": 1, "failed_role": "trainer", "requeued": False,
         "detail": "retry budget exhausted after 0 restarts (ft.max_restarts=0): role trainer failed."}))
    refresh(rec)  # job ids Slurm never knew: the run directories and the DAG decide
    states = {n: s.state for n, s in rec.stages.items()}
    assert states == {"rlvr": "COMPLETED", "teacher_add": "FAILED", "teacher_mul": "COMPLETED", "mopd": "CANCELLED"}
    assert "retry budget exhausted" in rec.stages["teacher_add"].reason
    assert rec.stages["mopd"].reason.startswith("upstream stage teacher_add failed: retry budget exhausted")
    text = render_status(rec)
    assert "DAG: rlvr  ->  {teacher_add, teacher_mul}  ->  mopd" in text
    assert "why: upstream stage teacher_add failed" in text and text.count("COMPLETED") == 2
    rec.save()
    assert PipelineRecord.load(tmp_path).stages["mopd"].job_id == "990004"


def test_fake_sacct_a_finished_job_of_an_earlier_cluster_with_a_stages_id_is_not_the_stage(tmp_path, monkeypatch):
    """Seen in the suite on a machine whose accounting database outlived its controller: the
    fresh controller gave out ids 43-52 again and sacct listed the old jobs, COMPLETED, while
    this pipeline's stages were queued; pipeline.submit.wait returned at once. Faked (sacct's
    and squeue's answers): the shared test cluster cannot reset its ids inside a test."""
    from hpc_rl.pipeline import state
    from hpc_rl.slurm import states as slurm_states

    rec = _record(tmp_path)
    now = "2026-12-03T17:00:05"
    for name, jid in (("rlvr", "43"), ("teacher_add", "46"), ("teacher_mul", "49"), ("mopd", "52")):
        rec.stages[name].job_id = jid
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "job.json").write_text(json.dumps(
            {"job_id": jid, "job_name": f"hpc_rl-{name}", "submit_time": now, "submitted_after": 0}))
    old = "".join(f"{j}+0|hpc_rl-tiny_grpo|COMPLETED|0:0|2026-12-02T09:10:00|2026-12-02T09:11:00|None\n" for j in ("43", "46", "49", "52"))
    queue = f"43+0|RUNNING|hpc_rl-rlvr|{now}\n" + "".join(
        f"{j}+0|PENDING|hpc_rl-{n}|{now}\n" for j, n in (("46", "teacher_add"), ("49", "teacher_mul"), ("52", "mopd")))
    monkeypatch.setattr(state, "sacct_records", lambda ids: slurm_states.parse_sacct_instances(old))
    monkeypatch.setattr(state, "squeue_records", lambda ids: {j: r for j, r in slurm_states.parse_squeue(queue).items() if j in ids})
    refresh(rec)
    assert {n: s.state for n, s in rec.stages.items()} == {
        "rlvr": "RUNNING", "teacher_add": "PENDING", "teacher_mul": "PENDING", "mopd": "PENDING"}
    # a job.json of another submission says nothing of this one: the old record is taken as is
    assert state.stage_identity(tmp_path / "rlvr", "44") is None


def test_a_new_attempt_does_not_read_the_failed_attempts_verdicts(tmp_path):
    run = tmp_path / "teacher_add"
    (run / "errors").mkdir(parents=True)
    (run / "errors" / "trainer.0.0.txt").write_text("trainer:0: killed")
    (run / "job_exit.json").write_text("{}")
    (run / "stopped.0.json").write_text("{}")
    (run / "checkpoints").mkdir()
    dest = archive_attempt(run, "990002")
    assert sorted(p.name for p in dest.iterdir()) == ["errors", "job_exit.json", "stopped.0.json"]
    assert sorted(p.name for p in run.iterdir()) == ["attempts", "checkpoints"]


def test_status_command_prints_the_dag(tmp_path):
    rec = _record(tmp_path)
    rec.stages["rlvr"] = StageRecord(**{**rec.stages["rlvr"].__dict__, "job_id": "990001"})
    rec.save()
    out = subprocess.run([sys.executable, "-m", "hpc_rl.pipeline", "status", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name in ("rlvr", "teacher_add", "teacher_mul", "mopd"):
        assert name in out.stdout
    assert "NOT_SUBMITTED" in out.stdout


def test_ultra_pipeline_validates_on_gb200_and_its_plan_and_scripts_match_golden():
    files = golden.render_pipeline(*golden.PIPELINE_CASES[0])
    for path, text in files.items():
        assert path.exists(), f"missing {path}: run `make golden`"
        assert text == path.read_text(), f"{path} is stale: review the diff, then `make golden`"
        if path.suffix in (".sbatch", ".sh"):
            subprocess.run(["bash", "-n", str(path)], check=True)
    plan = json.loads(files[golden.pipeline_plan_path("ultra", "gb200_nvl72")])
    nodes = {name: s["nodes"] for name, s in plan["stages"].items()}
    # the guide's shapes (recipes/pipeline/ultra.yaml cites them); SWE has one env node more
    assert nodes == {"rlvr_phase1": 256, "rlvr_phase2": 256, "teacher_ifbench": 80, "teacher_rlhf": 80,
                     "teacher_reasoning": 128, "teacher_swe": 129, "mopd": 224}
    assert plan["stages"]["teacher_swe"]["roles"]["trainer"]["cp"] == 32
    assert plan["stages"]["mopd"]["after"] == ["rlvr_phase2", "teacher_rlhf", "teacher_ifbench", "teacher_reasoning", "teacher_swe"]
    submit = files[golden.SBATCH_DIR / "ultra_pipeline" / "submit.sh"]
    assert 'mopd=$(submit mopd "$rlvr_phase2" "$teacher_rlhf" "$teacher_ifbench" "$teacher_reasoning" "$teacher_swe")' in submit
    assert "model.path=/lustre/ultra_pipeline/rlvr_phase2/final_hf" in files[golden.SBATCH_DIR / "ultra_pipeline" / "mopd.sbatch"]


def test_launch_plans_the_ultra_pipeline_listing_every_stage():
    out = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+pipeline=ultra"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "7 stages checked" in out.stdout and "nothing submitted" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+pipeline=ultra", "stages.mopd.trainer.parallel.tp=3",
                          "stages.teacher_swe.generator.nodes=63"], capture_output=True, text=True)
    assert bad.returncode == 2 and "nothing was submitted" in bad.stderr
    assert "stages.mopd.trainer" in bad.stderr and "stages.teacher_swe.generator" in bad.stderr


def test_no_pipeline_module_imports_the_cli():
    """launch.py hands +pipeline= to hpc_rl.pipeline; an import back (even inside a function) is a circle."""
    from pathlib import Path

    import hpc_rl.pipeline

    for path in Path(hpc_rl.pipeline.__file__).parent.glob("*.py"):
        assert "hpc_rl.launch" not in imported_modules(path), f"{path.name} imports hpc_rl.launch"
