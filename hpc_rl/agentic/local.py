"""Policies in this process, for tests, benchmarks and the tiny assets' evaluation: a vLLM
engine (VLLMGenerator) or a Hugging Face model. In a run the policy is the generator's token
route over HTTP (hpc_rl/serving); these have the same signature:

    async policy(prompt_ids, max_tokens) -> (ids, logprobs, version_first, version_last, finish_reason)
"""

from __future__ import annotations

import asyncio
from typing import List, Optional, Sequence, Tuple

import torch


class EnginePolicy:
    """A VLLMGenerator as the policy. The calls the episodes make while the engine is busy are
    queued and sent as one batch when it is free (continuous batching in miniature), so many
    episodes in flight keep the engine full. The engine runs in a worker thread, one batch at
    a time (vLLM's LLM is not to be called from two threads at once); the event loop stays
    free for the episodes meanwhile."""

    def __init__(self, gen, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, seed: Optional[int] = 0):
        self.gen = gen
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.seed = seed  # each request gets seed + its number: reproducible for one order of calls
        self.requests = 0
        self.batches: List[int] = []  # the size of each batch sent: how full the engine was kept
        self._pending: list = []
        self._drainer: Optional[asyncio.Task] = None

    async def __call__(self, prompt_ids: List[int], max_tokens: int):
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), int(max_tokens), self.requests, fut))
        self.requests += 1
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self):
        while self._pending:
            await asyncio.sleep(0)  # the other episodes' calls of this loop tick join the batch
            batch, self._pending = self._pending, []
            live = [b for b in batch if not b[3].done()]  # an episode may have timed out meanwhile
            if not live:
                continue
            self.batches.append(len(live))
            try:
                outs = await asyncio.to_thread(self._generate, live)
            except Exception as exc:  # every waiting episode sees the engine's error
                for *_, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (*_, fut), out in zip(live, outs):
                if not fut.done():
                    fut.set_result(out)

    def _generate(self, batch) -> List[Tuple]:
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": ids} for ids, _, _, _ in batch]
        params = [SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=n,
                                 logprobs=0, seed=None if self.seed is None else self.seed + k)
                  for _, n, k, _ in batch]
        outs = self.gen.llm.generate(prompts, params, use_tqdm=False)
        return [engine_output(o, self.gen.weight_version) for o in outs]


def engine_output(o, default_version: int) -> Tuple:
    """A vLLM RequestOutput as the policy's answer: ids (eos included, as vLLM returns it),
    the sampled tokens' logprobs, first/last weight versions, finish reason."""
    c = o.outputs[0]
    ids = list(c.token_ids)
    lps = [next(iter(d.values())).logprob if d else 0.0 for d in (c.logprobs or [])][:len(ids)]
    spans = [int(s.version) for s in (getattr(c, "weight_versions", None) or []) if s.version is not None]
    first, last = (spans[0], spans[-1]) if spans else (default_version, default_version)
    return ids, lps, first, last, c.finish_reason or "stop"


class HFPolicy:
    """A Hugging Face causal LM as the policy, greedy (the tiny assets' evaluation) or
    sampled. One call at a time, on the event loop's thread: for small models only."""

    def __init__(self, model, tokenizer, greedy: bool = True, version: int = 0):
        self.model, self.tok, self.greedy, self.version = model, tokenizer, greedy, version
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_tokens: int) -> Tuple:
        x = torch.tensor([list(prompt_ids)])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                  do_sample=not self.greedy, eos_token_id=self.eos, pad_token_id=self.pad,
                                  output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0, x.shape[1]:].tolist()
        # the sampled tokens' logprobs under the model's raw logits (not the processed scores)
        lps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids)]
        finish = "stop" if ids and ids[-1] == self.eos else "length"
        return ids, lps, self.version, self.version, finish

    async def __call__(self, prompt_ids: List[int], max_tokens: int):
        return self.generate(prompt_ids, max_tokens)
