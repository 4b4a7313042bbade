"""Experiment loggers, metric names, plots and secrets (issue #18).

The slow half runs one real tiny_mopd (local launcher, 2 steps, every logger on, secrets
planted in the environment) and reads each logger's own files back with its own reader:
TensorBoard's EventAccumulator, the W&B offline run's transaction log (decoded with W&B's
protobufs), MLflow's client on its file store. Each must hold exactly the names, steps and
values that metrics.jsonl gives under observe/metrics.py's naming.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Dict, Tuple

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.observe import loggers as obs_loggers
from hpc_rl.observe.loggers import missing_packages, names, open_sink
from hpc_rl.observe.metrics import flatten, series
from hpc_rl.rl.records import MetricsLog

from shared_runs import EVERY_LOGGER, LOGGER_SECRETS as SECRETS  # the shared run's

PNG = b"\x89PNG\r\n\x1a\n"

Points = Dict[Tuple[str, int], float]


# -- names ------------------------------------------------------------------------------------


def test_a_step_record_flattens_to_slash_names_on_its_step():
    rec = {"kind": "step", "step": 7, "time": 1.7e9, "samples": 64, "loss": 0.25, "token_mult_prob_error": 1.0004,
           "reverse_kl": {"add": 0.5, "mul": 1.5, "mean": 1.0}, "accuracy": {"add_agent": 0.75},
           "timing": {"generate_s": 1.5, "refit_s": 0.1}, "optimizer_steps": 2, "grad_norm": float("nan"),
           "lr": None, "note": "text", "lengths": [1, 2]}
    step, flat = flatten(rec)
    assert step == 7
    assert flat == {"samples": 64.0, "loss": 0.25, "token_mult_prob_error": 1.0004, "reverse_kl/add": 0.5,
                    "reverse_kl/mul": 1.5, "reverse_kl/mean": 1.0, "accuracy/add_agent": 0.75,
                    "timing/generate_s": 1.5, "timing/refit_s": 0.1, "optimizer_steps": 2.0}


def test_a_validation_record_is_prefixed_val_and_names_are_made_safe():
    rec = {"kind": "eval", "tag": "end", "step": 3, "time": 1.7e9, "accuracy": {"add_agent": 0.5},
           "reverse_kl": {}, "teacher_accuracy": {"swe pivot*": 1.0}, "prompts": 16}
    # metrics.jsonl keeps "kind": "eval"; every logger and plot names the validation's metrics val/...
    assert flatten(rec) == (3, {"val/accuracy/add_agent": 0.5, "val/teacher_accuracy/swe pivot_": 1.0,
                                "val/prompts": 16.0})
    s = series([{"kind": "eval", "step": 0, "accuracy": {"a": 0.1}}, {"kind": "step", "step": 1, "loss": 2.0},
                {"kind": "eval", "step": 1, "accuracy": {"a": 0.3}}])
    assert s == {"val/accuracy/a": [(0, 0.1), (1, 0.3)], "loss": [(1, 2.0)]}
    assert flatten({"kind": "other", "step": 2, "x": 1.0}) == (2, {"other/x": 1.0})  # other kinds keep theirs


# -- config -------------------------------------------------------------------------------------


def _violations(*overrides):
    with pytest.raises(ConfigError) as err:
        load_config(["+recipe=tiny_mopd", *overrides])
    return err.value.violations


def test_logger_defaults_to_jsonl_and_takes_every_registered_name():
    assert load_config(["+recipe=tiny_mopd"]).logger == ["jsonl"]
    assert names() == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert load_config(["+recipe=tiny_mopd", EVERY_LOGGER]).logger == names()


def test_an_unknown_logger_is_refused_naming_logger_the_choices_and_a_fix():
    (v,) = _violations("logger=[jsonl,tensorbord]")
    assert v.key == "logger[1]" and v.value == "tensorbord"
    assert all(n in v.problem for n in names()) and "logger=[" in v.fix


def test_a_setting_of_a_logger_that_is_off_is_refused():
    (v,) = _violations("logging.wandb_project=mine")
    assert v.key == "logging.wandb_project" and "wandb" in v.fix
    load_config(["+recipe=tiny_mopd", "logger=[wandb]", "logging.wandb_project=mine"])


def test_credentials_in_the_mlflow_uri_are_refused_and_never_shown():
    found = _violations("logger=[mlflow]", "logging.mlflow_tracking_uri=https://me:hunter2@mlflow.example")
    assert [v.key for v in found] == ["logging.mlflow_tracking_uri"]
    assert all("hunter2" not in v.render() for v in found) and "MLFLOW_TRACKING_TOKEN" in found[0].fix


def test_a_logger_whose_package_is_missing_is_named_before_launch(monkeypatch):
    class Ghost:
        package = "hpc_rl_no_such_package"

    monkeypatch.setitem(obs_loggers.LOGGERS, "ghost", Ghost)
    assert missing_packages(["jsonl", "tensorboard", "ghost"]) == [("ghost", "hpc_rl_no_such_package")]


def test_a_rendered_sbatch_script_holds_no_environment_secret(monkeypatch):
    from hpc_rl.plan import build_plan
    from hpc_rl.slurm import sbatch

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(["+recipe=tiny_mopd", "cluster=local_slurm", "launcher=slurm", EVERY_LOGGER])
    script = sbatch.render(cfg, build_plan(cfg))
    assert not [k for k, v in SECRETS.items() if v in script]


# -- readers of each logger's own files ------------------------------------------------------


def expected_points(run: Path) -> Points:
    out: Points = {}
    for rec in MetricsLog(run).read():
        step, flat = flatten(rec)
        out.update({(name, step): v for name, v in flat.items()})
    return out


def tensorboard_points(tb_dir: Path) -> Points:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every event
    ea.Reload()
    return {(tag, e.step): e.value for tag in ea.Tags()["scalars"] for e in ea.Scalars(tag)}


def wandb_records(path: Path):
    """The records of a W&B transaction log (run-<id>.wandb). wandb 0.31 ships no Python
    reader: the file is a LevelDB-style log (a 7-byte ':W&B' header, 32 KiB blocks of
    chunks with a crc32/length/type header) of wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += block - pos % block
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"corrupt chunk at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start, MIDDLE/LAST extend
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec


