"""The held-out validation as people see it: the live view of `python -m hpc_rl.slurm.watch`
(observe/live.py) and the plots (observe/plots.py), from metrics.jsonl's "eval" records."""

from __future__ import annotations

import json

from hpc_rl.observe import live
from hpc_rl.observe.metrics import series
from hpc_rl.observe.plots import draw_validation, write_plots
from hpc_rl.rundir import RunDir

PNG = b"\x89PNG"


def _record(step: int, tag: str, acc: float) -> dict:
    return {"kind": "eval", "tag": tag, "step": step, "prompts": 16, "accuracy": {"add_agent": acc, "mul_agent": acc / 2},
            "accuracy_mean": 0.75 * acc, "k": 4, "pass_at_k": {"add_agent": 1.0, "mul_agent": 0.5},
            "pass_at_k_mean": 0.75, "mean_at_k": {"add_agent": 0.5, "mul_agent": 0.25}, "mean_at_k_mean": 0.375,
            "reverse_kl": {"add": 0.5, "mean": 0.4}}


def test_the_live_view_shows_the_latest_validation_and_the_best_so_far():
    evals = [_record(0, "start", 0.4), _record(10, "step", 0.8), _record(20, "step", 0.6)]
    lines = live.validation_section(evals)
    assert lines[0] == ("validation step (step 20, 16 held-out prompts): accuracy add_agent 0.600, mul_agent 0.300 "
                        "(mean 0.450); pass@4 add_agent 1.000, mul_agent 0.500; mean@4 add_agent 0.500, "
                        "mul_agent 0.250; reverse KL mean 0.4000")
    assert lines[1] == "validation best accuracy mean 0.600 at step 10 (3 validations)"
    assert live.validation_section([]) == []


def test_the_validation_panel_draws_accuracy_pass_and_mean_at_k(tmp_path):
    from matplotlib.figure import Figure

    records = [_record(0, "start", 0.4), {"kind": "step", "step": 1, "loss": 1.0}, _record(1, "end", 0.8)]
    s = series(records)
    assert {"val/accuracy_mean", "val/pass_at_k/add_agent", "val/mean_at_k_mean", "val/k"} <= set(s)
    ax = Figure().add_subplot()
    assert draw_validation(ax, s) and "pass@4" in ax.get_title()
    assert len(ax.lines) == 2 * 3 + 1  # per task: accuracy, pass@k, mean@k; and the mean
    rd = RunDir(tmp_path)
    rd.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    paths = write_plots(tmp_path)
    assert (tmp_path / "plots" / "validation.png") in paths
    assert (tmp_path / "plots" / "validation.png").read_bytes().startswith(PNG)
