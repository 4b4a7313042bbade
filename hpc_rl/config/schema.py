"""The typed schema of a run: one dataclass per config group.

Hydra composes YAML files (recipes/) on top of these defaults; `hpc_rl.config.convert`
turns the composed mapping into these classes, collecting every type error and unknown
key instead of stopping at the first; `hpc_rl.config.validate` then checks the rules that
span fields (parallel sizes against GPUs, routing targets, batch divisibility, ...).

Every class derives from `Traced` so that runtime reads of its fields are recorded
(hpc_rl/config/trace.py): the evidence that each key is honoured.

A field whose value is `None` by default is either optional or derived by the planner
(for example `parallel.dp`, `segment_size`), as its comment says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional

from .trace import Traced

# The experiment loggers `logger` may list; hpc_rl/observe/loggers.py registers one backend
# per name (tests/test_observe.py checks that they agree).
LOGGER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow")
Precision = Literal["bf16", "fp16", "fp32"]


@dataclass
class RunSection(Traced):
    """Where a run lives and how it is seeded."""

    name: Optional[str] = None  # defaults to the recipe's name
    root_dir: str = "runs"  # run directories are created under this
    dir: Optional[str] = None  # an explicit run directory (resume, tests); else <root_dir>/<name>-<time>
    seed: int = 1234
    max_steps: int = 100
    # What every rank runs after rendezvous: the RL loop, or a wiring check of the job's
    # process groups (rendezvous, per-role all-reduce, trainer -> generator/teacher broadcast).
    program: Literal["rl", "comm_check"] = "rl"
    rendezvous_timeout_s: int = 300  # a rank that cannot meet its peers by then fails, naming them


@dataclass
class ClusterConfig(Traced):
    """The machines: GPUs per node and how NVLink domains and switches group nodes."""

    name: str = "local"
    gpus_per_node: int = 0  # 0: CPU processes (this laptop-sized machine, the local Slurm)
    cpus_per_node: int = 2
    # Nodes joined by one NVLink domain (an NVL72 rack: 18; an H100 node: 1) and how many
    # of them a job may use (NVL72 keeps 2 spares per rack, so segments are at most 16).
    nvlink_domain_nodes: int = 1
    usable_nodes_per_domain: int = 1
    # Nodes under one leaf switch on tree fabrics; bounds --switches segments. None: no limit.
    leaf_switch_nodes: Optional[int] = None
    # How Slurm knows the fabric: block (NVL72 racks, Slurm >= 23.11), tree (switches), none.
    topology: Literal["block", "tree", "none"] = "none"
    slurm_version: str = "22.05"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    max_nodes: Optional[int] = None  # nodes the cluster (or partition) has; None: unknown
    exclusive: bool = True  # jobs take whole nodes (GPU clusters); the local clusters share theirs
    # Where NVLink domains are (see hpc_rl/plan/topology.py for the order of sources):
    domains: Dict[str, List[str]] = field(default_factory=dict)  # domain -> node names / hostlists
    domain_pattern: Optional[str] = None  # regex with (?P<domain>...) over host names
    # Fail before training when no trusted source places the nodes (NVL72: EP across racks stalls).
    require_topology: bool = False


@dataclass
class SlurmOptions(Traced):
    """Options of the heterogeneous sbatch script that are not the cluster's facts."""

    job_name: Optional[str] = None  # None: hpc_rl-<recipe>
    time: str = "04:00:00"
    reservation: Optional[str] = None
    dependency: Optional[str] = None  # e.g. afterok:1234
    requeue: bool = True
    signal_grace_s: int = 300  # USR1 to the batch shell this long before the time limit
    switches_wait: str = "00:10:00"  # tree topology: how long to wait for a one-switch placement
    python: str = "python3"  # interpreter on the compute nodes (or inside the container)


@dataclass
class LauncherConfig(Traced):
    name: Literal["slurm", "local", "dry_run"] = "dry_run"
    plan_out: Optional[str] = None  # also write plan.json here
    wait: bool = False  # slurm: block with a live status display instead of returning
    poll_s: float = 2.0  # how often job state is polled while waiting
    kill_grace_s: float = 10.0  # when a role fails: seconds between SIGTERM and SIGKILL of the others
    slurm: SlurmOptions = field(default_factory=SlurmOptions)


@dataclass
class ModelConfig(Traced):
    """The student model. `path` is what ranks load; validation checks `num_experts` against
    expert parallel sizes; support.py refuses an `architecture` this version cannot load;
    `name` and `params_b` are labels (support.FACTS)."""

    name: str = "tiny-llama"
    path: Optional[str] = None  # HF checkpoint directory or hub name
    architecture: str = "llama"
    params_b: Optional[float] = None  # total parameters, billions
    num_experts: Optional[int] = None  # routed experts per MoE layer; None for dense models


