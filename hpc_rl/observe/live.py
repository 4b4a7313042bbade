"""The live view of a run, from its directory alone (`python -m hpc_rl.slurm.watch RUN_DIR`).

Everything here is read from files the ranks write on the shared filesystem, so it works on
a login node, for local and Slurm launches alike, while the run goes and after it ended:

  progress.json          the driver's step, phase and ETA
  timing/*.now.json      what every rank is doing now, and since when (observe/timing.py)
  timing/*.jsonl         every rank's phase times per step: the slowest rank of each role
  metrics.jsonl          the driver's metrics per step (reverse KL, reward, mismatch, time)
  FINISHED, errors/, stopped.<restart>.json, job_exit.json   how a run without a Slurm
                         job handle (launcher=local, a hand-submitted script) stands

The job state of a `launcher=slurm` run (Slurm's view of each component) comes from the
caller (hpc_rl/slurm/watch.py), which owns the Slurm queries; this module never runs a
Slurm command.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .progress import progress_line, read_progress
from hpc_rl.rundir import RunDir

from .timing import (DONE, is_waiting, ordered_roles, rank_name, read_now, read_steps, role_order, slowest_of,
                     tail_lines)

DEFAULT_STEPS = 3  # steps shown in the metrics table and the slowest-rank blocks
RUNNING, COMPLETED, FAILED, STOPPED, STARTING = "RUNNING", "COMPLETED", "FAILED", "STOPPED", "STARTING"


# --------------------------------------------------------------------------- state from files
def latest_restart(run_dir: Path) -> int:
    return max((r.get("restart", 0) for r in read_now(run_dir)), default=0)


def file_state(run_dir: Path) -> Tuple[str, str]:
    """(state, detail) of a run from its files: what a run without a Slurm job handle has.
    FINISHED says complete; a batch shell's exit record or a rank's error report of the
    latest restart says failed; a stop for a requeue says stopped; else it runs (or has not
    reported yet). A launcher killed outright leaves no record: the ages in the view tell."""
    rd = RunDir(run_dir)
    if rd.finished.exists():
        return COMPLETED, ""
    try:
        rec = json.loads(rd.job_exit.read_text())
    except (OSError, ValueError):
        rec = None
    if rec is not None and not rec.get("requeued"):
        if int(rec.get("exit_code", 1)) == 0:
            return COMPLETED, ""
        return FAILED, f"{rec.get('failed_role') or 'a role'}: {rec.get('detail') or 'exit ' + str(rec.get('exit_code'))}"
    restart = latest_restart(run_dir)
    reports = sorted(rd.errors.glob(f"*.{restart}.txt")) if rd.errors.is_dir() else []
    for path in reports:  # the heartbeats' verdict first: it names the culprit, not its victims
        if path.name in (rd.dead_rank(restart).name, rd.fatal(restart).name):
            return FAILED, _first_line(path)
    if reports:
        return FAILED, _first_line(reports[0])
    if rd.stopped(restart).exists():
        return STOPPED, "saved and stopped for a requeue"
    if not rd.timing.is_dir():
        return STARTING, "no rank has reported yet"
    return RUNNING, ""


def _first_line(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return path.name
    return text.splitlines()[0] if text else path.name


# ------------------------------------------------------------------------------- sections
def _ago(t: Optional[float], now: float) -> str:
    return "-" if t is None else f"{max(now - float(t), 0.0):.1f}s"


def now_section(ranks: List[dict], now: float, order: List[str] = ()) -> List[str]:
    """Per role: how many ranks are in each phase, and the rank longest in its phase (at
    scale a role has hundreds of ranks: one line each would bury the straggler)."""
    if not ranks:
        return []
    lines = [f"{'now':<16}{'ranks':>5}  {'phase@step x ranks':<30}longest in its phase"]
    by: Dict[str, List[dict]] = {}
    for r in ranks:
        by.setdefault(r["role"], []).append(r)
    for role in ordered_roles(by, list(order)):
        rs = by[role]
        counts: Dict[str, int] = {}
        for r in rs:
            label = r["phase"] if r.get("step") is None else f"{r['phase']}@{r['step']}"
            counts[label] = counts.get(label, 0) + 1
        phases = " ".join(f"{k} x{v}" for k, v in counts.items())
        live = [r for r in rs if r["phase"] != DONE] or rs
        longest = min(live, key=lambda r: (r["since"], r["rank"]))
        lines.append(f"{role:<16}{len(rs):>5}  {phases:<30}{rank_name(longest)} {longest['phase']} "
                     f"for {_ago(longest['since'], now)}")
    return lines


def _metric(rec: dict, *path) -> Optional[float]:
    v = rec
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v if isinstance(v, (int, float)) else None


def _cell(v: Optional[float], fmt: str, width: int) -> str:
    return f"{'-' if v is None else format(v, fmt):>{width}}"


def metrics_section(records: List[dict], n: int) -> List[str]:
    """The driver's key metrics for the last n steps, and the latest evaluation."""
    steps = [r for r in records if r.get("kind") == "step"][-n:]
    lines = []
    if steps:
        lines.append(f"{'step':>6}{'step_s':>8}{'KL mean':>9}{'reward':>8}{'mult_err':>10}{'loss':>9}  (metrics.jsonl)")
        for r in steps:
            lines.append(f"{r['step']:>6}{_cell(_metric(r, 'timing', 'step_s'), '.2f', 8)}"
                         f"{_cell(_metric(r, 'reverse_kl', 'mean'), '.4f', 9)}{_cell(_metric(r, 'reward_mean'), '.3f', 8)}"
                         f"{_cell(_metric(r, 'token_mult_prob_error'), '.5f', 10)}{_cell(_metric(r, 'loss'), '.4f', 9)}")
    if steps and "async" in steps[-1]:  # asynchronous rollouts: the pipeline of the last step
        r, t = steps[-1], steps[-1].get("timing", {})
        dropped = sum(_metric(x, "async", "stale_dropped") or 0 for x in records if x.get("kind") == "step")
        idle = {who: v / t["step_s"] for who, v in (("trainer", t.get("wait_rows_s")),
                                                     ("generator", t["step_s"] - t.get("generate_busy_s", 0.0)))
                if v is not None and t.get("step_s")}
        lines.append(f"async rollouts: buffer depth {r['async'].get('buffer_depth')}, stale dropped {int(dropped)} in all, "
                     f"sample ages {(r.get('versions') or {}).get('age')}, "
                     + ", ".join(f"{who} idle {max(v, 0.0):.0%}" for who, v in idle.items()))
    lines += agentic_section(steps)
    lines += validation_section([r for r in records if r.get("kind") == "eval"])
    return lines


