"""Multi-turn episodes through a generator's endpoint vs single-turn sampling of the same
token count, in one process and one run (bench/results/agentic.json).

The policy is the tiny tool-using teacher (tiny_agentic:teacher_calc), so the calculator
episodes really take two turns: a tool call, the tool's answer, the final answer. The
path is the product's: the generator's serving loop (hpc_rl/serving/loop.py) drives one
vLLM engine in the main thread, the endpoint (server.py) takes HTTP requests with the key,
and the env rank's episode code (roles/episode_runner.py `episodes_at`) runs the episodes
concurrently in a process of its own (as an env rank does). Then, on the same engine:
  single_turn_endpoint  one request per prompt through the same endpoint, each forced to
                        the episodes' mean policy tokens (min_tokens = max_tokens)
  single_turn_direct    the same requests as one engine.sample batch (no HTTP)
Generator busy fraction: the share of the wall time the serving loop spent inside engine
steps (the rest it waited for requests: episodes computing tools, HTTP, templating).

    python bench/agentic.py [--episodes 256] [--inflight 128] [--max-num-seqs 256] [--out PATH]
    python bench/agentic.py --episodes 1000 --inflight 1000 --max-num-seqs 1024 --out bench/results/agentic_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "agentic.json"


def serve_while(gen, requests, fn, *args):
    """Run `fn(*args)` in a process of its own (as an env rank is) while this process serves
    the engine; returns its result, the serving loop's figures and the wall time."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from hpc_rl.serving import serve

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        pool.submit(warm).result()  # the process is up, its imports done (an env rank's first step pays them once)
        t0 = time.perf_counter()
        fut = pool.submit(fn, *args)
        stats = serve(gen, requests, until=fut.done)
        return fut.result(), stats, time.perf_counter() - t0


def warm() -> None:
    from vllm.tool_parsers import ToolParserManager  # noqa: F401  (the episodes' tool parser imports vLLM)

    import hpc_rl.roles.episode_runner  # noqa: F401
    import hpc_rl.serving.client  # noqa: F401


def multi_turn(url, key, path, items, inflight):
    """The env rank's side: the calculator episodes against the endpoint (roles/episode_runner.py)."""
    from transformers import AutoTokenizer

    from hpc_rl.agentic.contract import Limits, build_environment
    from hpc_rl.engines.base import Sampling
    from hpc_rl.roles.episode_runner import episodes_at

    limits = Limits(max_turns=3, max_tokens=128, turn_timeout_s=300, episode_timeout_s=600)
    return asyncio.run(episodes_at(url, key, build_environment("calculator"), AutoTokenizer.from_pretrained(path), limits,
                                   "pythonic", Sampling(1.0, 1.0, -1, 40), items, inflight))


def single_turn(url, key, prompts, per_episode, inflight):
    """One token-route request per prompt, forced to `per_episode` tokens."""
    from hpc_rl.serving import EndpointClient

    async def run():
        sem = asyncio.Semaphore(inflight)
        async with EndpointClient(url, key, max_connections=inflight) as client:
            async def one(k, ids):
                async with sem:
                    return await client.tokens(ids, max_tokens=per_episode, min_tokens=per_episode, ignore_eos=True,
                                               seed=2000 + k)
            return await asyncio.gather(*(one(k, p) for k, p in enumerate(prompts)))
    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--inflight", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's max_num_seqs (generator.max_num_seqs)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from hpc_rl.data import tasks as task_gen
    from hpc_rl.data.dataset import PromptRecord
    from hpc_rl.refit.vllm_engine import VLLMGenerator
    from hpc_rl.rl.inputs import resolve_model_ref
    from hpc_rl.runtime.signed_store import ensure_job_key
    from hpc_rl.serving import RequestQueue, endpoint_key, start_endpoint

    ensure_job_key()
    key = endpoint_key()
    path = resolve_model_ref("tiny_agentic:teacher_calc")
    gen = VLLMGenerator(path, max_model_len=128, max_num_seqs=args.max_num_seqs)
    requests = RequestQueue()
    ep = start_endpoint("127.0.0.1", gen.tokenizer, requests.submit, key, tool_parser="pythonic")
    rows = task_gen.calculator(args.episodes, seed=7)
    items = [(i, PromptRecord(r["prompt"], r["agent"], r["answer"], r["task"]), 1000 + i) for i, r in enumerate(rows)]
    (back, scores), multi, wall = serve_while(gen, requests, multi_turn, ep.url, key, path, items, args.inflight)
    policy_tokens = sum(sum(r.policy_mask()) for _, rows_ in back.rows for r in rows_)
    per_episode = max(1, round(policy_tokens / len(items)))
    result = {"episodes": len(items), "max_inflight": args.inflight, "max_num_seqs": args.max_num_seqs, "multi_turn": {
        "wall_s": wall, "episodes_per_s": len(items) / wall, "turns": back.stats["turns"],
        "turns_per_s": back.stats["turns"] / wall, "policy_tokens": policy_tokens, "policy_tokens_per_s": policy_tokens / wall,
        "generator_busy_frac": multi.step_s / multi.wall_s, "engine_steps": multi.steps, "engine_max_batch": multi.max_batch,
        "mean_reward": sum(s[1] for s in scores) / len(scores), "max_inflight_reached": back.stats["max_inflight_episodes"],
        "errors": back.stats["errors"], "truncated": back.stats["truncated"],
        "changed_policy_tokens": back.stats["changed_policy_tokens"]}}

    prompts = [gen.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                                 add_generation_prompt=True) for r in rows]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]

    outs, st, wall1 = serve_while(gen, requests, single_turn, ep.url, key, prompts, per_episode, args.inflight)
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
    result["note"] = ("this 2-core machine (timings move ~15% between runs); the episodes' process shares the two cores "
                      "with the engine; the multi-turn figure includes the second turn's prefill of the whole history, the "
                      "wait between a turn and the next (templating, tool parsing, the tool) and the env process's CPU")
    ep.stop()
    gen.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
