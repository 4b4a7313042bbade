"""Multi-turn episodes through a generator's endpoint vs single-turn sampling of the same
token count, in one process and one run (bench/results/agentic.json).

The policy is the tiny tool-using teacher (tiny_agentic:teacher_calc), so the calculator
episodes really take two turns: a tool call, the tool's answer, the final answer. The
path is the product's: the generator's serving loop (hpc_rl/serving/loop.py) drives one
vLLM engine in the main thread, the endpoint (server.py) takes HTTP requests with the key,
and the env rank's episode code (roles/episode_runner.py `episodes_at`) runs the episodes
concurrently in another thread. Then, on the same engine:
  single_turn_endpoint  one request per prompt through the same endpoint, each forced to
                        the episodes' mean policy tokens (min_tokens = max_tokens)
  single_turn_direct    the same requests as one engine.sample batch (no HTTP)
Generator busy fraction: the share of the wall time the serving loop spent inside engine
steps (the rest it waited for requests: episodes computing tools, HTTP, templating).

    python bench/agentic.py [--episodes 256] [--inflight 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "agentic.json"


def serve_while(gen, requests, work):
    """Run coroutine factory `work` in a thread's event loop while this thread serves the engine."""
    from hpc_rl.serving import serve

    box = []
    t = threading.Thread(target=lambda: box.append(asyncio.run(work())), daemon=True)
    t0 = time.perf_counter()
    t.start()
    stats = serve(gen, requests, until=lambda: not t.is_alive())
    t.join()
    return box[0], stats, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--inflight", type=int, default=128)
    args = ap.parse_args()

    from hpc_rl.agentic.contract import Limits, build_environment
    from hpc_rl.data import tasks as task_gen
    from hpc_rl.data.dataset import PromptRecord
    from hpc_rl.engines.base import Sampling
    from hpc_rl.refit.vllm_engine import VLLMGenerator
    from hpc_rl.rl.inputs import resolve_model_ref
    from hpc_rl.roles.episode_runner import episodes_at
    from hpc_rl.runtime.signed_store import ensure_job_key
    from hpc_rl.serving import EndpointClient, RequestQueue, endpoint_key, start_endpoint

    ensure_job_key()
    key = endpoint_key()
    path = resolve_model_ref("tiny_agentic:teacher_calc")
    gen = VLLMGenerator(path, max_model_len=128, max_num_seqs=256)
    requests = RequestQueue()
    ep = start_endpoint("127.0.0.1", gen.tokenizer, requests.submit, key, tool_parser="pythonic")
    rows = task_gen.calculator(args.episodes, seed=7)
    items = [(i, PromptRecord(r["prompt"], r["agent"], r["answer"], r["task"]), 1000 + i) for i, r in enumerate(rows)]
    sampling = Sampling(1.0, 1.0, -1, 40)
    limits = Limits(max_turns=3, max_tokens=128, turn_timeout_s=300, episode_timeout_s=600)
    episode = build_environment("calculator")

    (back, scores), multi, wall = serve_while(gen, requests, lambda: episodes_at(
        ep.url, key, episode, gen.tokenizer, limits, "pythonic", sampling, items, args.inflight))
    policy_tokens = sum(sum(r.policy_mask()) for _, r in back.rows)
    per_episode = max(1, round(policy_tokens / len(items)))
    result = {"episodes": len(items), "max_inflight": args.inflight, "multi_turn": {
        "wall_s": wall, "episodes_per_s": len(items) / wall, "turns": back.stats["turns"],
        "turns_per_s": back.stats["turns"] / wall, "policy_tokens": policy_tokens, "policy_tokens_per_s": policy_tokens / wall,
        "generator_busy_frac": multi.step_s / multi.wall_s, "engine_steps": multi.steps, "engine_max_batch": multi.max_batch,
        "mean_reward": sum(s[1] for s in scores) / len(scores), "max_inflight_reached": back.stats["max_inflight_episodes"],
        "errors": back.stats["errors"], "truncated": back.stats["truncated"],
        "changed_policy_tokens": back.stats["changed_policy_tokens"]}}

    prompts = [gen.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                                 add_generation_prompt=True) for r in rows]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]

    async def single():
        sem = asyncio.Semaphore(args.inflight)
        async with EndpointClient(ep.url, key, max_connections=args.inflight) as client:
            async def one(k, ids):
                async with sem:
                    return await client.tokens(ids, max_tokens=per_episode, min_tokens=per_episode, ignore_eos=True,
                                               seed=2000 + k)
            return await asyncio.gather(*(one(k, p) for k, p in enumerate(prompts)))

    outs, st, wall1 = serve_while(gen, requests, single)
    n1 = sum(len(o["token_ids"]) for o in outs)
    result["single_turn_endpoint"] = {"wall_s": wall1, "policy_tokens": n1, "policy_tokens_per_s": n1 / wall1,
                                      "generator_busy_frac": st.step_s / st.wall_s, "engine_steps": st.steps}
    from vllm import SamplingParams

    t0 = time.perf_counter()
    direct = gen.llm.generate([{"prompt_token_ids": p} for p in prompts],
                              [SamplingParams(max_tokens=per_episode, min_tokens=per_episode, ignore_eos=True, seed=3000 + k)
                               for k in range(len(prompts))], use_tqdm=False)
    wall2 = time.perf_counter() - t0
    n2 = sum(len(o.outputs[0].token_ids) for o in direct)
    result["single_turn_direct"] = {"wall_s": wall2, "policy_tokens": n2, "policy_tokens_per_s": n2 / wall2}
    result["multi_turn_vs_single_turn_endpoint_time"] = wall / wall1
    result["machine"] = {"cpus": len(__import__("os").sched_getaffinity(0)), "platform": platform.platform()}
    result["note"] = ("one run, this 2-core machine (timings move ~15% between runs); the multi-turn figure includes "
                      "the second turn's prefill of the whole history and the env's templating and tool calls")
    ep.stop()
    gen.close()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