def _per_task(d: Optional[dict]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in (d or {}).items() if isinstance(v, (int, float))) or "-"


def validation_section(evals: List[dict]) -> List[str]:
    """The held-out validation (rl/eval.py's records): the latest one's accuracy per task and
    mean, pass@k and mean@k, reverse KL; and the best accuracy mean so far, with its step."""
    if not evals:
        return []
    e = evals[-1]
    mean, kl, k = e.get("accuracy_mean"), (e.get("reverse_kl") or {}).get("mean"), e.get("k")
    held = f", {e['prompts']} held-out prompts" if isinstance(e.get("prompts"), int) else ""
    line = (f"validation {e.get('tag')} (step {e.get('step')}{held}): "
            f"accuracy {_per_task(e.get('accuracy'))}" + (f" (mean {mean:.3f})" if isinstance(mean, (int, float)) else ""))
    if k:
        line += f"; pass@{k} {_per_task(e.get('pass_at_k'))}; mean@{k} {_per_task(e.get('mean_at_k'))}"
    if isinstance(kl, (int, float)):
        line += f"; reverse KL mean {kl:.4f}"
    lines = [line]
    ranked = [x for x in evals if isinstance(x.get("accuracy_mean"), (int, float))]
    if len(ranked) > 1:
        top = max(ranked, key=lambda x: (x["accuracy_mean"], x.get("step", 0)))
        lines.append(f"validation best accuracy mean {top['accuracy_mean']:.3f} at step {top.get('step')} "
                     f"({len(ranked)} validations)")
    return lines


def _kinds(counts: Optional[dict]) -> str:
    return ", ".join(f"{k} {int(v)}" for k, v in sorted((counts or {}).items()) if v)


