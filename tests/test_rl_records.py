"""The run's records (metrics.jsonl, rollouts.h5, progress, summary) and the round-robin
split of a batch between ranks."""

from __future__ import annotations

import json

import h5py
import numpy as np

from hpc_rl.messaging.p2p import interleave, strided
from hpc_rl.observe.progress import progress_line, read_progress
from hpc_rl.rl.records import MetricsLog, Progress, RolloutStore, render_summary, summarize


def test_strided_and_interleave_are_inverse():
    n, parts = 11, 3
    pieces = [[f"x{i}" for i in strided(n, k, parts)] for k in range(parts)]
    assert interleave(pieces, n) == [f"x{i}" for i in range(n)]
    assert sorted(i for k in range(parts) for i in strided(n, k, parts)) == list(range(n))


def test_rollouts_one_group_per_step_readable_with_plain_h5py_and_truncated_on_resume(tmp_path):
    store = RolloutStore(tmp_path)
    for step in (1, 2, 3):
        store.write(step, {"input_ids": np.arange(6, dtype=np.int32).reshape(2, 3) + step,
                           "rewards": np.array([0.0, 1.0], dtype=np.float32)},
                    {"agents": ["add_agent", "mul_agent"]}, attrs={"weight_version": step - 1})
    with h5py.File(tmp_path / "rollouts.h5", "r") as f:
        assert sorted(f) == ["step_000001", "step_000002", "step_000003"]
        g = f["step_000002"]
        assert g["input_ids"][:].tolist() == [[2, 3, 4], [5, 6, 7]]
        assert [a.decode() for a in g["agents"][:]] == ["add_agent", "mul_agent"]
        assert g.attrs["weight_version"] == 1
    assert store.truncate_after(1) == 2
    with h5py.File(tmp_path / "rollouts.h5", "r") as f:
        assert sorted(f) == ["step_000001"]


def test_metrics_truncate_keeps_start_eval_and_earlier_steps(tmp_path):
    log = MetricsLog(tmp_path)
    log.append({"kind": "eval", "tag": "start", "step": 0, "reverse_kl": {"add": 1.0}})
    for s in (1, 2, 3):
        log.append({"kind": "step", "step": s, "x": float("nan")})
    log.append({"kind": "eval", "tag": "end", "step": 3})
    assert log.truncate_after(2) == 1  # one training step (3) to recompute; the end eval goes too
    rows = log.read()
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("step", 1), ("step", 2)]
    assert rows[1]["x"] is None  # nan is written as null: the file stays valid JSON


def test_summary_compares_start_and_end(tmp_path):
    log = MetricsLog(tmp_path)
    log.append({"kind": "eval", "tag": "start", "step": 0, "reverse_kl": {"add": 1.0, "mul": 2.0, "mean": 1.5},
                "accuracy": {"add_agent": 0.5}, "teacher_accuracy": {"add_agent": 1.0}})
    for s in range(1, 5):
        log.append({"kind": "step", "step": s, "token_mult_prob_error": 1.0 + s / 1e4, "reward_mean": s / 10,
                    "timing": {"step_s": 2.0}})
    log.append({"kind": "eval", "tag": "end", "step": 4, "reverse_kl": {"add": 0.4, "mul": 1.5, "mean": 0.95},
                "accuracy": {"add_agent": 0.75}})
    s = summarize(tmp_path)
    assert s["steps"] == 4 and abs(s["reverse_kl_reduction"]["add"] - 0.6) < 1e-9
    assert abs(s["reverse_kl_reduction"]["mul"] - 0.25) < 1e-9
    assert s["token_mult_prob_error_max"] == 1.0004 and s["teacher_accuracy"] == {"add_agent": 1.0}
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4
    text = render_summary(s)
    assert "add" in text and "-60%" in text and "0.750" in text and "1.000" in text


def test_progress_line_shows_step_phase_and_eta(tmp_path):
    p = Progress(tmp_path, total_steps=10)
    p.update(1, "eval start")
    p.update(1, "generate")
    p.steps_t0 -= 20.0  # 20 s spent on two finished steps: 10 s per step
    p.update(3, "train")
    got = read_progress(tmp_path)
    assert got["step"] == 3 and got["phase"] == "train" and abs(got["eta_s"] - 80.0) < 1.0
    line = progress_line(got)
    assert "step 3/10" in line and "train" in line and "ETA 1:2" in line
