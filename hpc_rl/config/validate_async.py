"""Validation of in-flight weight updates (`algo.async_rollout`), beside validate.py."""

from __future__ import annotations

from typing import List

from .errors import Violation


def check_in_flight(out: List[Violation], asy) -> None:
    if asy.in_flight_weight_updates and not asy.enabled:
        out.append(Violation("algo.async_rollout.in_flight_weight_updates", True, "in-flight weight updates need asynchronous rollouts",
                             "set algo.async_rollout.enabled=true or in_flight_weight_updates=false"))
    # Nothing reads it without an in-flight refit: a recipe setting it expects an effect it would not get.
    if asy.recompute_kv_cache_after_weight_updates and not asy.in_flight_weight_updates:
        out.append(Violation("algo.async_rollout.recompute_kv_cache_after_weight_updates", True,
                             "the KV cache is only recomputed after an in-flight weight update; between collections "
                             "no request is running, so there is nothing to recompute",
                             "set algo.async_rollout.in_flight_weight_updates=true (with enabled=true) or "
                             "recompute_kv_cache_after_weight_updates=false"))
