"""The full tiny_pipeline on the local Slurm cluster, from one command: wall time from the
launch to the last stage's end, each stage's time, each teacher's greedy accuracy on its own
task against the RLVR student's, and the reverse KL to each teacher before and after MOPD.

Accuracies are compared on one set of prompts: the MOPD stage's evaluation scores the
student it starts from (the RLVR export) and each teacher on the same held-out prompts
(`start.accuracy`, `teacher_accuracy` of mopd/summary.json). Each stage's own summary
(its start and end on its own evaluation prompts) is recorded too.
Writes bench/results/pipeline.json.

    make cluster-up && python bench/pipeline.py [pipeline.dir=DIR] [more overrides]
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hpc_rl.pipeline.report import render_status  # noqa: E402
from hpc_rl.pipeline.submit import wait  # noqa: E402

OUT = ROOT / "bench" / "results" / "pipeline.json"
TEACHERS = {"teacher_add": ("add", "add_agent"), "teacher_mul": ("mul", "mul_agent")}


def _summary(run_dir: Path) -> dict:
    p = run_dir / "summary.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _stage_seconds(run_dir: Path) -> dict:
    """From the batch shell's first start line to FINISHED (both in the run directory)."""
    out = {}
    log = run_dir / "logs" / "batch.out"
    if log.exists():
        starts = [float(line.split(" started at ")[1].split(",")[0]) for line in log.read_text().splitlines()
                  if " started at " in line]
        if starts and (run_dir / "FINISHED").exists():
            out = {"started": starts[0], "finished": (run_dir / "FINISHED").stat().st_mtime}
            out["seconds"] = round(out["finished"] - out["started"], 1)
    return out


def main(argv) -> int:
    overrides = [a for a in argv if "=" in a]
    pdir = next((a.split("=", 1)[1] for a in overrides if a.startswith("pipeline.dir=")), None)
    if pdir is None:
        pdir = str(Path(tempfile.mkdtemp(prefix="hpc_rl_pipeline_")) / "tiny_pipeline")
        overrides.append(f"pipeline.dir={pdir}")
    pdir_p = Path(pdir)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+pipeline=tiny_pipeline", *overrides],
                          capture_output=True, text=True)
    print(proc.stdout, proc.stderr, sep="\n")
    if proc.returncode != 0:
        return proc.returncode
    rec = wait(pdir_p, timeout_s=3600, poll_s=5)
    wall = time.time() - t0
    print(render_status(rec))
    stages = {n: {"state": s.state, "job_id": s.job_id, "reason": s.reason, **_stage_seconds(Path(s.run_dir))}
              for n, s in rec.stages.items()}
    rlvr, mopd = _summary(pdir_p / "rlvr"), _summary(pdir_p / "mopd")
    teachers = {}
    for stage, (alias, agent) in TEACHERS.items():
        own = _summary(pdir_p / stage)
        student = (mopd.get("start") or {}).get("accuracy", {}).get(agent)
        teacher = (mopd.get("teacher_accuracy") or {}).get(agent)
        kl0 = (mopd.get("start") or {}).get("reverse_kl", {}).get(alias)
        kl1 = (mopd.get("end") or {}).get("reverse_kl", {}).get(alias)
        teachers[stage] = {
            "task": agent,
            "accuracy_teacher": teacher, "accuracy_rlvr_student": student,
            "teacher_beats_student": teacher is not None and student is not None and teacher > student,
            "own_stage_accuracy_start_end": [(own.get("start") or {}).get("accuracy", {}).get(agent),
                                             (own.get("end") or {}).get("accuracy", {}).get(agent)],
            "mopd_reverse_kl_start": kl0, "mopd_reverse_kl_end": kl1,
            "mopd_reverse_kl_cut": (1 - kl1 / kl0) if kl0 and kl1 is not None else None,
        }
    doc = {
        "what": "tiny_pipeline (rlvr GRPO -> two GRPO teachers, one task each, in parallel -> MOPD of both) on the local "
                "Slurm cluster from one command; accuracies are greedy, on MOPD's held-out prompts",
        "wall_s": round(wall, 1),
        "finished": all(s.state == "COMPLETED" for s in rec.stages.values()),
        "stages": stages,
        "teachers": teachers,
        "rlvr_accuracy_start_end": [(rlvr.get("start") or {}).get("accuracy"), (rlvr.get("end") or {}).get("accuracy")],
        "mopd_accuracy_start_end": [(mopd.get("start") or {}).get("accuracy"), (mopd.get("end") or {}).get("accuracy")],
        "overrides": overrides,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("wall_s", "finished", "teachers")}, indent=2))
    print(f"wrote {OUT}")
    return 0 if doc["finished"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
