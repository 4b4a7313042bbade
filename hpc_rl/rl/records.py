"""What a run leaves in its directory, written by trainer rank 0.

metrics.jsonl   one JSON object per step (and per evaluation, "kind": "eval")
rollouts.h5     one group per step (`step_000001`): token ids, masks, generation / teacher /
                student logprobs, advantages, rewards, agent names; plain h5py reads it
progress.json   step, phase and ETA, rewritten as the run moves (launchers display it)
summary.json    the end: reverse KL per teacher and accuracy per task, start vs end; after the
                final barrier, the job's rejected unauthenticated values (runtime/auth_stats.py)

A resumed run truncates metrics and rollouts after the step it resumed from, so each step
appears once whatever the number of restarts. Neither blocks a resume when a crash damaged
it: a line of metrics.jsonl that is not a whole record (the torn last line of a killed
writer) is dropped, and a rollouts.h5 that h5py cannot edit is moved aside, its readable
steps copied into a new one; the log names the file and what was dropped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from hpc_rl.observe.timing import slowest_ranks
from hpc_rl.durable import write_atomic
from hpc_rl.rundir import RunDir

log = logging.getLogger(__name__)


def _atomic_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _clean(v: Any) -> Any:
    """JSON-safe: nan/inf become null (json.dumps would write invalid JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class MetricsLog:
    def __init__(self, run_dir: Path):
        self.path = RunDir(run_dir).metrics

    def append(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(_clean(dict(record)), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> List[dict]:
        """Every whole record; a line that is not one is left out and named in the log."""
        return self._read()[0]

    def _read(self) -> Tuple[List[dict], int]:
        if not self.path.exists():
            return [], 0
        rows: List[dict] = []
        torn = 0
        # errors="replace": a torn multi-byte tail fails as JSON below, naming the file, not as UTF-8
        for n, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                torn += 1
                log.warning("%s: line %d is not a whole JSON record (torn when its writer was killed?); dropped: %r",
                            self.path, n, line[:200])
        return rows, torn

    def truncate_after(self, step: int) -> int:
        """Drop records of steps > step (recomputed after a resume) and lines that are not whole
        records; returns how many training steps were dropped."""
        rows, torn = self._read()
        keep = [r for r in rows if r.get("step", 0) <= step and not (r.get("kind") == "eval" and r.get("tag") == "end")]
        dropped_steps = sum(1 for r in rows if r.get("kind") == "step" and r.get("step", 0) > step)
        # rewritten when a line was torn too: the next append would otherwise extend the torn line
        if torn or len(keep) != len(rows):
            write_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))
        return dropped_steps


class RolloutStore:
    """Opened per write and closed at once, so a killed run leaves a readable file."""

    def __init__(self, run_dir: Path):
        self.path = RunDir(run_dir).rollouts

    @staticmethod
    def group_name(step: int) -> str:
        return f"step_{step:06d}"

    def write(self, step: int, arrays: Mapping[str, np.ndarray], strings: Mapping[str, List[str]],
              attrs: Optional[Mapping[str, Any]] = None) -> None:
        import h5py

        with h5py.File(self.path, "a") as f:
            name = self.group_name(step)
            if name in f:
                del f[name]
            g = f.create_group(name)
            for k, v in arrays.items():
                g.create_dataset(k, data=v, compression="gzip" if v.size > 4096 else None)
            for k, v in strings.items():
                g.create_dataset(k, data=np.array(v, dtype=object), dtype=h5py.string_dtype())
            for k, v in (attrs or {}).items():
                g.attrs[k] = v

    @staticmethod
    def _step_of(name: str) -> Optional[int]:
        return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None

    def truncate_after(self, step: int) -> int:
        """Drop the groups of steps > step; returns how many. A file h5py cannot open or edit
        is salvaged instead (`_salvage`): the records are no reason to block a resume."""
        import h5py

        if not self.path.exists():
            return 0
        try:
            with h5py.File(self.path, "a") as f:
                doomed = [n for n in f if (self._step_of(n) or 0) > step]
                for n in doomed:
                    del f[n]
            return len(doomed)
        except Exception as exc:  # h5py reports damage as OSError, KeyError, RuntimeError, ... by HDF5's layer
            self._salvage(step, exc)
            return 0

    def _salvage(self, step: int, exc: Exception) -> None:
        """Move the damaged file aside and copy the step groups up to `step` that still read
        into a new rollouts.h5; the log names both files, what was kept and what was lost."""
        import h5py

        aside = self.path.with_name(f"{self.path.name}.damaged.{int(time.time())}")
        try:
            os.replace(self.path, aside)
        except OSError as err:
            raise RuntimeError(f"{self.path} is damaged ({type(exc).__name__}: {exc}) and cannot be moved aside "
                               f"({err}): move or delete it, then resume") from exc
        kept: List[str] = []
        lost: List[str] = []
        try:
            with h5py.File(aside, "r") as src, h5py.File(self.path, "w") as dst:
                for n in sorted(src):
                    if (self._step_of(n) or 0) > step:
                        continue
                    try:
                        src.copy(src[n], dst, name=n)
                        kept.append(n)
                    except Exception:  # this group is damaged; the others may not be
                        lost.append(n)
                        if n in dst:
                            del dst[n]
        except Exception as err:  # not even readable: the run's rollouts start again at the next step
            lost.append(f"{'the rest' if kept else 'every step'}, unreadable ({type(err).__name__}: {err})")
        log.warning("%s is damaged (%s: %s): moved aside to %s; kept %d step groups up to step %d in a new %s; dropped %s",
                    self.path, type(exc).__name__, exc, aside.name, len(kept), step, self.path.name,
                    ", ".join(lost) or "nothing else")


class Progress:
    """progress.json for launchers and humans: step, phase, seconds per step, ETA."""

    def __init__(self, run_dir: Path, total_steps: int, first_step: int = 1):
        self.path = RunDir(run_dir).progress
        self.total, self.first = total_steps, first_step
        self.t0 = time.time()
        self.steps_t0: Optional[float] = None

    def update(self, step: int, phase: str, done_steps: Optional[int] = None) -> None:
        if self.steps_t0 is None and not phase.startswith("eval"):
            self.steps_t0 = time.time()  # the ETA counts step time only, not the opening evaluation
        done = step - self.first if done_steps is None else done_steps - (self.first - 1)
        per_step = (time.time() - self.steps_t0) / done if done > 0 and self.steps_t0 else None
        left = self.total - (step - 1) if done_steps is None else self.total - done_steps
        _atomic_json(self.path, {"step": step, "total_steps": self.total, "phase": phase, "time": time.time(),
                                 "elapsed_s": time.time() - self.t0, "s_per_step": per_step,
                                 "eta_s": per_step * max(left, 0) if per_step else None})


# ------------------------------------------------------------------------------------------
# summary


def summarize(run_dir: Path, extra: Optional[Mapping[str, Any]] = None) -> dict:
    """Start-vs-end comparison from metrics.jsonl (its eval records and its steps)."""
    rows = MetricsLog(run_dir).read()
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = {r["tag"]: r for r in rows if r.get("kind") == "eval"}
    out: Dict[str, Any] = {"steps": len(steps), "last_step": steps[-1]["step"] if steps else 0}
    for tag in ("start", "end"):
        if tag in evals:
            e = evals[tag]
            out[tag] = {k: e.get(k) for k in ("reverse_kl", "accuracy", "reward_mean", "step")}
            for k in ("accuracy_mean", "k", "pass_at_k", "pass_at_k_mean", "mean_at_k", "mean_at_k_mean", "prompts"):
                if e.get(k) is not None:  # the validation's other figures (rl/eval.py), when it has them
                    out[tag][k] = e[k]
    every = [r for r in rows if r.get("kind") == "eval" and r.get("accuracy_mean") is not None]
    if every:  # the best validation of the run (by greedy accuracy; checkpoint.best_metric ranks checkpoints)
        top = max(every, key=lambda r: r["accuracy_mean"])
        out["best_validation"] = {"step": top["step"], "tag": top["tag"], "accuracy_mean": top["accuracy_mean"]}
    if "start" in evals and evals["start"].get("teacher_accuracy"):
        out["teacher_accuracy"] = evals["start"]["teacher_accuracy"]
    if "start" in out and "end" in out:
        kl0, kl1 = out["start"].get("reverse_kl") or {}, out["end"].get("reverse_kl") or {}
        out["reverse_kl_reduction"] = {t: 1.0 - kl1[t] / kl0[t] for t in kl0 if t in kl1 and kl0[t]}
    if steps:
        errs = [s["token_mult_prob_error"] for s in steps if s.get("token_mult_prob_error") is not None]
        out["token_mult_prob_error_max"] = max(errs) if errs else None
        out["token_mult_prob_error_mean"] = sum(errs) / len(errs) if errs else None
        out["token_mult_prob_error_steps"] = len(errs)  # steps with samples of the trainer's own version
        drift = [s["policy_change_mult_prob_error"] for s in steps if s.get("policy_change_mult_prob_error") is not None]
        if drift:  # older weights vs the trainer's newer ones: not a mismatch (rl/step_record.py)
            out["policy_change_mult_prob_error_mean"] = sum(drift) / len(drift)
            out["policy_change_mult_prob_error_max"] = max(drift)
        rewards = [s.get("reward_mean") for s in steps if s.get("reward_mean") is not None]
        if rewards:
            k = max(1, min(5, len(rewards) // 4))
            out["reward_first_steps_mean"] = sum(rewards[:k]) / k
            out["reward_last_steps_mean"] = sum(rewards[-k:]) / k
        out["seconds_per_step_mean"] = sum(s["timing"]["step_s"] for s in steps) / len(steps)
    # the straggler of each role: its rank with the most busy (not waiting) time per step
    # (observe/timing.py); ranks that serve may not have written their last step yet
    slowest = slowest_ranks(run_dir)
    if slowest:
        out["slowest_ranks"] = slowest
    out.update(extra or {})
    _atomic_json(RunDir(run_dir).summary, _clean(out))
    return out


def update_summary(run_dir: Path, fields: Mapping[str, Any]) -> dict:
    """summary.json with `fields` added (what only the run's end knows: every rank's
    authentication report, runtime/auth_stats.py)."""
    path = RunDir(run_dir).summary
    out = dict(json.loads(path.read_text()), **fields)
    _atomic_json(path, _clean(out))
    return out


def render_summary(s: Mapping[str, Any]) -> str:
    lines = [f"summary: {s.get('steps', 0)} steps" + (f" of {s['model']}" if s.get("model") else "")]
    start, end = s.get("start") or {}, s.get("end") or {}
    kl0, kl1 = start.get("reverse_kl") or {}, end.get("reverse_kl") or {}
    if kl0 or kl1:
        lines.append(f"  {'reverse KL to teacher':<24}{'start':>10}{'end':>10}{'change':>10}")
        for t in sorted(set(kl0) | set(kl1), key=lambda x: (x == "mean", x)):
            a, b = kl0.get(t), kl1.get(t)
            ch = f"{(b - a) / a:+.0%}" if a and b is not None else ""
            lines.append(f"  {t:<24}{_f(a):>10}{_f(b):>10}{ch:>10}")
    acc0, acc1 = start.get("accuracy") or {}, end.get("accuracy") or {}
    teach = s.get("teacher_accuracy") or {}
    if acc0 or acc1:
        lines.append(f"  {'accuracy (greedy)':<24}{'start':>10}{'end':>10}{'teacher':>10}")
        for t in sorted(set(acc0) | set(acc1)):
            lines.append(f"  {t:<24}{_f(acc0.get(t)):>10}{_f(acc1.get(t)):>10}{_f(teach.get(t)):>10}")
    if s.get("reward_first_steps_mean") is not None:
        lines.append(f"  mean reward: first steps {s['reward_first_steps_mean']:.3f}, last steps {s['reward_last_steps_mean']:.3f}")
    if s.get("token_mult_prob_error_max") is not None:
        lines.append(f"  vLLM vs trainer, same weights (token_mult_prob_error): mean {s['token_mult_prob_error_mean']:.5f}, "
                     f"max {s['token_mult_prob_error_max']:.5f}"
                     + (f" over {s['token_mult_prob_error_steps']} steps" if s.get("token_mult_prob_error_steps") else ""))
    if s.get("policy_change_mult_prob_error_max") is not None:
        lines.append(f"  older weights vs trainer, the policy's change (policy_change_mult_prob_error): "
                     f"mean {s['policy_change_mult_prob_error_mean']:.5f}, max {s['policy_change_mult_prob_error_max']:.5f}")
    if s.get("auth_rejected"):  # values and messages without the job's MAC (docs/security.md)
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(s.get("auth_rejected_by_kind", {}).items()))
        lines.append(f"  rejected without the job's MAC: {s['auth_rejected']} store values or messages ({kinds})")
    if s.get("slowest_ranks"):  # busy: s per step not waiting for other ranks (observe/timing.py)
        lines.append(f"  {'slowest rank per role':<24}{'rank':<20}{'busy s':>8}{'median':>8}{'step s':>8}")
        for role, w in s["slowest_ranks"].items():
            lines.append(f"  {role:<24}{w['rank']:<20}{w['busy_s_mean']:>8.3f}{w['busy_s_mean_median']:>8.3f}"
                         f"{w['step_s_mean']:>8.3f}  of {w['ranks']} ranks; on {w['node']}")
    return "\n".join(lines)


def _f(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"
