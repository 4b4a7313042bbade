"""The trajectory age bound (`algo.async_rollout.max_trajectory_age_steps`), on the plain
data a collection is gathered as (rl/collect.py `Collector.gather`).

A sample's age at training step k is the policy's version (k - 1, the weights before this
step's update) minus the oldest weight version the sample saw (`version_first`: with
in-flight updates its later tokens may come from newer weights). A sample older than the
bound is never trained on: its whole prompt group leaves the batch (group-normalised
advantages need whole groups), and the count is reported.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from .siblings import keep_items, renumber


def ages(first_versions: Sequence[int], policy_version: int) -> List[int]:
    return [policy_version - v for v in first_versions]


def age_histogram(first_versions: Sequence[int], policy_version: int) -> Dict[str, int]:
    """age (steps, as a string key for JSON) -> samples."""
    out: Dict[str, int] = {}
    for a in ages(first_versions, policy_version):
        out[str(a)] = out.get(str(a), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def drop_stale(gathered: Dict[str, Any], policy_version: int, bound: int, group_size: int) -> Tuple[Dict[str, Any], int]:
    """The collection without the prompt groups that hold a sample older than `bound`;
    returns it and the number of samples dropped."""
    rows = gathered["rows"]
    old = [a > bound for a in ages([r.version_first for r in rows], policy_version)]
    if not any(old):
        return gathered, 0
    keep = [i for i in range(len(rows)) if not any(old[(i // group_size) * group_size:(i // group_size + 1) * group_size])]
    if not keep:
        raise RuntimeError(f"every sample of the collection is older than algo.async_rollout.max_trajectory_age_steps="
                           f"{bound} (policy version {policy_version}, oldest sample version "
                           f"{min(r.version_first for r in rows)}); nothing is left to train on")
    new_index = {old_i: k for k, old_i in enumerate(keep)}
    out = dict(gathered, records=[gathered["records"][i] for i in keep], rows=[rows[i] for i in keep])
    for key in ("rewards", "correct"):
        if gathered.get(key) is not None:
            out[key] = [gathered[key][i] for i in keep]
    for key in ("teacher", "reference"):  # keyed by item, or (item, k) for a sibling sample (rl/siblings.py)
        if gathered.get(key) is not None:
            out[key] = {renumber(k, new_index): lps for k, lps in gathered[key].items() if renumber(k, new_index) is not None}
    if gathered.get("siblings"):
        out["siblings"] = keep_items(gathered["siblings"], new_index)
    return out, len(rows) - len(keep)
