"""The `python_tool` environment: the calculator's task with a real code tool that runs in
the sandbox of hpc_rl/envs/sandbox.py (bubblewrap: no network, read-only root, a private
/tmp, CPU/memory/wall-time limits, capped output).

Two tools, both run as `python3` inside a fresh sandbox per call:

    [python(code="print(37*58)")]          the program's stdout (stderr too when it fails)
    [calculator(expression="37*58")]       print(<expression>): the calculator-trained tiny
                                           models (tiny_agentic:*) call it as they learned to

A policy's text is handed to Python here, which calculator.py never does: it is safe only
because it runs sandboxed. A tool call ends at its wall time (env.agentic.sandbox.wall_s) or
at its episode's hard lifetime, whichever comes first: the episode's deadline
(env.agentic.episode_timeout_s from the episode's start) plus a scoring buffer
(env.agentic.sandbox.scoring_buffer_s). A call that times out is killed (its whole sandbox)
and answered with an error text the policy reads; it is counted (`sandbox_timeouts`).

Sandboxes are started from a pool of long-lived threads (never the event loop, never a
thread that ends before its sandbox): the parent-death signal that takes a sandbox down
with its rank follows the thread that started it. The rank's sandboxes share one tag (job
id + env rank, stable across the job's restarts): at its start the environment kills what an
earlier incarnation of the rank left behind (`reap_leftovers`), and a collection round ends
only when every sandbox it started is gone (`settle`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Dict, List, Optional

from .calculator import CalculatorEnv
from .contract import EpisodeResult, StepwiseEpisode
from .tools import call_arguments, function_tool

log = logging.getLogger(__name__)

PYTHON = function_tool("python", "Run a Python 3 program in a sandbox (no network, only /tmp writable); returns what it printed.",
                       "code", "e.g. print(37*58)")
CALCULATOR = function_tool("calculator", "Evaluate one Python expression in a sandbox and return its value.", "expression",
                           "e.g. 37*58")
_PRINT_ARG = "import sys; print(eval(sys.argv[1]))"  # the expression travels as an argument, never spliced into code
KINDS = ("bwrap", "apptainer", "enroot")


def sandbox_tag(job_id: Optional[str], env_rank: Optional[int]) -> str:
    """The env rank's sandbox tag: its job and rank (stable across the job's restarts, so a
    restarted rank finds what its previous incarnation left), in the characters a tag allows."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{job_id or 'nojob'}.env{env_rank if env_rank is not None else 0}")


class SandboxedTools:
    """One rank's sandbox and the long-lived threads that start its commands, with the
    counts the metrics report (`take_stats`)."""

    def __init__(self, sandbox, workers: int):
        self.sandbox = sandbox
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="hpc_rl-sandbox")
        self._lock = threading.Lock()
        self._pending: set = set()
        self._stats = self._zero()

    @staticmethod
    def _zero() -> Dict[str, float]:
        return {"sandbox_calls": 0.0, "sandbox_timeouts": 0.0, "sandbox_failures": 0.0, "sandbox_s": 0.0}

    def _run(self, argv: List[str], deadline: float):
        res = self.sandbox.run(argv, deadline=deadline)
        with self._lock:
            s = self._stats
            s["sandbox_calls"] += 1
            s["sandbox_timeouts"] += res.timed_out
            s["sandbox_failures"] += (not res.timed_out and res.exit_code != 0)
            s["sandbox_s"] += res.wall_s
        return res

    async def run(self, argv: List[str], deadline: float):
        fut: Future = self.pool.submit(self._run, argv, deadline)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)
        # a cancelled await (the episode's deadline) leaves the call to end at its own deadline
        return await asyncio.wrap_future(fut)

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def settle(self, timeout_s: Optional[float] = None) -> int:
        """Wait until every call started so far has ended (each is bounded by its deadline);
        returns how many were still running."""
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout=timeout_s)
        return len(pending)

    def take_stats(self) -> Dict[str, float]:
        with self._lock:
            out, self._stats = self._stats, self._zero()
        return out

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


def tool_text(res) -> str:
    """What the policy reads of a sandboxed call."""
    if res.timed_out:
        return f"error: timed out after {res.wall_s:.1f} s (killed)"
    out = res.stdout + (" [output truncated]" if res.stdout_truncated else "")
    if res.exit_code != 0:
        err = res.stderr.strip().splitlines()
        return f"error: exit {res.exit_code}" + (f": {err[-1]}" if err else "") + (f"\n{out}" if out else "")
    return out.rstrip("\n")


