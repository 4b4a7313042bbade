"""Settings this version of the runtime cannot honour, refused instead of silently ignored.

`validate` (validate.py) finds configs that are wrong: always fatal, also for the dry run.
`unsupported` finds configs that are right but ask for something the runtime of this
version does not do (Megatron, tensor/context/expert/pipeline parallel training, a
reference-KL penalty). Real launches (launcher=local|slurm, a hand-submitted
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

from .errors import ConfigError, Violation
from .keys import resolve
from .schema import EnvConfig, RunConfig


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

    def check(self, cfg: RunConfig) -> List[Violation]:
        if cfg.run.program not in self.programs:
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


# model.architecture values the fsdp2 backend loads (Hugging Face model_type; the classes are
# hpc_rl.models.fsdp2.SUPPORTED_ARCHITECTURES, which tests/test_config_keys.py compares).
ARCHITECTURES = ("llama", "qwen2")
_ENV_PRECISION = EnvConfig.precision  # the schema default: env ranks never read it

_DIMS = {"tp": "tensor parallelism", "cp": "context parallelism", "ep": "expert parallelism",
         "etp": "expert tensor parallelism", "pp": "pipeline parallelism"}
_FSDP2 = ("{who}: the fsdp2 backend of this version is 1-D data parallel (each rank holds a shard "
          "of the whole model); it has no {dim}, so this setting would be ignored")


def _above_one(value: Any) -> bool:
    return value is not None and value > 1


def _parallel_rules(section: str, problem: str, fix: str) -> List[Rule]:
    return [Rule(f"{section}.parallel.{dim}", _above_one, problem.format(dim=name), fix, example=2)
            for dim, name in _DIMS.items()]


RULES: List[Rule] = [
    Rule("trainer.backend", lambda v: v == "megatron",
         "the Megatron-core backend is not in this version; the trainer would run FSDP2 instead",
         "set trainer.backend=fsdp2", example="megatron"),
    *_parallel_rules("trainer", _FSDP2.replace("{who}", "trainer"),
                     "set {key}=1 (the data parallel size is derived from the trainer's ranks)"),
    Rule("trainer.sequence_parallel", bool,
         "sequence parallelism splits activations over tensor parallel ranks, which the fsdp2 backend "
         "of this version does not have", "set trainer.sequence_parallel=false", example=True),
    *_parallel_rules("teachers.*", _FSDP2.replace("{who}", "teachers (the fsdp2 backend, inference only)"),
                     "set {key}=1 (the data parallel size is derived from the teacher group's ranks)"),
    *_parallel_rules("generator",
                     "the RL program runs one vLLM engine per generator rank; an engine spanning several "
                     "ranks ({dim}) cannot be launched yet",
                     "set {key}=1 (more generator ranks give more engines)"),
    # Env ranks are independent CPU workers running verifiers: no model is split or loaded.
    *_parallel_rules("env", "env ranks run verifiers, each on its own; nothing is split by {dim}",
                     "set {key}=1 (for more env ranks raise env.nodes or env.tasks_per_node)"),
    Rule("env.precision", lambda v: v != _ENV_PRECISION,
         "env ranks run verifiers and load no model, so a precision would be ignored",
         f"leave env.precision at {_ENV_PRECISION!r} (remove it from the recipe)", example="fp32"),
    Rule("model.architecture", lambda v: v not in ARCHITECTURES,
         f"the fsdp2 backend of this version loads {' and '.join(ARCHITECTURES)} checkpoints only "
         "(Hugging Face LlamaForCausalLM, Qwen2ForCausalLM)",
         f"use a checkpoint of one of {list(ARCHITECTURES)} and name it in model.architecture",
         example="nemotron_h"),
    Rule("algo.ref_kl_coef", lambda v: v != 0,
         "this version has no reference model and no KL penalty against it; the coefficient would be ignored",
         "set algo.ref_kl_coef=0.0", example=0.1),
]

FACTS: List[Fact] = [
    Fact("cluster.max_nodes", "validation: the job's nodes must fit in the cluster", example=10),
    Fact("cluster.usable_nodes_per_domain", "validation: block-topology segments and EP spans fit in one "
         "NVLink domain's usable nodes", example=2),
    Fact("cluster.nvlink_domain_nodes", "validation: a domain's usable nodes are at most its nodes", example=8),
    Fact("model.num_experts", "validation: each role's expert parallel size divides the experts", example=7),
]


def unsupported(cfg: RunConfig) -> List[Violation]:
    """Every setting of `cfg` this version of the runtime cannot honour (empty: it can run)."""
    return [v for rule in RULES for v in rule.check(cfg)]


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