def wandb_points(run: Path) -> Points:
    (log,) = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    out: Points = {}
    for rec in wandb_records(log):
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                name = item.key or "/".join(item.nested_key)
                if not name.startswith("_"):  # W&B's own (_step, _runtime, _timestamp)
                    out[(name, rec.history.step.num)] = float(json.loads(item.value_json))
    return out


def mlflow_points(run: Path, names_: set) -> Tuple[Points, str]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # see observe/loggers.py
    from mlflow.tracking import MlflowClient

    state = json.loads((run / "loggers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    out: Points = {}
    for name in names_:
        out.update({(m.key, m.step): m.value for m in client.get_metric_history(state["run_id"], name)})
    return out, client.get_run(state["run_id"]).info.status


def assert_same(got: Points, want: Points, rel: float) -> None:
    assert set(got) == set(want), f"missing {sorted(set(want) - set(got))[:8]}, extra {sorted(set(got) - set(want))[:8]}"
    bad = {k: (got[k], want[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=rel, abs_tol=rel)}
    assert not bad, f"{len(bad)} values differ, e.g. {list(bad.items())[:5]}"


# -- the sink in one process: resume continues each backend's run ------------------------------


def test_a_resumed_sink_continues_each_backends_run_and_tensorboard_drops_recomputed_steps(tmp_path):
    cfg = load_config(["+recipe=tiny_mopd", EVERY_LOGGER])
    log = logging.getLogger("test_observe")
    (tmp_path / "config.yaml").write_text("recipe: tiny_mopd\n")
    first = open_sink(cfg, tmp_path, MetricsLog(tmp_path), 0, log)
    first.append({"kind": "eval", "step": 0, "accuracy": {"add_agent": 0.5}})
    for s in (1, 2, 3):
        first.append({"kind": "step", "step": s, "loss": float(s)})
    first.close()
    ids = json.loads((tmp_path / "loggers.json").read_text())
    MetricsLog(tmp_path).truncate_after(2)  # what a resume from step 2's checkpoint does
    second = open_sink(cfg, tmp_path, MetricsLog(tmp_path), 2, log)
    second.append({"kind": "step", "step": 3, "loss": 30.0})
    second.close(finished=True)
    assert json.loads((tmp_path / "loggers.json").read_text()) == ids  # the same W&B and MLflow runs
    assert tensorboard_points(tmp_path / "tensorboard") == {("val/accuracy/add_agent", 0): 0.5, ("loss", 1): 1.0,
                                                            ("loss", 2): 2.0, ("loss", 3): 30.0}
    got, status = mlflow_points(tmp_path, {"loss"})
    assert status == "FINISHED"
    from mlflow.tracking import MlflowClient

    mlflow_run = ids["mlflow"]
    history = MlflowClient(mlflow_run["tracking_uri"]).get_metric_history(mlflow_run["run_id"], "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0)]  # append-only
    assert len(list(tmp_path.glob(f"wandb/offline-run-*-{ids['wandb']['id']}"))) == 2  # one per attempt, one id
    assert (tmp_path / "plots" / "overview.png").read_bytes().startswith(PNG)


# -- one real run with every logger ------------------------------------------------------------


@pytest.fixture(scope="module")
def observed_run(tiny_mopd_three_steps):
    """The suite's shared local tiny_mopd run (tests/shared_runs.py), every logger on."""
    run, proc = tiny_mopd_three_steps
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run, proc


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_of_metrics_jsonl(observed_run):
    run, _ = observed_run
    want = expected_points(run)
    assert {("reverse_kl/add", 1), ("val/accuracy/mul_agent", 3), ("timing/refit_s", 3)} <= set(want)
    assert_same(tensorboard_points(run / "tensorboard"), want, rel=1e-6)  # TensorBoard stores float32


@pytest.mark.slow
def test_the_wandb_offline_run_holds_the_metrics_of_metrics_jsonl(observed_run):
    run, _ = observed_run
    assert_same(wandb_points(run), expected_points(run), rel=1e-12)


@pytest.mark.slow
def test_the_mlflow_file_store_holds_the_metrics_of_metrics_jsonl(observed_run):
    run, _ = observed_run
    want = expected_points(run)
    got, status = mlflow_points(run, {name for name, _ in want})
    assert_same(got, want, rel=1e-12)
    assert status == "FINISHED"


@pytest.mark.slow
def test_no_planted_secret_reaches_any_file_of_the_run_or_its_output(observed_run):
    run, proc = observed_run
    files = [p for p in run.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(files) > 20 and any(p.suffix == ".wandb" for p in files)
    leaks = [(str(p.relative_to(run)), k) for p in files for k, v in SECRETS.items() if v.encode() in p.read_bytes()]
    leaks += [("launcher output", k) for k, v in SECRETS.items() if v in proc.stdout + proc.stderr]
    assert not leaks


@pytest.mark.slow
def test_plots_at_the_end_of_the_run_and_on_demand(observed_run, tmp_path):
    run, _ = observed_run
    stems = {"reverse_kl", "reward", "accuracy", "validation", "mult_prob_error", "phase_time", "refit", "overview"}
    assert {p.stem for p in (run / "plots").glob("*.png")} == stems  # the driver's, at the end
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.plot", str(run), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pngs = sorted(tmp_path.glob("*.png"))
    assert {p.stem for p in pngs} == stems and [str(p) for p in pngs] == sorted(proc.stdout.split())
    for p in pngs:
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, p


def test_the_logger_names_validation_knows_are_the_registered_backends():
    from hpc_rl.config.schema import LOGGER_NAMES
    from hpc_rl.observe.loggers import names

    assert names() == list(LOGGER_NAMES)
