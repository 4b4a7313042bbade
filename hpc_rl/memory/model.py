"""The plan-time memory model: bytes per GPU (or CPU rank) of one role, from a model shape and
the role's settings. Pure arithmetic, no torch; config/memory_inputs.py builds the inputs from a
RunConfig, plan/memory_report.py prints the result, config/memory_fit.py refuses what does not fit.

Every figure follows from what the code keeps, not from a fitted curve:

- fsdp2 (models/fsdp2.py): fp32 master weights (4 B/param) sharded over dp x cp and split by tp
  (routed experts over ep instead), fp32 gradients (4 B), Adam's two fp32 moments (8 B); the
  optimizer step's temporaries (CUDA: torch's foreach Adam makes one fp32 copy of every local
  parameter for sqrt(v); CPU: the single-tensor path, two copies of the largest tensor); FSDP2's
  unsharded copies in the compute dtype (two blocks, and the root's embedding and head). The
  backward's peak holds either every block's saved activations with the head's backward, or every
  gradient with one block's backward (gradients are allocated as the activations are freed).
- megatron (models/megatron/config_map.py): weights in the compute dtype, fp32 main gradients
  (ddp_kwargs grad_reduce_in_fp32=True, a persistent buffer), the distributed optimizer's fp32
  master weights and moments (12 B/param) sharded over dp x cp (routed experts: over the expert
  data-parallel ranks), vocab-parallel fp32 logits of the whole micro-batch
  (models/megatron/vocab_parallel.py). Not measured: megatron-core has no CPU path here.
- teachers: weights only (fsdp2 loads them in fp32), a no-grad forward's working set.
- the generator (vLLM): weights in its dtype split over tp, the start-up profile forward of
  max_num_batched_tokens tokens (refit/vllm_engine.py: 16384 on GPUs, max_num_seqs x max_model_len on CPU),
  the sampler's logits; the KV cache is what remains of gpu_memory_utilization.

Saved activations per token and mixer are the tensors autograd keeps (module docstrings of
`_saved`); a block's input is kept once per block. With activation checkpointing (recompute)
only the block inputs stay, plus one block's full set while it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from .shape import Shape, params as count_params

GiB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# models/chunked_logprobs.py CHUNK_LOGIT_ELEMENTS: an unset trainer.logprob_chunk_tokens keeps a
# chunk at this many logits per rank (tests/test_memory_model.py holds the two equal)
CHUNK_LOGIT_ELEMENTS = 1 << 26
# refit/vllm_engine.py engine_kwargs: max_num_batched_tokens = max(max_num_seqs x max_model_len, this)
MIN_BATCHED_TOKENS = 2048
# refit/vllm_engine.py GPU_BATCHED_TOKENS (a number here: this module imports no engine code;
# tests/test_memory_model.py holds the two equal)
GPU_BATCHED_TOKENS = 16384


@dataclass(frozen=True)
class Setup:
    """One role's settings, as the memory model reads them."""

    kind: str  # trainer | teacher | generator
    backend: str  # fsdp2 | megatron | vllm
    precision: str  # the compute dtype: fp32 | bf16 | fp16
    parallel: Dict[str, int]  # tp, cp, ep, etp, pp, dp
    device: str = "gpu"  # gpu | cpu: the optimizer step's temporaries differ
    sequence_parallel: bool = False
    train_tokens: int = 0  # tokens of one train micro-batch on one data-parallel rank (before cp)
    logprob_tokens: int = 0  # tokens of one no-grad log-prob forward (before cp)
    chunk_tokens: Optional[int] = None  # fsdp2's head chunk: None sized by the vocabulary, 0 whole logits
    recompute: bool = False  # activation checkpointing / megatron full recompute
    offload: bool = False  # optimizer state (megatron) or parameters, gradients and state (fsdp2) on the CPU
    # the generator
    gpu_memory_utilization: float = 0.0
    max_model_len: int = 0
    max_num_seqs: int = 0
    kv_dtype_bytes: int = 0  # 0: the compute dtype's
    # the trainer with LoRA (trainer.lora): the adapters' parameters (memory/lora.py; 0: full fine-tuning)
    lora_params: int = 0
    gpu_bytes: Optional[int] = None  # the GPU's memory (the generator's budget is a share of it)


