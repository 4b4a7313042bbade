"""The status table of a pipeline: the DAG (stages by depth, each with its upstream stages),
each stage's state, job id, nodes, progress and ETA (the stage's progress.json), and why a
stage failed or was cancelled."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from hpc_rl.observe.progress import progress_line, read_progress

from .state import DONE, PipelineRecord


def depths(rec: PipelineRecord) -> Dict[str, int]:
    out: Dict[str, int] = {}

    def depth(name: str, seen: tuple = ()) -> int:
        if name not in out:
            ups = [u for u in rec.stages[name].after if u in rec.stages and u not in seen]
            out[name] = 1 + max((depth(u, seen + (name,)) for u in ups), default=-1)
        return out[name]

    for name in rec.stages:
        depth(name)
    return out


def render_status(rec: PipelineRecord) -> str:
    d = depths(rec)
    names = sorted(rec.stages, key=lambda n: (d[n], list(rec.stages).index(n)))
    done = sum(1 for s in rec.stages.values() if s.state == DONE)
    lines = [f"pipeline {rec.name}: {done}/{len(rec.stages)} stages finished  ({rec.dir})"]
    levels: List[List[str]] = []
    for n in names:
        while len(levels) <= d[n]:
            levels.append([])
        levels[d[n]].append(n)
    lines.append("  DAG: " + "  ->  ".join("{" + ", ".join(lv) + "}" if len(lv) > 1 else lv[0] for lv in levels))
    lines.append(f"  {'stage':<22}{'state':<15}{'job':<9}{'nodes':>5}  {'after':<26}progress")
    for n in names:
        s = rec.stages[n]
        label = ("  " * d[n] + ("└ " if d[n] else "") + n)[:22]
        prog = read_progress(Path(s.run_dir)) if s.job_id else None
        progress = progress_line(prog) if prog else ("-" if s.state != DONE else "done")
        after = ", ".join(s.after) or "-"
        lines.append(f"  {label:<22}{s.state:<15}{s.job_id or '-':<9}{s.nodes:>5}  {after[:25]:<26}{progress}")
        if s.reason and s.state != DONE:
            lines.append(f"  {'':<22}  why: {s.reason}")
        if len(s.jobs) > 1:
            lines.append(f"  {'':<22}  jobs: {' -> '.join(s.jobs)} (resubmitted)")
    if rec.cancelled:
        lines.append("  cancelled by `python -m hpc_rl.pipeline cancel`")
    return "\n".join(lines)
