"""Validation of the trainer's memory keys (`trainer.logprob_chunk_tokens`,
`trainer.logprob_batch_tokens`, `trainer.megatron.*`), beside validate.py. Their refusals on a
backend that does not read them (and the combinations a backend cannot run, such as
trainer.cpu_offload with tensor parallel) are support.py's and support_memory.py's rules."""

from __future__ import annotations

from typing import List

from .errors import check_positive, Violation
from .schema_trainer import RECOMPUTE_MODULES

_M = "trainer.megatron"


def check_memory(out: List[Violation], t) -> None:
    # None: the backend's default; 0: off (whole logits / every row in one forward)
    if t.logprob_chunk_tokens is not None:
        check_positive(out, "trainer.logprob_chunk_tokens", t.logprob_chunk_tokens, minimum=0)
    if t.logprob_batch_tokens is not None:
        check_positive(out, "trainer.logprob_batch_tokens", t.logprob_batch_tokens, minimum=0)
    if t.backend == "megatron":  # on fsdp2 support.py refuses every trainer.megatron key
        _check_recompute(out, t)
        _check_offload(out, t)


def _check_recompute(out: List[Violation], t) -> None:
    """What megatron-core's TransformerConfig asserts on (or would ignore), before submission;
    what depends on the checkpoint's layers is models/megatron/memory.py recompute_problems."""
    m, g = t.megatron, t.megatron.recompute_granularity
    if t.activation_checkpointing and g != "none":
        out.append(Violation(f"{_M}.recompute_granularity", g,
                             "trainer.activation_checkpointing=true already asks megatron for full recompute of every "
                             "layer; two settings of one thing",
                             "set trainer.activation_checkpointing=false to use trainer.megatron.recompute_*, or leave "
                             "trainer.megatron.recompute_granularity=none"))
    if g == "full":
        if m.recompute_method is None:
            out.append(Violation(f"{_M}.recompute_method", None, "full recompute needs a method (megatron-core asserts it)",
                                 "set trainer.megatron.recompute_method=uniform (every layer, in groups) or block "
                                 "(the first layers of each stage)"))
        if m.recompute_num_layers is None:
            out.append(Violation(f"{_M}.recompute_num_layers", None, "full recompute needs the layers per group (uniform) "
                                 "or per stage (block) (megatron-core asserts it)",
                                 "set trainer.megatron.recompute_num_layers, e.g. 1 with recompute_method=uniform"))
        else:
            check_positive(out, f"{_M}.recompute_num_layers", m.recompute_num_layers)
    else:  # selective or none: megatron-core requires num_layers unset with selective, ignores the method
        for key, value in ((f"{_M}.recompute_method", m.recompute_method),
                           (f"{_M}.recompute_num_layers", m.recompute_num_layers)):
            if value is not None:
                out.append(Violation(key, value, f"only full recompute reads it; with recompute_granularity={g} it "
                                     "would be ignored (megatron-core refuses recompute_num_layers with selective)",
                                     f"leave {key} unset, or set trainer.megatron.recompute_granularity=full"))
    modules = m.recompute_modules
    if modules is not None and g != "selective":
        out.append(Violation(f"{_M}.recompute_modules", modules, f"only selective recompute reads it; with "
                             f"recompute_granularity={g} it would be ignored",
                             "leave trainer.megatron.recompute_modules unset, or set "
                             "trainer.megatron.recompute_granularity=selective"))
    elif modules is not None:
        unknown = [x for x in modules if x not in RECOMPUTE_MODULES]
        names = ", ".join(RECOMPUTE_MODULES)
        if unknown:
            out.append(Violation(f"{_M}.recompute_modules", modules, f"{unknown}: megatron-core's selective recompute "
                                 f"modules this mapping passes on are {names} (mla_up_proj: no loaded architecture "
                                 "has multi-latent attention)",
                                 "list modules from those, or leave trainer.megatron.recompute_modules unset (core_attn)"))
        elif not modules:
            out.append(Violation(f"{_M}.recompute_modules", modules, "an empty list: selective recompute of nothing",
                                 "list modules to recompute, or leave trainer.megatron.recompute_modules unset (core_attn)"))


def _check_offload(out: List[Violation], t) -> None:
    m, f = t.megatron, t.megatron.optimizer_offload_fraction
    if m.optimizer_cpu_offload and t.optimizer.name != "adamw":
        out.append(Violation(f"{_M}.optimizer_cpu_offload", True,
                             f"megatron-core's CPU optimizer is AdamW only (it asserts decoupled weight decay); "
                             f"trainer.optimizer.name={t.optimizer.name} adds the decay to the gradient",
                             "set trainer.optimizer.name=adamw, or trainer.megatron.optimizer_cpu_offload=false"))
    if not 0.0 < f <= 1.0:
        out.append(Violation(f"{_M}.optimizer_offload_fraction", f, "a share of the optimizer's parameters, in (0, 1]",
                             "set trainer.megatron.optimizer_offload_fraction to a number in (0, 1], e.g. 1.0"))
    elif f != 1.0 and not m.optimizer_cpu_offload:
        out.append(Violation(f"{_M}.optimizer_offload_fraction", f,
                             "only read with trainer.megatron.optimizer_cpu_offload=true; it would be ignored",
                             "set trainer.megatron.optimizer_cpu_offload=true, or leave the fraction at 1.0"))