def agentic_section(steps: List[dict]) -> List[str]:
    """Multi-turn episodes (the metrics' `agentic`, agentic/figures.py): per step, failed
    episodes against the share that ends the run, errors and timeouts, the in-flight peak
    against its limit per engine and over an env rank, how many waited for a slot and how
    long, and the tool latency; the last step's errors and timeouts by kind."""
    steps = [r for r in steps if isinstance(r.get("agentic"), dict) and r["agentic"].get("episodes")]
    if not steps:
        return []
    lines = [f"{'step':>6}{'episodes':>9}{'failed':>8}{'errors':>7}{'timeouts':>9}{'inflight/limit':>15}{'env rank':>9}"
             f"{'queued':>7}{'wait_s':>7}{'tool_s':>8}{'p95':>7}  (agentic)"]
    for r in steps:
        a = r["agentic"]
        share = _metric(a, "failed_share")
        limit = _metric(a, "max_error_share")
        failed = "-" if share is None else f"{share:.0%}" + ("!" if limit is not None and share > limit else "")
        inflight = f"{int(a.get('max_inflight_episodes', 0))}/{int(a['inflight_limit'])}" if "inflight_limit" in a \
            else str(int(a.get("max_inflight_episodes", 0)))
        lines.append(f"{r['step']:>6}{int(a['episodes']):>9}{failed:>8}{int(a.get('errors', 0)):>7}"
                     f"{int(a.get('timeouts', 0)):>9}{inflight:>15}{_cell(_metric(a, 'max_inflight_env_rank'), '.0f', 9)}"
                     f"{_cell(_metric(a, 'max_queue_depth'), '.0f', 7)}{_cell(_metric(a, 'queue_wait_s_mean'), '.2f', 7)}"
                     f"{_cell(_metric(a, 'tool_latency_s_mean'), '.3f', 8)}{_cell(_metric(a, 'tool_latency_s_p95'), '.3f', 7)}")
    a = steps[-1]["agentic"]
    if "sandbox_calls" in a:  # a sandboxing environment (python_tool): its tool calls
        lines.append(f"step {steps[-1]['step']}: sandboxed tool calls {int(a['sandbox_calls'])}, timed out (killed) "
                     f"{int(a.get('sandbox_timeouts', 0))}, failed {int(a.get('sandbox_failures', 0))}, "
                     f"{_cell(_metric(a, 'sandbox_s_mean'), '.3f', 0).strip()} s per call")
    errors, timeouts = _kinds(a.get("errors_by_kind")), _kinds(a.get("timeouts_by_kind"))
    if errors or timeouts:
        limit = _metric(a, "max_error_share")
        lines.append(f"step {steps[-1]['step']}: errors {errors or 'none'}; timeouts {timeouts or 'none'}"
                     + (f"; the run ends above {limit:.0%} failed (env.agentic.max_error_share)" if limit is not None else ""))
    return lines


def slowest_section(steps: List[dict], n: int, order: List[str] = (), ranks: int = 0) -> List[str]:
    """For each of the last n steps all `ranks` reported (0: as many as any step has), per
    role: its slowest rank (most busy time), how it compares with the role's median rank,
    and where its time went."""
    count: Dict[int, int] = {}
    for r in steps:
        count[r["step"]] = count.get(r["step"], 0) + 1
    # a rank writes a step's line when it leaves the step: skip steps still being left
    want = ranks or max(count.values(), default=0)
    complete = [s for s, c in sorted(count.items()) if c >= want][-n:]
    if not complete:
        return []
    lines = ["slowest rank per role: busy s (the role's median rank) of step s; its phases in s, * waiting"]
    for step in complete:
        worst = slowest_of(steps, step)
        for k, role in enumerate(ordered_roles(worst, list(order))):
            w = worst[role]
            phases = " ".join(f"{p}{'*' if is_waiting(p) else ''} {v:.2f}" for p, v in w["phases"].items())
            lines.append(f"{'step ' + str(step) if k == 0 else '':<9}{role:<14}{rank_name(w):<18}{w['busy_s']:>6.2f} "
                         f"({w['busy_median_s']:.2f}) of {w['step_s']:.2f}  {phases}")
    return lines


def render(run_dir: Path, state: str, steps: int = DEFAULT_STEPS, now: Optional[float] = None) -> str:
    """One snapshot: `state` (the caller's job state line), the progress, every role's
    current phase, key metrics of the last `steps` steps and their slowest ranks."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    out = [f"{run_dir}: {state}"]
    p = read_progress(run_dir)
    if p:
        out.append(f"{progress_line(p)}   (updated {_ago(p.get('time'), now)} ago)")
    # a role with 500 ranks writes 500 step lines per step: read only each file's end
    per_rank = read_steps(run_dir, last=steps + 1)
    order = role_order(run_dir)
    ranks_now = read_now(run_dir)
    # the ranks that take part in steps (a rank with nothing routed to it never does)
    stepping = {(r["role"], r["rank"]) for r in per_rank} | \
        {(r["role"], r["rank"]) for r in ranks_now if r.get("step") is not None}
    for section in (now_section(ranks_now, now, order),
                    metrics_section(_json_tail(RunDir(run_dir).metrics, 4 * steps + 4), steps),
                    slowest_section(per_rank, steps, order, len(stepping))):
        if section:
            out += [""] + section
    return "\n".join(out)


def last_step(run_dir: Path) -> Optional[int]:
    """The newest step in metrics.jsonl (a follower prints a snapshot when it moves)."""
    steps = [r.get("step") for r in _json_tail(RunDir(run_dir).metrics, 2) if r.get("kind") == "step"]
    return steps[-1] if steps else None


def _json_tail(path: Path, n: int) -> List[dict]:
    out = []
    for line in tail_lines(path, n):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
