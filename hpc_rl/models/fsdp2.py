"""The torch FSDP2 training backend (gloo on CPU, NCCL on GPU), loading HF checkpoints.

One class serves the trainer (optimizer, schedule, clipping) and the teachers
(`train=False`: inference only, no optimizer state). Log-probs follow one convention
across hpc_rl: for right-padded [B, T] token ids, position i holds the log-prob of token
i given tokens < i, and position 0 holds 0 (nothing predicts the first token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from hpc_rl.precision import torch_dtype

from .backend import BackendSpec, LossFn, Shards
from .chunked_logprobs import next_token_logprobs, token_logprobs  # noqa: F401 (importable from here)
from .nonfinite import NonFiniteGuard
from .forward_passes import packed_logprob_pass, padded_logprob_pass, train_micro_batches
# the launcher checks checkpoints before any rank starts, without importing torch
# (models/checkpoint_check.py); the names stay importable from here
from .checkpoint_check import ARCHITECTURE_NAMES, SUPPORTED_ARCHITECTURES, CheckpointError, check_checkpoint  # noqa: F401
from .parallel.expert_names import checkpoint_shards, checkpoint_specs
from .parallel.expert_parallel import (EPGroups, clip_grad_norm, expert_param_groups,
                                       finish_expert_grads, shard_experts)

@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw: decoupled weight decay; adam: L2 penalty in the gradient
    lr: float = 1e-5
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    warmup_start_lr: float = 0.0
    max_nonfinite_steps: int = 3  # non-finite steps skipped in a row before the run fails (models/nonfinite.py)


def lr_at(step: int, o: OptimConfig) -> float:
    """Constant after a linear warmup from warmup_start_lr to lr over warmup_steps."""
    if o.warmup_steps <= 0 or step >= o.warmup_steps:
        return o.lr
    return o.warmup_start_lr + (o.lr - o.warmup_start_lr) * step / o.warmup_steps


def parallel_dims(group: Optional[dist.ProcessGroup], parallel: Optional[Dict[str, int]]):
    """The group's ParallelDims from a role's `parallel` sizes (None: all data parallel)."""
    from .parallel.mesh import ParallelDims

    world = dist.get_world_size(group) if group is not None else 1
    p = dict(parallel or {})
    return ParallelDims.for_world(world, tp=p.get("tp", 1), cp=p.get("cp", 1), ep=p.get("ep", 1), etp=p.get("etp", 1),
                                  dp=p.get("dp"))


OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}

# trainer.logprob_batch_tokens left at None (config/schema_trainer.py): 16384 tokens per no-grad
# forward bound its activations while keeping a forward large enough to be efficient. (An unset
# trainer.logprob_chunk_tokens is sized by models/chunked_logprobs.py: CHUNK_LOGIT_ELEMENTS.)
DEFAULT_LOGPROB_BATCH_TOKENS = 16384


class FSDP2Backend:
    """Data parallel (FSDP2: every dp rank holds a Shard(0) chunk of each weight); with
    `parallel.tp > 1` DTensor tensor parallel inside each dp rank, with `parallel.cp > 1`
    context parallel; with `parallel.ep > 1` (an MoE model) each group of `ep` consecutive
    ranks splits the experts (expert_parallel.py) and FSDP2 shards the rest (models/parallel/)."""

    # every rank's loss function sees its rows' whole [B, T] log-probs (tp/cp gather them):
    # a one-step batch takes its old log-probs from there (roles/old_logprobs.py)
    old_logprobs_from_train_forward = True

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> "FSDP2Backend":
        optim = None
        if spec.train is not None:
            o, s = spec.train.optimizer, spec.train.scheduler
            optim = OptimConfig(name=o.name, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                grad_clip=o.grad_clip, warmup_steps=s.warmup_steps, warmup_start_lr=s.warmup_start_lr,
                                max_nonfinite_steps=spec.train.max_nonfinite_steps)
        return cls(spec.checkpoint, group=spec.group, precision=spec.precision, optim=optim,
                   train=spec.train is not None, device=spec.device, parallel=spec.parallel,
                   sequence_parallel=spec.sequence_parallel, logprob_chunk_tokens=spec.logprob_chunk_tokens,
                   logprob_batch_tokens=spec.logprob_batch_tokens,
                   activation_checkpointing=spec.activation_checkpointing, packing=spec.packing,
                   micro_batch_tokens=spec.micro_batch_tokens, cpu_offload=spec.cpu_offload,
                   attn_implementation=spec.attn_implementation,
                   lora=spec.train.lora if spec.train is not None and spec.train.lora.enabled else None)

    def __init__(self, model_path: str, group: Optional[dist.ProcessGroup] = None, precision: str = "fp32",
                 optim: Optional[OptimConfig] = None, train: bool = True, device: str = "cpu",
                 parallel: Optional[Dict[str, int]] = None, sequence_parallel: bool = False,
                 logprob_chunk_tokens: Optional[int] = None, logprob_batch_tokens: Optional[int] = None,
                 activation_checkpointing: bool = False, packing: bool = False,
                 micro_batch_tokens: Optional[int] = None, cpu_offload: bool = False,
                 attn_implementation: Optional[str] = None, lora=None):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        check_checkpoint(model_path)
        # the HF export carries from it what the model drops on load (Nemotron-H's MTP layers)
        self.checkpoint_dir = model_path
        self.device = torch.device(device)
        self.precision = precision
        # 0: whole [rows, tokens, vocab] logits in one piece / every row in one no-grad forward;
        # chunk None: sized by the vocabulary (models/chunked_logprobs.py chunk_tokens_for)
        self.chunk_tokens = None if logprob_chunk_tokens is None else int(logprob_chunk_tokens)
        self.batch_tokens = DEFAULT_LOGPROB_BATCH_TOKENS if logprob_batch_tokens is None else int(logprob_batch_tokens)
        # trainer.packing: several samples per row (models/packing.py, forward_passes.py); the train
        # step's micro-batches hold at most micro_batch_tokens tokens (None: a row of its own each)
        self.packing = bool(packing)
        self.micro_batch_tokens = int(micro_batch_tokens) if micro_batch_tokens else None
        # Master weights stay fp32; bf16/fp16 apply to compute through FSDP's mixed precision.
        # trainer.attn_implementation (None: transformers' default); flash_attention_2 reads a packed
        # row's position ids as variable-length sequences (validate_packing.py checks where it can run)
        attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32, **attn).to(self.device)
        # trainer.lora: peft adapters injected before any sharding; the base weights freeze (models/lora.py)
        self.lora = lora if train else None
        if self.lora is not None:
            from .lora import apply_lora

            apply_lora(model, self.lora)
        self.sharded = group is not None and dist.get_world_size(group) > 1
        self.group = group
        self.dims = parallel_dims(group, parallel)
        self.mesh = None
        if self.dims.tp > 1 or self.dims.cp > 1:
            from .parallel.mesh import build_mesh

            if self.dims.tp > 1 and self.dims.cp > 1:  # validation refuses it (config/support.py)
                raise ValueError("tensor parallel with context parallel is not implemented; use one of them")
            self.mesh = build_mesh(self.dims, group, self.device.type)
        if self.dims.tp > 1:
            from .parallel.tensor_parallel import parallelize

            parallelize(model, self.mesh["tp"], sequence_parallel)
        if self.dims.cp > 1:
            from .parallel.context_parallel import enable

            enable(model)
        self.ep, self.expert_params = None, []
        if self.dims.ep > 1:  # validation allows it without tp/cp only (config/support.py)
            if not self.sharded or self.dims.tp > 1 or self.dims.cp > 1:
                raise ValueError(f"expert parallel {self.dims.ep} needs several trainer ranks and no tensor/context parallel")
            self.ep = EPGroups(group, self.dims.ep, self.device.type)
            self.expert_params = shard_experts(model, self.ep)
        if self.packing:  # Mamba mixers restart their state at every packed sample
            from .mamba_segments import install

            if self.dims.tp > 1 or self.dims.cp > 1:  # validation refuses it (config/validate_packing.py)
                raise ValueError("packing runs without tensor or context parallel")
            install(model)
        self.activation_checkpointing = bool(activation_checkpointing and train)
        if self.activation_checkpointing:
            # per decoder block (attention, MLP, Mamba or MoE alike), after tensor/expert parallel
            # changed the blocks' parameters and before FSDP2 shards them: the recompute in the
            # backward then runs inside the block's FSDP2 unshard. torch's composable checkpoint
            # (non-reentrant) works through hooks, so parameter names (checkpoints, refit) stay.
            from torch.distributed._composable import checkpoint

            for layer in model.model.layers:
                checkpoint(layer)
        self.cpu_offload = bool(cpu_offload and train)
        if self.cpu_offload and (self.dims.dp * self.dims.cp < 2 or self.dims.tp > 1 or self.ep):
            # validation refuses these (config/support_memory.py): one rank has no FSDP2 to offload
            # with; tensor parallel's 2-D parameters and expert parallel's ignored experts would stay
            raise ValueError("trainer.cpu_offload needs FSDP2 over 2+ ranks (dp x cp) without tensor or expert parallel")
        if self.dims.dp * self.dims.cp > 1:
            # FSDP2 over dp (x tp inside) or, with cp, over the dp x cp ranks: the whole group
            tp_inside = self.dims.tp > 1
            dp_mesh = self.mesh["dp"] if tp_inside else DeviceMesh.from_group(self._fsdp_group(group),
                                                                               device_type=self.device.type)
            mp = MixedPrecisionPolicy(param_dtype=torch_dtype(precision), reduce_dtype=torch.float32)
            ignored = set(self.expert_params) or None  # expert parallel owns those
            offload = self._offload_policy()
            for layer in model.model.layers:
                fully_shard(layer, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored, offload_policy=offload)
            fully_shard(model, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored, offload_policy=offload)
        self.model = model
        self.optim_cfg = optim or OptimConfig()
        self.step_count = 0
        self.optimizer = None
        self.nonfinite = None  # NonFiniteGuard of a training backend
        if train:
            o = self.optim_cfg
            self.nonfinite = NonFiniteGuard(o.max_nonfinite_steps, group if self.sharded else None, self.device)
            if o.name not in OPTIMIZERS:
                raise ValueError(f"trainer.optimizer.name={o.name!r}: this backend has {sorted(OPTIMIZERS)}")
            # with LoRA only the adapters require gradients: the optimizer holds their state alone
            params = expert_param_groups(model, self.expert_params) if self.ep else [
                p for p in model.parameters() if p.requires_grad]
            self.optimizer = OPTIMIZERS[o.name](params, lr=lr_at(0, o), betas=tuple(o.betas), eps=o.eps,
                                               weight_decay=o.weight_decay)
        else:
            model.eval()
            model.requires_grad_(False)

    def _offload_policy(self):
        """trainer.cpu_offload: FSDP2's CPUOffloadPolicy keeps each rank's shards of the parameters,
        their gradients and (the optimizer is built over those shards) the optimizer state in host
        memory; FSDP2 copies a layer's shards to the device for its all-gather and its gradients
        back after the reduce-scatter, and the optimizer steps on the CPU. Pinned host memory
        (faster copies) needs an accelerator; on CPU clusters the copies are CPU to CPU."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        return CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cpu_offload else OffloadPolicy()

    def _fsdp_group(self, group):
        """The group FSDP2's mesh runs over. With CPU offload on GPUs the gradients FSDP2 hands
        back live in host memory, and the collectives over them (the grad-norm all-reduce in
        clip_grad_norm_, full state dicts) need a CPU backend beside NCCL: the same ranks with
        gloo for CPU tensors (torchtitan does the same). NOT RUN on a GPU yet (no GPU lent);
        on CPU clusters the group is gloo already."""
        if not (self.cpu_offload and self.device.type == "cuda"):
            return group
        return dist.new_group(dist.get_process_group_ranks(group), backend="cuda:nccl,cpu:gloo",
                              use_local_synchronization=True)

    def _autocast(self):
        # Under FSDP2 (dp x cp > 1) its mixed precision policy casts; otherwise autocast does.
        if self.dims.dp * self.dims.cp > 1 or self.precision == "fp32":
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=torch_dtype(self.precision))

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(dist.get_rank(self.group))["dp"] if self.sharded else 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    def dp_rank_of(self, role_rank: int) -> int:
        """The data-parallel rank of a rank of the group (its rows' share)."""
        return self.dims.coords(role_rank)["dp"]

    def forward_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs with gradients; the head in chunks of `chunk_tokens` tokens
        (models/chunked_logprobs.py; None: sized by the vocabulary), or whole logits when it is 0."""
        ids, mask, chunk = input_ids.to(self.device), attention_mask.to(self.device), self.chunk_tokens
        if self.dims.cp > 1:  # each rank its 1/cp of the tokens, K/V gathered in the attention
            from .parallel.context_parallel import cp_token_logprobs

            with self._autocast():
                return cp_token_logprobs(self.model, ids, mask, self.mesh["cp"].get_group(), chunk)
        if self.dims.tp > 1:  # the log-softmax over the sharded vocabulary (no rank holds whole logits)
            from .parallel.forward import tp_token_logprobs

            with self._autocast():
                return tp_token_logprobs(self.model, ids, mask, self.dims.tp, chunk)
        with self._autocast():
            if chunk != 0:
                return next_token_logprobs(self.model, ids, mask, chunk)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        return token_logprobs(logits, ids)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The no-grad pass (student log-probs, teachers), in forwards of at most
        `batch_tokens` tokens, packed with trainer.packing (models/forward_passes.py)."""
        with self._no_dropout():
            if self.packing:
                return packed_logprob_pass(self, input_ids, attention_mask)
            return padded_logprob_pass(self, input_ids, attention_mask)

    def _no_dropout(self):
        # trainer.lora.dropout applies to the train step only: the no-grad log-prob pass and greedy
        # evaluation run the adapters as the engines do (models/lora.py eval_mode)
        from .lora import eval_mode

        return eval_mode(self.model)

    def train_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_fn: LossFn,
                   micro_batch_size: Optional[int] = None) -> Dict[str, float]:
        """One optimizer step over these rows: forward and backward per micro-batch of
        `micro_batch_size` rows (None: all at once), gradients accumulating in between.
        `loss_fn(logprobs, rows)` gets the micro-batch's rows (a slice) and returns its loss
        already scaled to its share of the step, plus metrics (averaged over micro-batches,
        weighted by rows). Returns those metrics with the summed loss, lr and grad norm."""
        assert self.optimizer is not None, "inference-only backend (train=False) has no optimizer"
        self.model.train()
        lr = lr_at(self.step_count, self.optim_cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        n = input_ids.shape[0]
        total, metrics, count, fwd_tokens = 0.0, {}, 0, 0
        for rows, lp_of, tokens in train_micro_batches(self, input_ids, attention_mask, micro_batch_size):
            count += 1
            fwd_tokens += tokens if rows is not None else 0
            with lp_of() as lp:
                if rows is None:  # a spare forward: its backward joins the gradient reductions, adding 0
                    (lp.sum() * 0).backward()
                    continue
                loss, m = loss_fn(lp, rows)
                loss.backward()
            total += float(loss.detach())
            share = len(range(n)[rows]) if isinstance(rows, slice) else len(rows)
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + share / n * float(v)
        if self.ep:
            finish_expert_grads(self.expert_params, self.ep)
            grad_norm = clip_grad_norm(self.model.parameters(), self.optim_cfg.grad_clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
        # DTensor norms come back as DTensors on sharded models
        norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        # the norm covers every gradient of the group; the loss is this rank's rows: all ranks agree
        finite = self.nonfinite.agree(math.isfinite(total) and math.isfinite(norm))
        if finite:
            self.optimizer.step()
            self.step_count += 1  # the schedule's position: applied updates only (models/nonfinite.py)
        self.optimizer.zero_grad(set_to_none=True)
        skip = self.nonfinite.record(finite, f"loss {total:.4g}, grad norm {norm:.4g}")
        # the share of the forwards' tokens that were padding (trainer.packing drives it to ~0)
        pad = 1.0 - float(attention_mask.sum()) / fwd_tokens if fwd_tokens else 0.0
        return {**metrics, "loss": total, "lr": lr, "grad_norm": norm, "micro_batches": count,
                "padding_share": pad, **skip}

    @torch.no_grad()
    def greedy(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, eos_id: int,
               pad_id: int) -> torch.Tensor:
        if self.dims.tp > 1:
            from .parallel.forward import tp_greedy

            return tp_greedy(self.model, input_ids.to(self.device), attention_mask.to(self.device), max_new_tokens,
                             eos_id, pad_id, self.dims.tp).cpu()
        # synced_gpus=False: on an FSDP2 model HF would otherwise all-reduce a "finished" flag on
        # the default group (every rank of the job, which the other roles never join: a teacher
        # group of 2+ ranks hung here). Every rank of a group is given the same prompts
        # (roles/teacher.py), so all of them run the same number of forwards without it.
        with self._no_dropout():
            out = self.model.generate(input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                      do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                                      pad_token_id=pad_id, synced_gpus=False)
        return out[:, input_ids.shape[1]:].cpu()

    def refit_specs(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """Global shapes by checkpoint name (fused experts as one tensor per expert)."""
        from .lora import hf_name, is_adapter  # the merged weights keep the base's names and shapes

        return checkpoint_specs({hf_name(n): (tuple(t.shape), t.dtype) for n, t in self.model.state_dict().items()
                                 if not is_adapter(n)})

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole model's weights by HF name, on CPU (every rank gets them; for refit)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.sharded:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        else:
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                              broadcast_from_rank0=False))
        if self.lora is not None:  # HF names, each adapted weight merged (W + B @ A * alpha / r)
            from .lora import merged_state

            state = merged_state(self.model, state)
        return state

    def local_shards(self, dtype: Optional[torch.dtype] = None) -> Shards:
        """This rank's part of every weight, by checkpoint name: (global start of its box,
        tensor), read from the parameters' own placements (FSDP2's Shard(0) chunks, tensor
        parallel column/row slices, expert parallel's blocks of experts; whole tensors when
        unsharded). Fused experts come as one view per expert. With `dtype` the shards are cast
        copies (refit to a bf16 engine); without, the live parameters themselves (no copy)."""
        from .parallel.shards import local_box

        from .lora import hf_name

        out, state, boxes = {}, self.model.state_dict(), {}
        shapes = {hf_name(n): tuple(v.shape) for n, v in state.items()}
        for name, value in state.items():
            (start, _), local = local_box(value)
            boxes[name] = (start, local.detach())
        if self.lora is not None:  # merged copies of the adapted weights, in HF names (a collective)
            from .lora import merged_boxes

            boxes = merged_boxes(self.model, boxes, state)
        for name, (start, local) in boxes.items():
            if dtype is not None and local.dtype != dtype:
                local = local.to(dtype)
            out.update(checkpoint_shards(name, shapes[name], start, local))
        return out

    def source_layout(self, dtype_name: str):
        """The refit source layout of the group (ranks in group order), from every rank's
        live boxes; a collective of the group."""
        from hpc_rl.refit.vllm_layout import wire_specs

        from .parallel.shards import gather_source_layout

        specs = wire_specs(self.refit_specs(), dtype_name)
        boxes = {n: (start, tuple(a + k for a, k in zip(start, t.shape))) for n, (start, t) in self.local_shards().items()}
        return gather_source_layout(boxes, specs, self.group if self.sharded else None)