@dataclass(frozen=True)
class RoleMemory:
    """Bytes per GPU at the role's peak. `parts` sum to `peak` (the phase named by `phase`);
    `activations_recompute` / `activations_full` are the saved activations with and without
    activation checkpointing (training roles)."""

    parts: Dict[str, int]
    phase: str
    activations_full: int = 0
    activations_recompute: int = 0
    kv_tokens: int = 0  # the generator: tokens its KV cache holds (attention layers)
    kv_minimum: int = 0  # the generator: one max_model_len sequence's cache (vLLM refuses to start without it)
    notes: Tuple[str, ...] = field(default_factory=tuple)
    phases: Dict[str, int] = field(default_factory=dict)  # the trainer: each phase's total (the peak is the largest)

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    @property
    def required(self) -> int:
        """What must fit: the peak; for the generator everything but the KV cache, plus one
        sequence's (the KV cache takes the rest of its share)."""
        return self.peak - self.parts.get("kv_cache", 0) + self.kv_minimum


def _div(n: int, d: int) -> int:
    return -(-n // max(d, 1))


def _saved(s: Shape, mixer: str, a: int, setup: Setup) -> float:
    """Bytes per token one mixer keeps for the backward, on one rank.

    - norm: transformers' RMSNorm keeps its input (in fp32: an fp32 copy below fp32), the
      normalised input before the weight and its output (the projections' input): (4 + 2a) x H;
      megatron's fused norm its input and output.
    - `*`: q and k after the rotary embedding, v, the attention output (also o_proj's input: the
      flash kernels return it in the layout the transpose makes contiguous), the log-sum-exp.
    - `-`: gated: gate, its activation, up, their product (megatron's fused SwiGLU: fc1's output
      and the product); relu2: the relu's output and its square.
    - `E`: per routed copy (top_k per token): the gathered input, fc1's output, the activation,
      fc2's output (megatron: the unpermute's input instead); the router's logits in fp32; the
      latent projection's output; the shared expert as a dense MLP. megatron and vLLM spread a
      rank's routed copies over tp (token dispatch, or experts split by tp).
    - `M`: mamba-ssm's memory-efficient path (mamba_split_conv1d_scan_combined) keeps in_proj's
      output (z, x, B, C, dt) and the scan's gated output; the scan and the conv are recomputed.
    Tensors every tp rank holds whole (norms) are split over tp with sequence parallel.
    """
    p = setup.parallel
    tp, etp = max(p.get("tp", 1), 1), max(p.get("etp", 1), 1)
    split = tp if setup.sequence_parallel else 1
    h, hf = s.hidden, setup.backend != "megatron"
    norm = ((4 + 2 * a) if hf else 2 * a) * h / split
    if mixer == "*":
        heads, kv = s.heads / tp, max(s.kv_heads / tp, 1)
        return norm + a * s.head_dim * (2 * heads + 2 * kv) + 4 * heads
    if mixer == "-":
        return norm + a * s.ffn / tp * ((4 if hf else 3) if s.gated else 2)
    if mixer == "E":
        width = s.moe_ffn / etp
        per_copy = a * (2 * s.expert_in + (2 if s.gated else 1) * width + width)
        copies = s.top_k / (tp if setup.backend != "fsdp2" else 1)
        shared = a * s.shared_ffn / tp * ((4 if hf else 3) if s.gated else 2)
        return norm + copies * per_copy + (4 * s.experts + a * s.latent) / split + shared
    if mixer == "M":
        inner = s.mamba_inner / tp
        zxbcdt = 2 * inner + 2 * s.groups * s.ssm_state / tp + s.mamba_heads / tp
        return norm + a * (zxbcdt + inner)
    raise ValueError(mixer)


def _tokens_per_rank(tokens: int, p: Dict[str, int]) -> int:
    return _div(tokens, p.get("cp", 1))


def activations(s: Shape, setup: Setup, recompute: bool, recomputing: bool = True) -> int:
    """Saved activations of one train micro-batch on one rank. With recompute: every block's
    input, plus (`recomputing`) one block's whole set while its backward recomputes it."""
    a, p = DTYPE_BYTES[setup.precision], setup.parallel
    t = _tokens_per_rank(setup.train_tokens, p)
    # sequence parallel splits what every tp rank would otherwise hold whole (norms, residual)
    split = max(p.get("tp", 1), 1) if setup.sequence_parallel else 1
    blocks = [sum(_saved(s, m, a, setup) for m in b) for b in s.blocks]
    # the final norm, as a mixer's norm (its output is the head's saved input)
    head_in = ((4 + 2 * a) if setup.backend != "megatron" else 2 * a) * s.hidden / split
    if recompute:  # torch's checkpoint / megatron's full recompute keep each block's input
        return int(t * (a * s.hidden / split * len(blocks) + (max(blocks) if recomputing else 0) + head_in))
    return int(t * (sum(blocks) + head_in))


def nograd_working_set(s: Shape, setup: Setup, tokens: int) -> int:
    """A no-grad forward of `tokens` tokens on one rank: the residual stream in and out of a
    block plus the largest mixer's intermediates (nothing is kept between blocks)."""
    a, p = DTYPE_BYTES[setup.precision], setup.parallel
    t = _tokens_per_rank(tokens, p)
    split = max(p.get("tp", 1), 1) if setup.sequence_parallel else 1
    largest = max(_saved(s, m, a, setup) for b in s.blocks for m in b)
    return int(t * (2 * a * s.hidden / split + largest))


def head_chunk_tokens(s: Shape, setup: Setup) -> int:
    vocab_local = _div(s.vocab, setup.parallel.get("tp", 1))
    return int(setup.chunk_tokens) if setup.chunk_tokens else max(1, CHUNK_LOGIT_ELEMENTS // vocab_local)


def logits_bytes(s: Shape, setup: Setup, tokens: int, backward: bool) -> int:
    """The head's vocabulary-wide tensors at their largest, on one rank.

    fsdp2 (models/chunked_logprobs.py): one chunk's logits in the compute dtype and in fp32 (one
    buffer when fp32; in-place after that), in the backward also the hidden states' fp32 gradient
    and, below fp32, the head weight's fp32 accumulator; chunk 0: whole logits, their fp32 copy
    (none in fp32) and the saved log-softmax. megatron (vocab_parallel.py): the bf16 logits, their fp32 copy, the shifted
    logits, their exponentials and the saved softmax of the whole micro-batch (18 B a logit in
    bf16); the backward the softmax, its gradient and the bf16 cast."""
    a, p = DTYPE_BYTES[setup.precision], setup.parallel
    vocab_local = _div(s.vocab, p.get("tp", 1))
    t = _tokens_per_rank(tokens, p)
    if setup.backend == "megatron":
        per_logit = (4 + 4 + a) if backward else (a + 4 * 4)
        return int(t * vocab_local * per_logit)
    if setup.chunk_tokens == 0:  # the logits, their fp32 copy (none in fp32), the log-softmax
        return int(t * vocab_local * (a + (4 if a < 4 else 0) + 4))
    c = min(head_chunk_tokens(s, setup), t)
    out = c * vocab_local * (4 if a == 4 else a + 4)
    if backward:  # d_weight is accumulated in fp32 (the gradient itself when the weight is fp32)
        out += 4 * t * s.hidden + (4 * vocab_local * s.hidden if a < 4 else 0)
    return int(out)


def _local(s: Shape, setup: Setup) -> Tuple[float, float]:
    """(dense and embedding, routed-expert) parameters one rank holds."""
    n, p = count_params(s), setup.parallel
    tp, cp, ep, etp, pp, dp = (max(p.get(k, 1) or 1, 1) for k in ("tp", "cp", "ep", "etp", "pp", "dp"))
    if setup.backend == "fsdp2":  # FSDP2 shards over dp x cp; ep ranks own whole experts, FSDP2 ignores them
        shard = tp * dp * cp
        return (n.dense + n.embedding) / shard, n.experts / (ep if ep > 1 else shard)
    embedding = n.embedding / tp if (pp == 1 or s.tied) else n.embedding / 2 / tp  # pp: one stage has one of the two
    experts = n.experts / (ep * etp if setup.backend == "megatron" else (ep if ep > 1 else tp))
    return n.dense / (tp * pp) + embedding, experts / pp


def _largest_tensor(s: Shape, setup: Setup) -> float:
    """The largest parameter tensor on one rank (CPU Adam's temporaries are its size)."""
    dense, experts = _local(s, setup)
    tp = max(setup.parallel.get("tp", 1), 1)
    fused = experts / max(s.count("E"), 1)  # transformers fuses a layer's experts in one or two tensors
    return max(s.vocab * s.hidden / tp, fused * (2 / 3 if s.gated else 1 / 2), s.hidden * max(s.ffn, s.mamba_inner) / tp)


def _block_params(s: Shape, setup: Setup) -> float:
    from .shape import mixer_params

    tp = max(setup.parallel.get("tp", 1), 1)
    return max(sum(sum(mixer_params(s, m)) for m in b) for b in s.blocks) / tp


def _fsdp2_transient(s: Shape, setup: Setup, a: int) -> int:
    """FSDP2's unsharded copies (two blocks and the root's embedding and head, in the compute
    dtype) when it shards; unsharded, autocast's cached low-precision copy of every weight."""
    p = setup.parallel
    if p.get("dp", 1) * p.get("cp", 1) > 1:
        root = count_params(s).embedding / max(p.get("tp", 1), 1)
        return int(a * (2 * _block_params(s, setup) + root))
    if a < 4 and setup.kind == "trainer":
        return int(a * sum(_local(s, setup)))
    return 0


def trainer(s: Shape, setup: Setup) -> RoleMemory:
    a = DTYPE_BYTES[setup.precision]
    dense, experts = _local(s, setup)
    local = dense + experts
    full, rc = activations(s, setup, False), activations(s, setup, True)
    acts = rc if setup.recompute else full
    t = _tokens_per_rank(setup.train_tokens, setup.parallel)
    vocab_local = _div(s.vocab, setup.parallel.get("tp", 1))
    fwd_logits = logits_bytes(s, setup, setup.train_tokens, backward=False)
    bwd_logits = logits_bytes(s, setup, setup.train_tokens, backward=True)
    lp_work = nograd_working_set(s, setup, setup.logprob_tokens)
    lp_logits = logits_bytes(s, setup, setup.logprob_tokens, backward=False)
    notes = []
    if setup.backend == "megatron":
        p = setup.parallel
        tp, cp, dp, ep, etp = (max(p.get(k, 1) or 1, 1) for k in ("tp", "cp", "dp", "ep", "etp"))
        edp = max(tp * cp * dp // (ep * etp), 1)
        opt = 0 if setup.offload else int(12 * (dense / (dp * cp) + experts / edp))
        fixed = {"params": int(a * local), "grads": int(4 * local), "optimizer": opt}
        # with recompute: the blocks' inputs, and the head's logits or one recomputed block, not both
        kept = activations(s, setup, True, recomputing=False) if setup.recompute else acts
        logits = max(fwd_logits, bwd_logits)
        running = max(acts - kept - logits, 0) if setup.recompute else 0
        phases = {
            "train step": {**fixed, "activations": kept + running, "logits": logits},
            "log-prob pass": {**fixed, "activations": lp_work, "logits": lp_logits},
        }
        if setup.offload:
            notes.append("optimizer state offloaded to the CPU")
    else:
        off = setup.offload
        weights, grads, opt = (0, 0, 0) if off else (int(4 * local), int(4 * local), int(8 * local))
        # LoRA: the base is frozen (fp32 weights, no gradients, no optimizer state); the adapters,
        # sharded like the rest, have all three (and the optimizer step's temporaries are theirs)
        p = setup.parallel
        lora = setup.lora_params / (p.get("dp", 1) * p.get("cp", 1) * p.get("tp", 1)) if setup.lora_params else 0.0
        if setup.lora_params and not off:
            weights, grads, opt = int(4 * (local + lora)), int(4 * lora), int(8 * lora)
        other = _fsdp2_transient(s, setup, a)
        block = max(sum(_saved(s, m, a, setup) for m in b) for b in s.blocks)
        # the head's weight gradient exists from the head's backward on (fp32 when unsharded)
        sharded = setup.parallel.get("dp", 1) * setup.parallel.get("cp", 1) > 1
        head_grad = 0 if lora else int((a if sharded else 4) * vocab_local * s.hidden)
        # the backward's peak: at its start every block's saved activations and the head's backward
        # (early), or at its end every gradient with one block's backward and, sharded, that
        # block's unsharded gradients before their reduce-scatter (late)
        early_acts = activations(s, setup, True, recomputing=False) if setup.recompute else acts
        early = early_acts + bwd_logits + head_grad
        # with recompute a block's whole set lives only while that block runs, never beside the
        # head's chunk: the forward's peak is the larger of the two
        running = max(int(t * block) - fwd_logits, 0) if setup.recompute else 0
        block_bwd = int(t * (block + 2 * a * s.hidden))
        # (with LoRA only the block's adapters have gradients)
        reduce = int((a + 4) * (lora / len(s.blocks) if lora else _block_params(s, setup))) if sharded else 0
        late = grads + block_bwd + reduce
        step_temp = int(4 * local) if setup.device == "gpu" else int(2 * 4 * _largest_tensor(s, setup))
        if lora:  # the optimizer steps over the adapters alone
            step_temp = int(4 * lora) if setup.device == "gpu" else int(2 * 4 * lora)
            notes.append(f"LoRA: {setup.lora_params:,} adapter parameters train; the base is frozen "
                         "(no gradients or optimizer state)")
        phases = {
            "forward": {"params": weights, "optimizer": opt, "activations": early_acts + running, "logits": fwd_logits,
                        "other": other},
            "backward": ({"params": weights, "optimizer": opt, "activations": early_acts, "logits": bwd_logits + head_grad,
                          "other": other} if early >= late else
                         {"params": weights, "grads": grads, "optimizer": opt, "activations": block_bwd,
                          "other": other + reduce}),
            "optimizer step": {"params": weights, "grads": grads, "optimizer": opt, "other": 0 if off else step_temp},
            "log-prob pass": {"params": weights, "optimizer": opt, "activations": lp_work, "logits": lp_logits,
                              "other": other},
        }
        if off:
            notes.append("parameters, gradients and optimizer state on the CPU (FSDP2 offload)")
    totals = {k: sum(v.values()) for k, v in phases.items()}
    phase = max(totals, key=totals.get)
    return RoleMemory(parts=phases[phase], phase=phase, activations_full=full, activations_recompute=rc,
                      notes=tuple(notes), phases=totals)


def teacher(s: Shape, setup: Setup) -> RoleMemory:
    """Inference only: the weights (fsdp2 loads them in fp32) and one no-grad forward."""
    a = DTYPE_BYTES[setup.precision]
    local = sum(_local(s, setup))
    weight_bytes = 4 if setup.backend == "fsdp2" else a
    parts = {"params": int(weight_bytes * local),
             "activations": nograd_working_set(s, setup, setup.logprob_tokens),
             "logits": logits_bytes(s, setup, setup.logprob_tokens, backward=False)}
    if setup.backend == "fsdp2":
        parts["other"] = _fsdp2_transient(s, setup, a)
    return RoleMemory(parts=parts, phase="log-prob pass")


def batched_tokens(setup: Setup) -> int:
    """vLLM's max_num_batched_tokens as refit/vllm_engine.py sets it: GPU_BATCHED_TOKENS on GPUs,
    every running sequence whole on CPU."""
    if setup.device == "gpu":
        return GPU_BATCHED_TOKENS
    return max(setup.max_num_seqs * setup.max_model_len, MIN_BATCHED_TOKENS)


def kv_bytes_per_token(s: Shape, setup: Setup) -> int:
    tp = max(setup.parallel.get("tp", 1), 1)
    kvb = setup.kv_dtype_bytes or DTYPE_BYTES[setup.precision]
    return int(s.count("*") * 2 * max(s.kv_heads / tp, 1) * s.head_dim * kvb)


def mamba_state_per_sequence(s: Shape, setup: Setup) -> int:
    """Mamba-2 layers' state of one sequence: the SSM state in fp32 (Nemotron-H's
    mamba_ssm_cache_dtype) and the conv window in the compute dtype."""
    tp = max(setup.parallel.get("tp", 1), 1)
    a = DTYPE_BYTES[setup.precision]
    ssm = s.mamba_heads / tp * s.mamba_head_dim * s.ssm_state * 4
    conv = (s.conv_kernel - 1) * s.conv_dim / tp * a
    return int(s.count("M") * (ssm + conv))


def generator(s: Shape, setup: Setup) -> RoleMemory:
    """vLLM: weights, the start-up profile forward of max_num_batched_tokens tokens (its peak
    activations are what vLLM keeps free of the KV cache), the sampler's fp32 logits of
    max_num_seqs rows gathered whole; the KV cache gets the rest of gpu_memory_utilization."""
    a = DTYPE_BYTES[setup.precision]
    nograd = Setup(kind="generator", backend="vllm", precision=setup.precision,
                   parallel={"tp": setup.parallel.get("tp", 1)})
    parts = {"params": int(a * sum(_local(s, setup))),
             "activations": nograd_working_set(s, nograd, batched_tokens(setup)),
             "logits": int(setup.max_num_seqs * s.vocab * (a + 4))}
    notes = [f"activations: vLLM's start-up profile forward of max_num_batched_tokens = {batched_tokens(setup):,} tokens "
             + ("(refit/vllm_engine.py GPU_BATCHED_TOKENS)" if setup.device == "gpu"
                else "(refit/vllm_engine.py on CPU: max_num_seqs x max_model_len)")]
    kv_tokens = 0
    if setup.gpu_bytes:
        budget = int(setup.gpu_memory_utilization * setup.gpu_bytes)
        parts["kv_cache"] = max(budget - sum(parts.values()), 0)
        per_token, per_seq = kv_bytes_per_token(s, setup), mamba_state_per_sequence(s, setup)
        one = setup.max_model_len * per_token + per_seq
        kv_tokens = (parts["kv_cache"] - per_seq) // per_token if per_token else 0
        minimum = one
    else:
        minimum = 0
    return RoleMemory(parts=parts, phase="engine", kv_tokens=max(int(kv_tokens), 0), kv_minimum=int(minimum),
                      notes=tuple(notes))


def budget(setup: Setup, usable: Optional[int]) -> Optional[int]:
    """Bytes a role may use on one GPU: the generator gpu_memory_utilization of the whole GPU
    (vLLM's own rule), the others what the headroom leaves (None: unknown, no check)."""
    if setup.device != "gpu":
        return None
    if setup.kind == "generator":
        return int(setup.gpu_memory_utilization * setup.gpu_bytes) if setup.gpu_bytes else None
    return usable


def role_memory(s: Shape, setup: Setup) -> RoleMemory:
    return {"trainer": trainer, "teacher": teacher, "generator": generator}[setup.kind](s, setup)