class PythonToolEnv(CalculatorEnv):
    """Step-wise (contract.StepwiseEpisode), one per episode: tool calls run sandboxed until
    `deadline` at the latest; the first message without a tool call is the final answer
    (scored as the calculator's: CalculatorEnv's reset and final answer)."""

    tools = [PYTHON, CALCULATOR]

    def __init__(self, tools: SandboxedTools, deadline: float, max_tool_calls: int = 4):
        super().__init__(max_tool_calls)
        self.runner, self.deadline = tools, deadline

    async def _answer_calls(self, calls: List[dict]) -> List[str]:
        # the calls of one message run at once: each is bounded by the same deadline
        return list(await asyncio.gather(*(self._call(call, i) for i, call in enumerate(calls))))

    async def _call(self, call: dict, i: int) -> str:
        if i >= self.max_tool_calls:
            return f"error: at most {self.max_tool_calls} calls per message"
        name = call.get("function", {}).get("name")
        args = call_arguments(call)
        if name == "python" and args is not None and set(args) == {"code"} and isinstance(args["code"], str):
            argv = ["python3", "-c", args["code"]]
        elif name == "calculator" and args is not None and set(args) == {"expression"} and isinstance(args["expression"], str):
            argv = ["python3", "-c", _PRINT_ARG, args["expression"]]
        elif name in ("python", "calculator"):
            return f"error: {name} takes one string argument, {'code' if name == 'python' else 'expression'}"
        else:
            return f"error: no tool named {name!r}"
        problem = argument_problem(argv[-1])
        if problem:
            return f"error: the {name} argument {problem}"
        return tool_text(await self.runner.run(argv, self.deadline))


MAX_ARG_BYTES = 64 << 10  # Linux refuses one argv string past 128 KiB (MAX_ARG_STRLEN): E2BIG


def argument_problem(text: str) -> Optional[str]:
    """Why the policy's text cannot be a process argument (exec would refuse it, and Popen
    raise on the env rank: a NUL, a lone surrogate, past the kernel's limit), or None. The
    policy reads the answer as the tool's error, as for any other bad call."""
    if "\x00" in text:
        return "contains a NUL character"
    try:
        size = len(os.fsencode(text))
    except UnicodeEncodeError:
        return "is not valid Unicode text (a lone surrogate)"
    return f"is longer than {MAX_ARG_BYTES} bytes" if size > MAX_ARG_BYTES else None


def make_sandbox(kind: str, tag: str, limits):
    """The rank's sandbox of `kind` (env.agentic.sandbox.kind). Only bubblewrap runs in this
    version; validation refuses the container kinds (their command lines are rendered by
    envs/container_sandbox.py and documented in docs/agentic.md)."""
    from hpc_rl.envs.sandbox import Sandbox

    if kind != "bwrap":
        raise ValueError(f"env.agentic.sandbox.kind={kind!r}: this version runs bwrap only; set env.agentic.sandbox.kind=bwrap")
    return Sandbox(tag, limits)


class PythonToolEpisode:
    """The Episode: one PythonToolEnv per episode, whose tool calls end at the episode's
    deadline plus the scoring buffer at the latest. Built once per env rank: it reaps what an
    earlier incarnation of the rank left, and checks that a sandbox starts (a rank that
    cannot sandbox fails at its start, never runs a tool unsandboxed)."""

    def __init__(self, tag: str = "local", episode_timeout_s: float = 600.0, scoring_buffer_s: float = 5.0,
                 wall_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024, output_bytes: int = 4096,
                 kind: str = "bwrap", max_tool_calls: int = 4, workers: Optional[int] = None):
        from hpc_rl.envs.sandbox import Limits, reap_leftovers

        self.episode_timeout_s, self.scoring_buffer_s, self.max_tool_calls = episode_timeout_s, scoring_buffer_s, max_tool_calls
        self.tag = tag
        self.reaped = reap_leftovers(tag)  # before anything of ours runs under the tag
        limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_bytes=memory_mb << 20, output_bytes=output_bytes)
        self.sandbox = make_sandbox(kind, tag, limits)
        self.start_s = self.sandbox.check()
        self.workers = workers or max(2, os.cpu_count() or 2)  # more would only share the same cores
        self.tools = SandboxedTools(self.sandbox, self.workers)
        # the rank log's evidence that its tools are sandboxed, and of what its predecessor left
        log.info("python_tool: %s sandboxes tagged %s (one started in %.3f s), %d threads; killed %d processes an "
                 "earlier incarnation of this rank left", kind, tag, self.start_s, self.workers, len(self.reaped))

    async def run(self, task: dict, chat) -> EpisodeResult:
        deadline = time.monotonic() + self.episode_timeout_s + self.scoring_buffer_s
        return await StepwiseEpisode(lambda: PythonToolEnv(self.tools, deadline, self.max_tool_calls)).run(task, chat)

    def settle(self) -> int:
        """Wait for this round's sandboxes to end (each at its deadline at the latest)."""
        return self.tools.settle()

    def take_stats(self) -> Dict[str, float]:
        """The sandboxed calls' counts since the last take: calls, timeouts (killed),
        failures (a non-zero exit), and their seconds summed."""
        return self.tools.take_stats()

    def shutdown(self) -> None:
        self.tools.shutdown()
