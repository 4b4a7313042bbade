"""What vLLM 0.32 (CPU) allows for in-flight weight updates (#15's next layer), checked on
the real engine: requests are mid-generation (driven by LLMEngine.step), the scheduler is
paused with mode "keep" (running requests frozen, KV cache kept, or cleared:
`clear_cache=True` resets the running requests' cache so they recompute it), new weights are
loaded through the refit path (refit/vllm_extension.py), the engine's weight version label
is set and the scheduler resumes. Each finished request reports the weight-version spans of
its output tokens (CompletionOutput.weight_versions): a request that straddles the load
shows two versions.

    python bench/inflight_probe.py      # writes bench/results/inflight_probe.json

Not wired into the RL loop yet: config/support.py still refuses in_flight_weight_updates.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "inflight_probe.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(gen, store, port, endpoint, state, version: int, clear_cache: bool, steps_before: int = 4):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from hpc_rl.refit.vllm_engine import refit_in_process

    engine = gen.llm.llm_engine
    core = engine.engine_core
    core.set_weight_version(str(version - 1))
    prompts = gen.chat_prompts([f"{a}+{b}=" for a, b in ((1, 2), (3, 4), (5, 6), (7, 1))])
    for i, p in enumerate(prompts):
        engine.add_request(f"v{version}-{i}", p, SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=i,
                                                                logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY))
    done = {}
    for _ in range(steps_before):
        for o in engine.step():
            done[o.request_id] = o
    t0 = time.perf_counter()
    core.call_utility("pause_scheduler", "keep", clear_cache)
    t_paused = time.perf_counter()
    timings, endpoint = refit_in_process(gen, store, port, state, version, "probe/refit", endpoint=endpoint)
    core.set_weight_version(str(version))
    core.call_utility("resume_scheduler")
    t_resumed = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
    rows = []
    for rid, o in sorted(done.items()):
        c = o.outputs[0]
        spans = [(s.version, s.start, s.end) for s in (c.weight_versions or [])]
        rows.append({"request": rid, "tokens": len(c.token_ids), "spans": spans})
    return {"clear_cache": clear_cache, "pause_s": t_paused - t0, "load_s": timings["refit_s"],
            "pause_to_resume_s": t_resumed - t0, "requests": rows,
            "straddled": sum(len({s[0] for s in r["spans"]}) > 1 for r in rows)}, endpoint


def main() -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from hpc_rl.refit.vllm_engine import VLLMGenerator, refit_in_process
    from hpc_rl.rl.inputs import resolve_model_ref

    student, teacher = resolve_model_ref("tiny:student"), resolve_model_ref("tiny:teacher_add")
    gen = VLLMGenerator(student, precision="fp32", max_model_len=128, memory_fraction=0.1, max_num_seqs=8)
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)
    own = load_file(str(next(Path(student).glob("*.safetensors"))))
    other = load_file(str(next(Path(teacher).glob("*.safetensors"))))
    _, endpoint = refit_in_process(gen, store, port, own, 0, "probe/refit")  # join the group once
    keep, endpoint = run_case(gen, store, port, endpoint, other, 1, clear_cache=False)
    recompute, endpoint = run_case(gen, store, port, endpoint, own, 2, clear_cache=True)
    out = {"bench": "inflight_probe", "time": time.time(), "keep_kv": keep, "recompute_kv": recompute}
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: {kk: v[kk] for kk in ("straddled", "pause_s", "load_s", "pause_to_resume_s")}
                      for k, v in out.items() if isinstance(v, dict)}))


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    main()
