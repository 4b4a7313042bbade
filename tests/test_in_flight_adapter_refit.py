"""The adapter refit (trainer.lora.refit=adapter, issue 47) on the real vLLM engine: the engine
serves the student's adapter from the first request on, an adapter loaded in place between
scheduler steps reaches the requests already running, each sample reports the first and last
weight versions of its tokens, and the serving loop of multi-turn episodes samples with the
adapter (refit/adapter_refit.py, serving/loop.py).

The references are Hugging Face forwards of the tiny student with peft's adapters injected
(models/lora.py apply_lora), their B set to the adapter's: every engine log-prob is compared
with them in fp32. One engine (in this process, built with vLLM's LoRA support) serves every case;
the adapters are PEFT directories written as the trainer writes them (write_adapter_dir) and
announced on a store under the refit's ready key, as the trainer announces them."""

from __future__ import annotations

import socket
from datetime import timedelta
from types import SimpleNamespace

import pytest
from engine_memory import in_process_fraction
import torch

pytestmark = pytest.mark.slow

PROMPTS = [f"{a}+{b}=" for a in (1, 3, 5, 7) for b in (2, 4)]
SEEDS = list(range(11, 11 + len(PROMPTS)))
LORA = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=None)  # the family's default targets
SWITCH_AFTER = 3  # scheduler steps before the new adapter lands
TOL = 1e-3  # fp32 engine vs HF, as tests/test_in_flight_refit.py
MARGIN = 5e-2  # the new adapter moves the tail's log-probs by more than this (the check can fail)
PREFIX = "test/lora_inflight"


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hpc_rl.models.lora import apply_lora, eval_mode, is_adapter, write_adapter_dir
    from hpc_rl.refit.adapter_refit import engine_lora_options
    from hpc_rl.refit.vllm_engine import VLLMGenerator
    from hpc_rl.rl.inputs import resolve_model_ref

    student = resolve_model_ref("tiny:student")
    model = AutoModelForCausalLM.from_pretrained(student, torch_dtype=torch.float32)
    apply_lora(model, LORA)  # B = 0: the trainer's initial adapter
    init = {n: t.detach().clone() for n, t in model.state_dict().items() if is_adapter(n)}
    adapters = {"init": init}
    for name, seed in (("old", 1), ("new", 2)):  # non-zero B: each adapter moves the policy
        g = torch.Generator().manual_seed(seed)
        adapters[name] = {n: (torch.randn(t.shape, generator=g) * 0.5 if ".lora_B." in n else t) for n, t in init.items()}
    root = tmp_path_factory.mktemp("adapters")
    dirs = {k: write_adapter_dir(model, st, root / k, student) for k, st in adapters.items()}
    gen = VLLMGenerator(student, precision="fp32", max_model_len=128, memory_fraction=in_process_fraction(), max_num_seqs=8,
                        options=engine_lora_options(LORA))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)

    def logprobs(adapter, rows, switch=None):
        """HF log-probs of each row's response under `adapter` (None: the base). With `switch`
        (adapter, per-row boundary b): the KV cache of the prompt and the first b - 1 response tokens
        is `adapter`'s, everything after the second adapter's (what a kept KV cache serves)."""
        out = []
        with torch.no_grad(), eval_mode(model):
            for k, r in enumerate(rows):
                ids = torch.tensor([r.prompt_ids + r.response_ids])
                if switch is None:
                    _set(model, adapters["init"] if adapter is None else adapters[adapter])
                    logits = model(ids).logits[0]
                else:
                    later, cut = switch[0], len(r.prompt_ids) + switch[1][k] - 1
                    _set(model, adapters[adapter])
                    head = model(ids[:, :cut], use_cache=True)
                    _set(model, adapters[later])
                    tail = model(ids[:, cut:], past_key_values=head.past_key_values, use_cache=True)
                    logits = torch.cat([head.logits[0], tail.logits[0]])
                lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
                out.append(lp[len(r.prompt_ids) - 1:].tolist())
        return out

    state = {"gen": gen, "store": store, "dirs": dirs, "logprobs": logprobs, "refits": 0}
    yield state
    gen.close()


def _set(model, adapter) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in adapter:
                p.copy_(adapter[n])


def _announce(rig, name: str) -> int:
    """Write `name`'s ready key as the trainer's rank 0 does (refit/adapter_refit.py publish)."""
    from hpc_rl.refit.transport import ready_key

    rig["refits"] += 1
    rig["store"].set(ready_key(PREFIX, rig["refits"], 0), str(rig["dirs"][name]))
    return rig["refits"]


def _load(rig, name: str, version: int, in_flight: bool = False, recompute_kv: bool = False):
    from hpc_rl.refit.adapter_refit import receive

    return receive(rig["gen"], rig["store"], PREFIX, _announce(rig, name), version, in_flight, recompute_kv)


