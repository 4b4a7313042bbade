"""The episodes' figures on their way to the metrics: each env rank reports per engine it
serves (roles/episode_runner.py), the driver merges them over the engines (`merge_stats`)
and finishes them into the step's `agentic` metrics (`finish_stats`), which
`python -m hpc_rl.slurm.watch` shows (observe/live.py). docs/agentic.md lists them.

Merging: counts add up; a peak (`max_*`) stays the largest; a dict of counts (errors by
kind) adds per key; a list of samples (tool latencies) is concatenated, so the driver's
mean and 95th percentile are over every episode, not an average of averages.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

LATENCY_SAMPLES = "tool_latency_s"  # the env ranks' samples; the metrics keep their mean and p95


def latency_figures(samples: Sequence[float], name: str = LATENCY_SAMPLES) -> Dict[str, float]:
    """Mean and 95th percentile (nearest rank) of latency samples, and their count."""
    xs = sorted(samples)
    if not xs:
        return {f"{name}_n": 0}
    p95 = xs[min(len(xs) - 1, max(0, -(-95 * len(xs) // 100) - 1))]
    return {f"{name}_n": len(xs), f"{name}_mean": sum(xs) / len(xs), f"{name}_p95": p95}


def _is_peak(key: str) -> bool:
    return key.startswith("max_") or "_max_" in key


def merge_stats(total: Mapping[str, Any], part: Mapping[str, Any]) -> Dict[str, Any]:
    """The episodes' figures of several engines: peaks stay peaks, lists concatenate, dicts
    merge per key, the rest add up."""
    out = dict(total)
    for k, v in part.items():
        if isinstance(v, Mapping):
            out[k] = merge_stats(out.get(k, {}), v)
        elif isinstance(v, (list, tuple)):
            out[k] = list(out.get(k, [])) + list(v)
        elif _is_peak(k):
            out[k] = max(out.get(k, v), v)
        else:
            out[k] = out.get(k, 0) + v
    return out


def finish_stats(stats: Mapping[str, Any], inflight_limit: int, max_error_share: float) -> Dict[str, Any]:
    """The step's `agentic` metrics from the merged figures: latency samples become their
    mean and p95, summed queue waits a mean per episode, failures a share; the limits they
    are held to (the per-engine in-flight limit, the error share that ends the run) are
    added beside them, so a reader of the metrics alone sees how close each came."""
    out = {k: v for k, v in stats.items() if k != LATENCY_SAMPLES}
    if not out:
        return out
    n = max(1.0, float(out.get("episodes", 0)))
    out.update(latency_figures(stats.get(LATENCY_SAMPLES, ())))
    out["queue_wait_s_mean"] = float(out.pop("queue_wait_s", 0.0)) / n
    out["failed_share"] = float(out.get("failed", 0)) / n
    if "sandbox_s" in out:  # a sandboxing environment's calls (python_tool): seconds per call
        out["sandbox_s_mean"] = float(out.pop("sandbox_s")) / max(1.0, float(out.get("sandbox_calls", 0)))
    out["inflight_limit"] = inflight_limit
    out["max_error_share"] = max_error_share
    return out
