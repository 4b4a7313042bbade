"""Environment faults: how an episode that raised or hung is named, counted, logged and,
past a configured share of a step, made to end the run.

- An episode that raises is scored 0 and keeps its tokens (runner.py); its error counts by
  kind (the exception's class name) in the step's metrics (`agentic.errors_by_kind`), and
  the env rank logs the last line of its traceback once per kind (`ErrorLog`): a
  thousand episodes failing alike write one line, not a thousand tracebacks.
- An episode past `episode_timeout_s`, or an environment call past `turn_timeout_s`, is
  truncated (scored `truncated_reward`) and counted as a timeout by kind.
- Both are failures of the environment (`FAILED_BY`). A training step whose share of
  failed episodes exceeds `env.agentic.max_error_share` ends the run before that step is
  trained (`check_error_share`), and the batch shell does not requeue it: a resumed run
  would replay the same episodes with the same seeds.

A turn past `turn_timeout_s` waiting for the policy (`turn_timeout`) is a timeout too, but
the engine's, not the environment's: it is counted, not held against the environment.
"""

from __future__ import annotations

import traceback
from typing import Dict, Mapping, Optional

TIMEOUT_KINDS = ("episode_timeout", "env_timeout", "turn_timeout")  # result.info["truncated_by"] of a timeout
FAILED_BY = ("episode_timeout", "env_timeout")  # timeouts that are the environment's fault (hung)


def error_kind(exc: BaseException) -> str:
    """The exception's class name, or the kind it carries (`error_kind`: a failure caught
    below and raised again under its original name, contract.ScoringFailed)."""
    kind = getattr(exc, "error_kind", None)
    return kind if isinstance(kind, str) and kind else type(exc).__name__


def traceback_line(exc: BaseException) -> str:
    """The last line of the exception's traceback, with the frame that raised it:
    'File ".../env.py", line 12, in step: ValueError: boom'."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    where = f'File "{frames[-1].filename}", line {frames[-1].lineno}, in {frames[-1].name}: ' if frames else ""
    return where + (last[-1] if last else error_kind(exc))


class ErrorLog:
    """Logs each kind of episode error once per process (an env rank's run): its first
    traceback line and where the counts go."""

    def __init__(self, log, environment: str):
        self.log, self.environment, self.seen = log, environment, set()

    def note(self, lines: Mapping[str, str], counts: Mapping[str, float], step: Optional[int]) -> int:
        """`lines`: kind -> a traceback line of this round; returns how many kinds were new."""
        new = [k for k in sorted(lines) if k not in self.seen]
        for kind in new:
            self.seen.add(kind)
            self.log.warning("environment %s: an episode raised %s (%d of this round%s; scored 0, counted in the metrics' "
                             "agentic.errors_by_kind; logged once per kind): %s", self.environment, kind,
                             int(counts.get(kind, 0)), f", step {step}" if step is not None else "", lines[kind])
        return len(new)


def failed_count(stats: Mapping[str, object]) -> int:
    """Episodes the environment failed: raised, or hung past a deadline."""
    by = stats.get("timeouts_by_kind") or {}
    return int(stats.get("errors", 0)) + sum(int(by.get(k, 0)) for k in FAILED_BY)  # type: ignore[union-attr]


class EpisodeFaultsError(RuntimeError):
    """Too many failed episodes in a training step. `no_retry`: the batch shell does not
    requeue (runtime/worker.py writes errors/fatal.<restart>.txt): a resumed run would
    replay the same episodes with the same seeds and fail the same way."""

    no_retry = True


def check_error_share(stats: Mapping[str, object], limit: float, environment: str, step: int) -> None:
    """Raises EpisodeFaultsError when the step's share of failed episodes exceeds `limit`
    (env.agentic.max_error_share), naming the environment, the share, the key and the fix."""
    n = int(stats.get("episodes", 0))  # type: ignore[arg-type]
    failed = failed_count(stats)
    if n == 0 or failed / n <= limit:
        return
    kinds: Dict[str, int] = {k: int(v) for k, v in (stats.get("errors_by_kind") or {}).items()}  # type: ignore[union-attr]
    kinds.update({k: int(v) for k, v in (stats.get("timeouts_by_kind") or {}).items() if k in FAILED_BY and v})  # type: ignore[union-attr]
    raise EpisodeFaultsError(
        f"step {step}: {failed} of {n} episodes ({failed / n:.0%}) of environment {environment!r} failed "
        f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}), more than env.agentic.max_error_share={limit:g}; "
        f"the step was not trained. Each kind's traceback line is in the env ranks' logs (logs/env.*). Fix the "
        f"environment, or raise env.agentic.max_error_share (1.0 never stops; failed episodes score 0) to train through them")
