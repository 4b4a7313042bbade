"""The engine's serving loop: requests from the endpoint's HTTP thread, batched continuously
into the generator's one synchronous vLLM engine.

The generator already drives its engine one scheduler step at a time (VLLMGenerator's
stepped sampler) so that in-flight refits land between steps. Serving does the same with
requests that arrive over HTTP: before every step the loop admits whatever has been
queued since the last one, so requests from many connections run in the same batches
(continuous batching), and `between_steps` (the refit poll) runs after each step exactly
as it does for sampling. The loop runs in the generator's main thread; the HTTP thread
only queues `TokenRequest`s and awaits their futures.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional


class RequestError(ValueError):
    """The engine refused a request (prompt too long, a token id outside the vocabulary, bad
    sampling parameters): the client's fault, answered with 400."""


@dataclass
class TokenRequest:
    """One generation request in token ids, as the token route and the chat route hand it
    to the engine. `max_tokens` None: up to the engine's context length."""

    prompt_token_ids: List[int]
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    future: Future = field(default_factory=Future, repr=False, compare=False)

    def sampling_params(self):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # logprobs=0: the sampled token's own logprob only (what the trainer compares with);
        # FINAL_ONLY: a step returns only the requests it finished, nothing per token.
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens,
                              min_tokens=self.min_tokens, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, logprobs=0, seed=self.seed,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class TokenResult:
    """What the engine made of a TokenRequest: the generated ids (the stop token included,
    as the engine produced it), each one's logprob, the weight versions of the first and
    last generated tokens (they differ when a refit landed mid-request), why it stopped."""

    prompt_token_ids: List[int]
    token_ids: List[int]
    logprobs: List[float]
    text: str
    finish_reason: Optional[str]  # "stop" (stop token or string), "length" (max_tokens or context), "abort"
    stop_reason: object  # the stop string or token id that ended it, if any
    weight_version_first: int
    weight_version_last: int

    def token_route(self) -> Dict[str, object]:
        """The token route's response body."""
        return {"token_ids": self.token_ids, "logprobs": self.logprobs, "weight_version_first": self.weight_version_first,
                "weight_version_last": self.weight_version_last, "finish_reason": self.finish_reason}


class RequestQueue:
    """The hand-off between the endpoint's HTTP thread (`submit`) and the serving loop: a
    thread-safe queue of TokenRequests; `submit` returns the request's future."""

    def __init__(self):
        self._q: "queue.Queue[TokenRequest]" = queue.Queue()

    def submit(self, request: TokenRequest) -> Future:
        self._q.put(request)
        return request.future

    def get(self, timeout: Optional[float]) -> Optional[TokenRequest]:
        """The next request; waits up to `timeout` (0: does not wait). None if none came."""
        try:
            return self._q.get(timeout=timeout) if timeout else self._q.get_nowait()
        except queue.Empty:
            return None

    def __len__(self) -> int:
        return self._q.qsize()


@dataclass
class ServeStats:
    """What one `serve` call did. `max_batch`: the most requests the engine held at one
    step (vLLM schedules all of them in that step when they fit max_num_seqs and its token
    budget, which engine_kwargs sizes for every running sequence). `step_s` / `idle_s`:
    time inside engine steps / waiting for requests (the generator's busy fraction)."""

    requests: int = 0
    finished: int = 0
    failed: int = 0  # refused by the engine (RequestError)
    cancelled: int = 0  # the caller gave up; aborted in the engine
    steps: int = 0
    max_batch: int = 0
    generated_tokens: int = 0
    step_s: float = 0.0
    idle_s: float = 0.0
    wall_s: float = 0.0


_ids = [0]  # request ids of the serving loop, distinct from the stepped sampler's "hpc_rl-N"


def serve(generator, requests: RequestQueue, until: Callable[[], bool], between_steps: Optional[Callable[[], None]] = None,
          idle_wait_s: float = 0.05) -> ServeStats:
    """Serve `requests` on `generator` (a VLLMGenerator) until `until()` is true and nothing is
    pending (none queued, none in the engine). `until` is checked only while idle; a request
    queued after it turned true but before the loop noticed is still served. While idle the
    loop waits on the queue for `idle_wait_s` at a time, so a refit poll in `between_steps`
    also runs at that pace when no request comes."""
    from vllm.inputs import TokensPrompt

    engine = generator.llm.llm_engine
    pending: Dict[str, TokenRequest] = {}
    stats = ServeStats()
    t0 = time.perf_counter()

    def admit(req: TokenRequest) -> None:
        if req.future.cancelled():
            stats.cancelled += 1
            return
        stats.requests += 1
        _ids[0] += 1
        rid = f"hpc_rl-serve-{_ids[0]}"
        try:
            # the student's adapter under trainer.lora.refit=adapter (None otherwise), as the sampler's requests
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(req.prompt_token_ids)), req.sampling_params(),
                               lora_request=generator.lora_request)
        except Exception as exc:  # vLLM validates the request here: its message says what is wrong
            stats.failed += 1
            _settle(req.future, exc=RequestError(str(exc)))
            return
        pending[rid] = req

    try:
        while True:
            while (req := requests.get(0)) is not None:
                admit(req)
            if not pending and not engine.has_unfinished_requests():
                if until() and not len(requests):
                    break
                t = time.perf_counter()
                req = requests.get(idle_wait_s)
                stats.idle_s += time.perf_counter() - t
                if req is not None:
                    admit(req)
                elif between_steps is not None:
                    between_steps()  # a refit may be due while no request runs
                continue
            gone = [rid for rid, r in pending.items() if r.future.cancelled()]
            if gone:
                engine.abort_request(gone)
                stats.cancelled += len(gone)
                for rid in gone:
                    del pending[rid]
            if not engine.has_unfinished_requests():
                for rid in list(pending):  # should not happen: fail them rather than spin
                    _settle(pending.pop(rid).future, exc=RuntimeError("the engine dropped the request"))
                continue
            stats.max_batch = max(stats.max_batch, engine.get_num_unfinished_requests())
            t = time.perf_counter()
            outs = engine.step()
            stats.step_s += time.perf_counter() - t
            stats.steps += 1
            for o in outs:
                req = pending.pop(o.request_id, None)
                if req is None or not o.finished:
                    continue
                res = _result(generator, o)
                stats.finished += 1
                stats.generated_tokens += len(res.token_ids)
                _settle(req.future, res)
            if between_steps is not None:
                between_steps()
    except BaseException as exc:
        # the engine (or the refit poll) failed: no caller may wait forever on a future
        for req in list(pending.values()) + _drain(requests):
            _settle(req.future, exc=RuntimeError(f"the serving loop stopped: {exc!r}"))
        raise
    stats.wall_s = time.perf_counter() - t0
    return stats


def _drain(requests: RequestQueue) -> List[TokenRequest]:
    out = []
    while (req := requests.get(0)) is not None:
        out.append(req)
    return out


def _settle(fut: Future, result=None, exc: Optional[BaseException] = None) -> None:
    """Resolve a future unless its caller cancelled it meanwhile (then nobody listens)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def _result(generator, o) -> TokenResult:
    # the generator's own row: the same logprobs and weight versions as its sampler reports
    row = generator._row(o)
    c = o.outputs[0]
    return TokenResult(row.prompt_ids, row.response_ids, row.logprobs, row.text, c.finish_reason, c.stop_reason,
                       row.version_first, row.version_last)