@dataclass
class ParallelConfig(Traced):
    """Parallel sizes of one role. tp*cp*pp*dp must equal the role's GPUs (or CPU ranks)."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    dp: Optional[int] = None  # None: derived as GPUs / (tp*cp*pp)
    # Expert tensor parallel. Fine-grained MoE trains with 1 (Megatron's own default would be
    # tp); the expert mesh etp*ep*edp*pp must tile the role's GPUs.
    etp: int = 1


@dataclass
class RoleResources(Traced):
    """Fields every role shares: where it runs and how it is split."""

    nodes: int = 1
    gpus_per_node: Optional[int] = None  # None: the cluster's gpus_per_node
    tasks_per_node: Optional[int] = None  # None: one task per GPU (or 1 on CPU clusters)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Nodes that must share one NVLink domain / leaf switch. None: derived from the layout
    # (trainer: the EP span, generator: one vLLM instance, teacher: the whole group).
    segment_size: Optional[int] = None
    precision: Precision = "bf16"


@dataclass
class OptimizerConfig(Traced):
    name: Literal["adamw", "adam"] = "adamw"
    lr: float = 1e-6
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0


@dataclass
class SchedulerConfig(Traced):
    name: Literal["constant_with_warmup"] = "constant_with_warmup"
    warmup_steps: int = 0
    warmup_start_lr: float = 0.0  # linear ramp from this to optimizer.lr over warmup_steps


@dataclass
class TrainerConfig(RoleResources):
    backend: Literal["fsdp2", "megatron"] = "fsdp2"
    sequence_parallel: bool = False
    max_seq_len: int = 1024
    global_batch_size: int = 8
    micro_batch_size: int = 1
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass
class SamplingConfig(Traced):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    # vLLM's min_tokens: EOS and stop strings are ignored until this many tokens are sampled
    min_tokens: int = 0
    stop: List[str] = field(default_factory=list)


@dataclass
class GeneratorConfig(RoleResources):
    backend: Literal["vllm"] = "vllm"
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None  # None: trainer.max_seq_len
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class TeacherConfig(RoleResources):
    """An inference-only teacher. Aliases naming the same checkpoint share one rank group."""

    checkpoint: str = ""


@dataclass
class EnvConfig(RoleResources):
    """Reward environments and verifiers; CPU-only unless the recipe gives them GPUs."""

    nodes: int = 1
    gpus_per_node: Optional[int] = 0
    tasks_per_node: Optional[int] = 1


@dataclass
class RoutingConfig(Traced):
    """Which teacher scores a sample: its agent (task) name -> a teacher alias."""

    default: Optional[str] = None  # alias for agents no slot lists
    strict: bool = False  # reject agents no slot lists instead of using the default
    # alias -> agent names; a trailing '*' matches a prefix (swe_pivot_*)
    agents: Dict[str, List[str]] = field(default_factory=dict)


@dataclass
class OPDConfig(Traced):
    adv_clip: float = 20.0  # advantages clipped to [-adv_clip, adv_clip]
    # Subtract the batch's mean advantage over trained tokens (after clipping). A constant
    # baseline leaves the expected policy gradient unchanged and removes the large common
    # offset (wrong tokens all sit near log p_teacher = -10), which on small batches
    # otherwise drowns the signal. "none" is the plain A_t = sg[log p_T - log p_S].
    baseline: Literal["none", "token_mean"] = "none"


@dataclass
class GRPOConfig(Traced):
    leave_one_out: bool = False
    normalize_std: bool = True


@dataclass
class LossConfig(Traced):
    kind: Literal["ppo", "reinforce"] = "ppo"
    ratio_clip_low: float = 0.2
    ratio_clip_high: float = 0.2


@dataclass
class MismatchConfig(Traced):
    """Correction for generation (vLLM) vs trainer logprob mismatch."""

    kind: Literal["none", "tis", "icepop"] = "tis"
    min: float = 0.2
    max: float = 5.0
    # mask a sequence whose mean multiplicative probability error exceeds this; None: off
    seq_logprob_error_threshold: Optional[float] = None


@dataclass
class AsyncConfig(Traced):
    enabled: bool = False
    max_trajectory_age_steps: int = 1
    in_flight_weight_updates: bool = False
    # After an in-flight refit, drop the running requests' KV cache so their prompts and
    # tokens so far are prefilled again under the new weights (false: keep the cache built
    # by the old weights, as NeMo RL's default).
    recompute_kv_cache_after_weight_updates: bool = False


@dataclass
class AlgoConfig(Traced):
    name: Literal["mopd", "grpo"] = "mopd"
    prompts_per_step: int = 8
    generations_per_prompt: int = 1
    ref_kl_coef: float = 0.0
    opd: OPDConfig = field(default_factory=OPDConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    async_rollout: AsyncConfig = field(default_factory=AsyncConfig)


@dataclass
class DataConfig(Traced):
    """The prompts. A JSONL file (rows as hpc_rl/data/dataset.py describes), or synthetic
    tasks generated into the run directory when `path` is unset."""

    path: Optional[str] = None
    tasks: List[str] = field(default_factory=lambda: ["addition_1digit", "multiplication_1digit"])
    samples_per_task: int = 512  # generated rows per task (path unset)
    skip_invalid: bool = False  # skip (and count) malformed rows instead of failing at launch
    shuffle: bool = True
    # Held-out prompts per task scored at the start and the end of the run (greedy accuracy,
    # reverse KL to the routed teacher); 0 turns the evaluation off.
    eval_prompts_per_task: int = 32


@dataclass
class CheckpointConfig(Traced):
    every_steps: int = 10
    keep_last: int = 2
    keep_every: Optional[int] = None  # also keep every N-th step's checkpoint
    dir: Optional[str] = None  # None: <run dir>/checkpoints
    # Resume from the newest complete checkpoint under dir; false starts fresh, ignoring them.
    resume: bool = True
    export_final: bool = True  # the trained weights as a Hugging Face checkpoint in <run dir>/final_hf


@dataclass
class ContainerConfig(Traced):
    image: Optional[str] = None  # enroot .sqsh path (must start with / or ./) or registry image
    mounts: List[str] = field(default_factory=list)
    workdir: Optional[str] = None


@dataclass
class FaultConfig(Traced):
    """Failure injection for chaos tests: make one rank fail on purpose."""

    # "<role>:<rank>[:<how>]", e.g. "generator:0" or "teacher/general:0:freeze". how: raise
    # (default, at start-up), freeze (SIGSTOP itself: a hung node, only heartbeats see it),
    # kill (SIGKILL itself), hang (blocks, beating), stall<N> (sleeps N s: a straggler), each
    # optionally at a step: "generator:0:kill@3". See hpc_rl/runtime/faults.py.
    inject_failure: Optional[str] = None
    # Dead ranks: every rank beats through the rendezvous store; one silent this long is dead
    # and every other rank exits (0 turns heartbeats off).
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    # Stuck ranks (alive, beating, but making no progress, e.g. a hung collective): when no
    # rank's phase changes for this long, the ranks furthest behind are named and the job
    # aborts. 0: off. Set it above the longest phase (generation of long rollouts).
    progress_timeout_s: float = 0.0
    max_restarts: int = 3  # requeues allowed after failures or time limits; then the job ends failed
    # No checkpoint save starts unless it can finish this many seconds before the job's end.
    save_margin_s: float = 30.0


@dataclass
class RefitConfig(Traced):
    """Trainer -> generator weight transfer (the reshard plan, hpc_rl/refit)."""

    # A refit that has not finished by then aborts on every side and names the peer that
    # did not arrive: the job fails (and requeues) instead of hanging.
    timeout_s: float = 120.0
    bucket_mb: int = 64  # bytes in flight per bucket of the plan (two buckets overlap)
    transport: Literal["torch", "nixl"] = "torch"  # torch: NCCL on GPUs, gloo on CPUs


@dataclass
class LoggingConfig(Traced):
    """Settings of the experiment loggers named in `logger` (hpc_rl/observe/loggers.py).

    A setting whose logger is not on is refused by validation (nothing would read it).
    Credentials are never config keys: W&B and MLflow read them from the environment
    (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD), so they
    never reach config.yaml, rendered scripts or logs."""

    tensorboard_dir: Optional[str] = None  # this run's event files; None: <run dir>/tensorboard
    wandb_project: str = "hpc_rl"
    wandb_entity: Optional[str] = None  # None: the API key's default entity
    # offline: W&B writes <run dir>/wandb/ and `wandb sync` uploads it later (compute nodes
    # often cannot reach the internet); online: streams to the W&B server while it runs
    wandb_mode: Literal["offline", "online"] = "offline"
    mlflow_tracking_uri: Optional[str] = None  # None: a file store in <run dir>/mlruns
    mlflow_experiment: str = "hpc_rl"


@dataclass
class RunConfig(Traced):
    recipe: Optional[str] = None  # set from the +recipe= choice
    run: RunSection = field(default_factory=RunSection)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    teachers: Dict[str, TeacherConfig] = field(default_factory=dict)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    ft: FaultConfig = field(default_factory=FaultConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    # Where trainer rank 0 sends metrics: jsonl (metrics.jsonl, always on), tensorboard,
    # wandb, mlflow; the same metric names and step axis in each (hpc_rl/observe/metrics.py).
    logger: List[str] = field(default_factory=lambda: ["jsonl"])
    logging: LoggingConfig = field(default_factory=LoggingConfig)
