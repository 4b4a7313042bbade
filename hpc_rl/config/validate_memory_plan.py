"""Validation of the memory-plan keys, beside validate.py: the GPU's (`cluster.gpu_memory_gib`,
`cluster.gpu_memory_headroom`) and the model's planning shape (`model.shape`). Whether each role
fits is config/memory_fit.py's check (launches refuse a role that does not; the dry run lists it).
The trainer's memory keys are validate_memory.py's."""

from __future__ import annotations

from typing import List

from .errors import Violation, check_positive
from .schema import RunConfig

# |shape's parameters / model.params_b - 1| above this: one of the two is wrong
PARAMS_TOLERANCE = 0.1


def check_gpu_memory(out: List[Violation], cfg: RunConfig) -> None:
    cl = cfg.cluster
    if cl.gpu_memory_gib is not None and cl.gpu_memory_gib <= 0:
        out.append(Violation("cluster.gpu_memory_gib", cl.gpu_memory_gib, "must be positive (GiB per GPU)",
                             "set it to torch.cuda.get_device_properties(0).total_memory / 2**30, or null (unknown)"))
    if cl.gpu_memory_gib is not None and cl.gpus_per_node == 0:
        out.append(Violation("cluster.gpu_memory_gib", cl.gpu_memory_gib, f"the cluster {cl.name!r} has no GPUs "
                             "(cluster.gpus_per_node=0): there is no GPU memory to plan against",
                             "set cluster.gpu_memory_gib=null on CPU clusters"))
    if not 0.0 <= cl.gpu_memory_headroom < 1.0:
        out.append(Violation("cluster.gpu_memory_headroom", cl.gpu_memory_headroom, "must lie in [0, 1): the share of "
                             "each GPU kept free of planned tensors", "e.g. cluster.gpu_memory_headroom=0.1"))


def check_memory_keys(out: List[Violation], cfg: RunConfig) -> None:
    check_gpu_memory(out, cfg)
    check_shape(out, cfg)


def check_shape(out: List[Violation], cfg: RunConfig) -> None:
    """model.shape: positive sizes, Nemotron-H's layer letters, and, when the sizes describe a
    model.architecture model, a parameter count within PARAMS_TOLERANCE of model.params_b. Sizes
    that do not describe one (a recipe's shape with another architecture set on the command line)
    leave the plan without memory figures, which the dry run says (plan/memory_report.py)."""
    from hpc_rl.memory.shape import MIXERS, ShapeError, from_hf, params

    from .memory_inputs import checkpoint_config, shape_section

    s, bad = cfg.model.shape, []
    for name in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                 "moe_latent_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"):
        value = getattr(s, name)
        if value is not None:
            check_positive(bad, f"model.shape.{name}", value)
    pattern = s.hybrid_override_pattern
    if pattern is not None and (not pattern or set(pattern) - set(MIXERS)):
        bad.append(Violation("model.shape.hybrid_override_pattern", pattern, f"one letter per layer, each one of {MIXERS}: "
                             "M Mamba-2, * attention, - dense MLP, E MoE", "e.g. model.shape.hybrid_override_pattern='M*M-'"))
    out.extend(bad)
    section = shape_section(cfg)
    if section is None or bad or checkpoint_config(cfg.model.path) is not None:
        return  # the student's own config.json sizes the plan
    try:
        total = params(from_hf(section)).total
    except ShapeError:
        return
    b = cfg.model.params_b
    if b and abs(total / (b * 1e9) - 1) > PARAMS_TOLERANCE:
        out.append(Violation("model.shape", f"{total / 1e9:.1f}B parameters",
                             f"model.params_b says {b}B: one of the two is wrong (more than {PARAMS_TOLERANCE:.0%} apart)",
                             "correct model.shape's sizes or model.params_b"))