def _stepped(gen, between_steps, max_tokens: int = 24):
    """The prompts, past the tiny student's early stop, stepped: raw outputs (with their weight
    version spans) and rows."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=s,
                             output_kind=RequestOutputKind.FINAL_ONLY) for s in SEEDS]
    outs = gen._stepped(gen.chat_prompts(PROMPTS), params, between_steps)
    return outs, [gen._row(o) for o in outs]


def _gap(got, want, parts=None) -> float:
    """max |got - want| over every row's tokens, or over row k's slice parts[k]."""
    parts = parts or [slice(None)] * len(got)
    return max(max((abs(a - b) for a, b in zip(g[p], w[p])), default=0.0) for g, w, p in zip(got, want, parts))


def test_the_engine_serves_the_initial_adapter_from_the_first_request(rig):
    """Refit 0 (the trainer's adapter at join: B = 0) loads without moving the version; from then on
    every request carries the adapter (what a later in-place load reaches), and sampling equals the base."""
    from hpc_rl.refit.adapter_refit import ADAPTER_ID, receive
    from hpc_rl.refit.transport import ready_key

    gen = rig["gen"]
    assert gen.lora_request is None
    rig["store"].set(ready_key(PREFIX, 0, 0), str(rig["dirs"]["init"]))
    out = receive(gen, rig["store"], PREFIX, 0, None)
    assert out["version"] == 0 and gen.weight_version == 0
    assert gen.lora_request.lora_int_id == ADAPTER_ID and not gen.lora_request.load_inplace
    rows = gen.sample(gen.chat_prompts(PROMPTS), temperature=1.0, max_tokens=8, seed=SEEDS)
    assert all(r.version_first == r.version_last == 0 for r in rows)
    worst = _gap([r.logprobs for r in rows], rig["logprobs"](None, rows))
    assert worst < TOL, f"the initial (B = 0) adapter's log-probs differ from the base's by {worst}"


@pytest.mark.parametrize("recompute_kv", [True, False])
def test_an_in_flight_adapter_load_reaches_the_running_requests(rig, recompute_kv):
    """The old adapter loads between orders; the new one lands after SWITCH_AFTER scheduler steps.
    Tokens sampled before the switch have the old adapter's log-probs; those after it the new
    adapter's over a KV cache recomputed under it (recompute_kv), or over the old adapter's cache
    of the tokens before the switch (kept)."""
    gen = rig["gen"]
    v_old = gen.weight_version + 1
    _load(rig, "old", v_old)
    calls, landed = [0], {}

    def between_steps():
        calls[0] += 1
        if calls[0] == SWITCH_AFTER:
            landed.update(_load(rig, "new", v_old + 1, in_flight=True, recompute_kv=recompute_kv))

    outs, rows = _stepped(gen, between_steps)
    assert landed and landed["version"] == v_old + 1 and landed["in_flight"], "the load did not land mid-generation"
    assert all(r.version_first == v_old and r.version_last == v_old + 1 for r in rows)
    # each output's spans: [0, b) under the old adapter, [b, end) under the new one
    spans = [[(int(s.version), s.start, s.end) for s in o.outputs[0].weight_versions] for o in outs]
    assert all(len(s) == 2 and s[0][0] == v_old and s[1][0] == v_old + 1 for s in spans), spans
    cut = [s[1][1] for s in spans]
    assert all(0 < b < len(r.response_ids) for b, r in zip(cut, rows)), cut
    old, new = rig["logprobs"]("old", rows), rig["logprobs"]("new", rows)
    got = [r.logprobs for r in rows]
    before, after = [slice(0, b) for b in cut], [slice(b, None) for b in cut]
    kv = "recomputed" if recompute_kv else "kept"
    want = new if recompute_kv else rig["logprobs"]("old", rows, switch=("new", cut))
    moved, tail = _gap(new, old, after), _gap(got, want, after)
    print(f"recompute_kv={recompute_kv}: cut {cut}; before vs old {_gap(got, old, before):.2e}; after vs new "
          f"{_gap(got, new, after):.2e}, vs old {_gap(got, old, after):.2e}, vs the {kv}-KV reference {tail:.2e}; "
          f"new vs old {moved:.3f}; in-flight load {landed['refit_s']:.3f}s")
    assert _gap(got, old, before) < TOL, f"tokens before the switch differ from the old adapter's by {_gap(got, old, before)}"
    assert moved > MARGIN, f"the new adapter barely moves the tail ({moved}): the check could not fail"
    assert tail < TOL, f"tokens after the switch differ from the new adapter's ({kv} KV cache) by {tail}"
    assert _gap(got, old, after) > MARGIN, "tokens after the switch still carry the old adapter"
    if not recompute_kv:  # the kept cache really is the old adapter's (the adapters touch k_proj/v_proj)
        assert _gap(got, new, after) > 1e-2


def test_the_serving_loop_samples_with_the_adapter(rig):
    """A token request served by the episodes' loop (serving/loop.py) under the loaded adapter has
    the adapter's log-probs, not the base's, and the adapter's weight version."""
    from hpc_rl.serving.loop import RequestQueue, TokenRequest, serve

    gen = rig["gen"]
    version = gen.weight_version + 1
    _load(rig, "new", version)
    q = RequestQueue()
    prompts = [gen.tokenizer(p)["input_ids"] for p in gen.chat_prompts(PROMPTS[:4])]
    futures = [q.submit(TokenRequest(p, max_tokens=12, seed=s, ignore_eos=True)) for p, s in zip(prompts, SEEDS)]
    stats = serve(gen, q, until=lambda: True)
    assert stats.finished == 4
    res = [f.result() for f in futures]
    rows = [SimpleNamespace(prompt_ids=r.prompt_token_ids, response_ids=r.token_ids) for r in res]
    assert all(r.weight_version_first == r.weight_version_last == version for r in res)
    got = [r.logprobs for r in res]
    worst = _gap(got, rig["logprobs"]("new", rows))
    assert worst < TOL, f"served log-probs differ from the adapter's by {worst}"
    base = _gap(got, rig["logprobs"](None, rows))
    print(f"served: vs adapter {worst:.2e}, vs base {base:.3f}")
    assert base > MARGIN, f"served log-probs are the base's (max diff {base}): the adapter was not used"
