"""In-flight weight updates on the real vLLM engine (#15): a refit lands between scheduler
steps while requests run, each sample reports the first and last weight versions of its
tokens, and `recompute_kv_cache_after_weight_updates` really recomputes the running
requests' KV cache under the new weights (checked against a Hugging Face forward of them).

One engine (in this process) serves every case; the trainer side is `refit_in_process`'s
endpoint, sending from a thread while the engine loads."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from engine_memory import in_process_fraction
import torch

pytestmark = pytest.mark.slow

PROMPTS = [f"{a}+{b}=" for a in (1, 3, 5, 7) for b in (2, 4)]
SEEDS = list(range(11, 11 + len(PROMPTS)))
SWITCH_AFTER = 3  # scheduler steps before the refit lands: a few tokens of every request are old weights'
TAIL = 6  # tokens from here on are sampled after the switch (requests that ran that long)


@pytest.fixture(scope="module")
def rig():
    import torch.distributed as dist
    from safetensors.torch import load_file

    from hpc_rl.refit.vllm_engine import VLLMGenerator, refit_in_process
    from hpc_rl.rl.inputs import resolve_model_ref

    student, teacher = resolve_model_ref("tiny:student"), resolve_model_ref("tiny:teacher_add")
    gen = VLLMGenerator(student, precision="fp32", max_model_len=128, memory_fraction=in_process_fraction(), max_num_seqs=8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)
    own = load_file(str(next(Path(student).glob("*.safetensors"))))
    other = load_file(str(next(Path(teacher).glob("*.safetensors"))))
    _, endpoint = refit_in_process(gen, store, port, own, 0, "test/inflight")  # join the refit group once
    return {"gen": gen, "endpoint": endpoint, "own": own, "other": other, "teacher": teacher}


def _sample_with_switch(rig, state, version: int, recompute_kv: bool, ignore_eos: bool = False):
    """Sample the prompts; after SWITCH_AFTER scheduler steps `state` lands as `version`."""
    from hpc_rl.refit.session import whole_tensor_sources

    gen, ep = rig["gen"], rig["endpoint"]
    calls, landed = [0], {}

    def between_steps():
        calls[0] += 1
        if calls[0] != SWITCH_AFTER:
            return
        ep.set_sources(whole_tensor_sources({k: v.to(torch.float32) for k, v in state.items()}, 0))
        sender = threading.Thread(target=ep.run, args=(120.0,))
        sender.start()
        landed.update(gen.refit_in_flight(version, 120.0, recompute_kv))
        sender.join()

    if ignore_eos:  # the tiny student answers in about 3 tokens: run past its stop for long tails
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=0, seed=s,
                                 output_kind=RequestOutputKind.FINAL_ONLY) for s in SEEDS]
        rows = [gen._row(o) for o in gen._stepped(gen.chat_prompts(PROMPTS), params, between_steps)]
    else:
        rows = gen.sample(gen.chat_prompts(PROMPTS), temperature=1.0, max_tokens=32, seed=SEEDS,
                          between_steps=between_steps)
    assert landed and landed["version"] == version, "the refit did not land during sampling"
    return rows


def _hf_logprobs(path: str, rows):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            tgt = ids[0, 1:]
            out.append(lp.gather(-1, tgt[:, None])[:, 0][len(r.prompt_ids) - 1:].tolist())
    return out


def test_a_refit_lands_mid_generation_and_each_sample_reports_both_versions(rig):
    rows = _sample_with_switch(rig, rig["other"], 1, recompute_kv=False)
    pairs = [(r.version_first, r.version_last, len(r.response_ids)) for r in rows]
    # the tiny model stops early on some prompts: those end before the switch, on version 0
    assert all(r.version_first == 0 and r.version_last in (0, 1) for r in rows), pairs
    assert any(r.version_last == 1 for r in rows), pairs
    assert all(r.version_last == 1 for r in rows if len(r.response_ids) > SWITCH_AFTER + 1), pairs
    plain = rig["gen"].sample(rig["gen"].chat_prompts(PROMPTS[:2]), max_tokens=4, seed=[1, 2])  # llm.generate, no refit
    assert all(r.version_first == r.version_last == 1 for r in plain)
    # back to the student's weights for the next case, between collections
    _sample_with_switch(rig, rig["own"], 2, recompute_kv=False)


@pytest.mark.parametrize("recompute_kv", [True, False])
def test_recompute_kv_cache_makes_the_tail_match_the_new_weights(rig, recompute_kv, request):
    # The engine serves the student (version 2 after the previous test, or 0 when run alone);
    # the teacher's weights land mid-generation. Tokens sampled after the switch depend on
    # the prompt's KV cache: recomputed, it is the teacher's own, and vLLM's logprobs equal a
    # Hugging Face forward of the teacher over the whole sequence; kept, it is the student's.
    version = rig["gen"].weight_version + 1
    rows = _sample_with_switch(rig, rig["other"], version, recompute_kv, ignore_eos=True)
    assert all(r.version_last == version and len(r.response_ids) == 32 for r in rows)
    hf = _hf_logprobs(rig["teacher"], rows)
    diffs = [abs(a - b) for r, ref in zip(rows, hf) if r.version_last == version
             for a, b in zip(r.logprobs[TAIL:], ref[TAIL:])]
    assert len(diffs) >= 50, "too few tokens after the switch to compare"
    worst = max(diffs)
    if recompute_kv:
        assert worst < 1e-3, f"recomputed KV cache: tail logprobs differ from the new weights' by {worst}"
    else:
        assert worst > 1e-2, f"kept KV cache: the tail should carry the old weights' prompt cache, max diff {worst}"
    _sample_with_switch(rig, rig["own"], version + 1, recompute_kv=False)  # the student again
