"""The generator's vLLM engine: batched sampling with the sampled tokens' logprobs, and a
weight-update entry fed by the trainer over a gloo group (a full-state transfer; the
reshard planner replaces it with slice transfers).

The trainer side (`RefitSender`) hosts nothing new: it joins the same TCPStore and sends
each tensor of its full state dict, in a fixed order, to the engine's workers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

EXTENSION = "hpc_rl.refit.vllm_extension.RefitWorkerExtension"


@dataclass
class Rollouts:
    """Right-padded prompt+response token ids and what the engine said about them."""

    input_ids: torch.Tensor  # [B, T] long, prompt then response, right-padded
    attention_mask: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] bool: the generated tokens (the ones trained on)
    generation_logprobs: torch.Tensor  # [B, T]: sampled token's logprob at its position, 0 elsewhere
    prompt_lengths: List[int]
    generation_lengths: List[int]
    truncated: List[bool]  # stopped by max_tokens rather than a stop token/string
    texts: List[str]


@dataclass
class SampleRow:
    """One generated sample as plain lists (cheap to pickle between ranks)."""

    prompt_ids: List[int]
    response_ids: List[int]
    logprobs: List[float]  # the sampled tokens' logprobs under the generating engine
    truncated: bool  # stopped by max_tokens rather than a stop token/string
    text: str


def pad_rows(rows: Sequence[SampleRow], pad_id: int) -> Rollouts:
    """Right-pad prompt+response rows into one batch; logprob of token i sits at position i."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    b = len(rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    resp = torch.zeros((b, width), dtype=torch.bool)
    glp = torch.zeros((b, width), dtype=torch.float32)
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.prompt_ids) + len(r.response_ids)
        ids[i, :n] = torch.tensor(r.prompt_ids + r.response_ids)
        attn[i, :n] = 1
        resp[i, p:n] = True
        glp[i, p:n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return Rollouts(ids, attn, resp, glp, [len(r.prompt_ids) for r in rows], [len(r.response_ids) for r in rows],
                    [r.truncated for r in rows], [r.text for r in rows])


def tensor_meta(state: Dict[str, torch.Tensor]) -> List[Tuple[str, List[int], str]]:
    return [(k, list(v.shape), str(v.dtype).split(".")[1]) for k, v in state.items()]


class VLLMGenerator:
    def __init__(self, model_path: str, precision: str = "fp32", max_model_len: int = 256, seed: int = 0,
                 memory_fraction: float = 0.2, max_num_seqs: int = 256):
        from vllm import LLM

        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
        # On CPU, gpu_memory_utilization is the share of the NUMA node's memory vLLM reserves.
        # A token budget that fits every running sequence whole: no prompt is ever split by
        # chunked prefill. vLLM 0.32 on CPU crashes when it rewinds a per-request seeded
        # generator after a partial prefill ("CPU Generator does not use offset").
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, enforce_eager=True, seed=seed,
                       gpu_memory_utilization=memory_fraction, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max(max_num_seqs * max_model_len, 2048),
                       worker_extension_cls=EXTENSION)
        self.tokenizer = self.llm.get_tokenizer()
        self.weight_version = 0

    def chat_prompts(self, prompts: Sequence[str]) -> List[str]:
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                   add_generation_prompt=True) for p in prompts]

    def sample(self, prompts: Sequence[str], temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
               max_tokens: int = 32, stop: Sequence[str] = (),
               seed: Union[None, int, Sequence[int]] = None) -> List[SampleRow]:
        """One row per prompt: prompt ids, sampled ids with their logprobs, truncation, text.
        `seed` may be one seed per prompt: a request's sample then depends only on its own
        seed, not on what else is in the batch (reproducible resumes)."""
        from vllm import SamplingParams

        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                 stop=list(stop), logprobs=0, seed=s) for s in seeds]
        outs = self.llm.generate(list(prompts), params, use_tqdm=False)
        rows = []
        for o in outs:
            c = o.outputs[0]
            lps = [next(iter(d.values())).logprob if d else 0.0 for d in (c.logprobs or [])]
            rows.append(SampleRow(list(o.prompt_token_ids), list(c.token_ids), lps[:len(c.token_ids)],
                                  c.finish_reason == "length", c.text))
        return rows

    def generate(self, prompts: Sequence[str], temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_tokens: int = 32, stop: Sequence[str] = (), seed: Optional[int] = None) -> Rollouts:
        rows = self.sample(prompts, temperature, top_p, top_k, max_tokens, stop, seed)
        return pad_rows(rows, self.tokenizer.pad_token_id or 0)

    def join_refit(self, host: str, port: int, first_rank: int, world: int, prefix: str, timeout_s: float) -> None:
        """Have the engine's worker join the refit group as rank `first_rank` (one worker here)."""
        self.llm.collective_rpc("hpc_rl_join", args=(host, port, first_rank, world, prefix, timeout_s))

    def receive(self, meta, src: int, version: int) -> int:
        self.llm.collective_rpc("hpc_rl_receive", args=(meta, src, version))
        self.weight_version = version
        return version


class RefitSender:
    """The trainer's end of a full-state refit (rank 0 of the refit group)."""

    def __init__(self, store: dist.Store, world: int, prefix: str, timeout_s: float):
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 0, world, timedelta(seconds=timeout_s))

    def send(self, state: Dict[str, torch.Tensor]) -> float:
        """Broadcast every tensor of `state` in order; returns the seconds it took."""
        t0 = time.perf_counter()
        for tensor in state.values():
            self.pg.broadcast(tensor.contiguous(), 0).wait()
        return time.perf_counter() - t0


def refit_in_process(generator: VLLMGenerator, sender_store: dist.TCPStore, port: int,
                     state: Dict[str, torch.Tensor], version: int, prefix: str, timeout_s: float = 120.0) -> Dict[str, float]:
    """Trainer and generator in one process (tests, benchmarks): join, then send while the
    engine receives. Returns timings."""
    t0 = time.perf_counter()
    joiner = threading.Thread(target=generator.join_refit, args=("127.0.0.1", port, 1, 2, prefix, timeout_s))
    joiner.start()
    sender = RefitSender(sender_store, 2, prefix, timeout_s)
    joiner.join()
    t1 = time.perf_counter()
    errors: List[BaseException] = []

    def receive():
        try:
            generator.receive(tensor_meta(state), 0, version)
        except BaseException as exc:  # surfaced below, after the sender is done
            errors.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    send_s = sender.send(state)
    receiver.join()
    if errors:
        raise errors[0]
    return {"join_s": t1 - t0, "send_s": send_s, "refit_s": time.perf_counter() - t1}
