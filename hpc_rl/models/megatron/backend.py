"""The Megatron-core TrainingBackend (GPU clusters only: megatron-core's forward allocates on
CUDA). Imported only when trainer.backend=megatron builds it (models/registry.py).

One class for the student (DDP with the distributed optimizer) and inference-only teachers.
The role's ranks form Megatron's mesh in Megatron's rank order (shards.py), with their own
process groups handed to megatron-core as a ProcessGroupCollection: the job's default group
also holds generators, teachers and env ranks, so Megatron's global parallel_state (which
assumes it owns the world) is never initialised. Groups are created with
use_local_synchronization, so only their members enter them.

Sequences are right-padded to a multiple of 2*cp (times tp under sequence parallel); with
context parallel each rank feeds chunks r and 2cp-1-r of every sequence (Megatron's load
balancing for causal attention) and the ranks' token log-probs are put back in order. The
log-probs come from vocabulary-parallel logits (vocab_parallel.py). Pipeline stages run
megatron-core's own schedules; the last stage's results are broadcast to the others.

Not run in this version's CI (no GPU): tests/gpu/megatron_check.sh is the prepared check.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hpc_rl.runtime import sealed
from hpc_rl.models.backend import BackendSpec, LossFn, Shards, parallel_sizes
from hpc_rl.models.nonfinite import NonFiniteGuard, tensors_finite

from hpc_rl.models.families.nemotron_h import megatron_mapping as nemotron_h_mapping

from . import config_map, memory
from .greedy import greedy_rows
from .hf_mapping import Style, hf_to_megatron, padded_vocab
from hpc_rl.models.families.nemotron_h.megatron_mapping import NemotronHDims, dims_of
from hpc_rl.models.families.nemotron_h.megatron_refit import pieces
from .loading import check_hybrid_packages, have_te, lr_at, meta_hf_model, read_hf
from .refit_layout import local_hf_shards, megatron_layout
from .shards import Parallel, coords_of, local_state, mesh_groups
from .vocab_parallel import vocab_parallel_logprobs


class MegatronBackend:
    # its loss function runs on the last pipeline stage only: the separate log-prob pass always
    # runs (roles/old_logprobs.py)
    old_logprobs_from_train_forward = False

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> "MegatronBackend":
        parallel = spec.parallel
        if parallel is None and spec.train is not None:
            parallel = parallel_sizes(spec.train.parallel)
        return cls(spec.checkpoint, spec.group, spec.precision, spec.device, train=spec.train, parallel=parallel)

    def __init__(self, path: str, group, precision: str, device: str, train: Any = None, parallel: Any = None):
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel

        self.device = torch.device(device)
        self.train_cfg, self.precision = train, precision
        self.ranks = dist.get_process_group_ranks(group)  # group rank i = Megatron mesh rank i
        self.me = dist.get_rank(group)
        q = parallel or {}  # the role's sizes (models/backend.parallel_sizes)
        sizes = {k: q[k] for k in ("tp", "cp", "pp", "ep", "etp") if q.get(k)}
        inner = sizes.get("tp", 1) * sizes.get("cp", 1) * sizes.get("pp", 1)
        self.p = Parallel(dp=len(self.ranks) // inner, **sizes)
        self.c = coords_of(self.me, self.p)
        # the student follows trainer.sequence_parallel; an inference-only teacher with tp > 1
        # always shards its tokens (megatron-core refuses MoE layers with tp > 1 without it, and
        # it only changes where the norms' activations live)
        self.sp = (bool(getattr(train, "sequence_parallel", False)) if train is not None else True) and self.p.tp > 1
        self.max_seq_len = getattr(train, "max_seq_len", 4096)
        hf_cfg, hf_state = read_hf(path)
        self.dims = dims_of(hf_cfg)
        te = have_te()
        # the student's activation recompute (trainer.activation_checkpointing / trainer.megatron.*);
        # teachers never run a backward
        recompute = memory.recompute_kwargs(train) if train is not None else {}
        problems = [config_map.check(hf_cfg, self.p, self.sp, self.max_seq_len, te=te, recompute=recompute)]
        problems += memory.offload_problems(train, te) if train is not None else []
        problem = "; ".join(p for p in problems if p)
        if problem:
            raise ValueError(f"{path} on the megatron backend: {problem}")
        self.hybrid = isinstance(self.dims, NemotronHDims)
        if self.hybrid:
            check_hybrid_packages(te)
        self.pgs = self._groups()
        from megatron.core import parallel_state

        # megatron-core's local attention takes scratch space from this process-wide buffer
        # (no process group involved); Megatron's own initialisation would have set it
        if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
            parallel_state._set_global_memory_buffer()
        if self.p.cp > 1 and not te:
            raise ValueError("context parallel > 1 on the megatron backend needs Transformer Engine's attention: "
                             "install the gpu extra (transformer-engine) or set the role's parallel.cp=1")
        self.style = Style(te=te, grouped_experts=te and bool(self.dims.num_experts), padded_vocab=padded_vocab(self.dims.vocab, self.p.tp))
        tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=self.c.tp, ep_rank=self.c.ep, etp_rank=self.c.etp)
        self.tcfg = config_map.transformer_config({**config_map.transformer_kwargs(hf_cfg, self.p, self.sp, precision, te=te),
                                                   **recompute})
        self.first, self.last = self.c.pp == 0, self.c.pp == self.p.pp - 1
        if self.hybrid:  # megatron-core's hybrid stack: Mamba-2, attention, MLP and MoE layers by pattern
            from megatron.core.models.mamba import MambaModel
            from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

            core = MambaModel(self.tcfg, mamba_stack_spec, pre_process=self.first, post_process=self.last,
                              pg_collection=self.pgs, **config_map.model_kwargs(hf_cfg, self.p, self.max_seq_len))
        else:
            core = GPTModel(self.tcfg, config_map.layer_spec(self.tcfg, te), pre_process=self.first,
                            post_process=self.last, pg_collection=self.pgs,
                            **config_map.model_kwargs(hf_cfg, self.p, self.max_seq_len))
        core.to(self.device)
        # MTP layers (Nemotron-H) are not trained: the HF export carries them over (ckpt/carry.py)
        self.hf_specs = {n: (tuple(t.shape), t.dtype) for n, t in hf_state.items()
                         if not (self.dims.tied and n == "lm_head.weight") and not n.startswith("mtp.")}
        self._load(core, hf_state)
        del hf_state
        self.core = core
        self.hf_config = hf_cfg
        self.step_count = 0
        self.optimizer = None
        self.nonfinite = None  # NonFiniteGuard of a training backend
        self.model = core
        if train is not None:
            self._wrap_for_training(core)
            self.nonfinite = NonFiniteGuard(train.max_nonfinite_steps, self.pgs_world(), self.device)
        else:
            core.eval()
            core.requires_grad_(False)
        self.export_model = meta_hf_model(path)
        self.checkpoint_dir = path  # the HF export carries from it what the HF class drops on load

    # ---------------------------------------------------------------------------- set-up
    def _groups(self):
        """Every Megatron group this rank belongs to, over the role's global ranks."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection()
        for name, groups in mesh_groups(self.p).items():
            mine = next(g for g in groups if self.me in g)
            # each rank is in exactly one group per kind and kinds come in a fixed order, so
            # members meet in the same order; non-members never enter (local synchronization)
            setattr(pgs, name, dist.new_group([self.ranks[r] for r in mine], use_local_synchronization=True))
        # one distributed-optimizer instance: it spans the whole mesh, with no groups between instances
        pgs.intra_dp_cp, pgs.intra_expt_dp = pgs.dp_cp, pgs.expt_dp
        pgs.intra_dist_opt, pgs.inter_dist_opt = self.pgs_world(), None
        return pgs

    def _load(self, core, hf_state) -> None:
        convert = nemotron_h_mapping.hf_to_megatron if self.hybrid else hf_to_megatron
        whole = convert(hf_state, self.dims, self.style)
        local = local_state(whole, self.dims, self.p, self.me)
        missing, unexpected = core.load_state_dict(local, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"Megatron model vs converted checkpoint: missing {missing[:6]}, unexpected {unexpected[:6]}")

    def _wrap_for_training(self, core) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer

        ddp = DistributedDataParallel(self.tcfg, DistributedDataParallelConfig(**config_map.ddp_kwargs()), core,
                                      pg_collection=self.pgs)
        self.model = ddp
        self.optimizer = get_megatron_optimizer(
            config_map.optimizer_config(config_map.optimizer_kwargs(self.train_cfg, self.precision)), [ddp],
            use_gloo_process_groups=False, pg_collection=self.pgs)  # megatron takes no gloo groups with a pg_collection
        # what megatron's own training loop wires into the config for its schedules
        self.tcfg.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=self.pgs)
        self.tcfg.grad_scale_func = self.optimizer.scale_loss
        self.tcfg.no_sync_func = ddp.no_sync

    # ------------------------------------------------------------------------- protocol
    @property
    def dp_rank(self) -> int:
        return self.c.dp

    @property
    def dp_size(self) -> int:
        return self.p.dp

    def _unit(self) -> int:
        return 2 * self.p.cp * (self.p.tp if self.sp else 1) if self.p.cp > 1 else (self.p.tp if self.sp else 1)

    def _cp_index(self, t: int, r: Optional[int] = None) -> torch.Tensor:
        """Positions of a length-t sequence that context-parallel rank r (default: this one)
        feeds: chunks r and 2cp-1-r of 2cp equal chunks (t % 2cp == 0)."""
        cp = self.p.cp
        r = self.c.cp if r is None else r
        if cp == 1:
            return torch.arange(t)
        chunk = t // (2 * cp)
        return torch.cat([torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)])

    def _batch(self, input_ids: torch.Tensor) -> Dict[str, torch.Tensor]:
        b, t = input_ids.shape
        unit = self._unit()
        pad = (-t) % unit
        ids = torch.nn.functional.pad(input_ids, (0, pad + 1))  # +1: the label of the last position
        labels = ids[:, 1:]
        ids = ids[:, :-1]
        idx = self._cp_index(t + pad)
        pos = torch.arange(t + pad).expand(b, -1)
        dev = self.device
        return {"ids": ids[:, idx].to(dev), "pos": pos[:, idx].to(dev), "labels": labels[:, idx].to(dev), "t": t, "tp_": t + pad}

    def _token_logprobs(self, logits: torch.Tensor, batch) -> torch.Tensor:
        """[B, T] in hpc_rl's convention (out[:, i] = log p(token i | < i), out[:, 0] = 0)
        from this rank's vocabulary block and sequence chunks; gradients reach only the
        local chunks (the other ranks' chunks are their own)."""
        v_local = logits.shape[-1]
        lp = vocab_parallel_logprobs(logits, batch["labels"], self.c.tp * v_local, self.pgs.tp if self.p.tp > 1 else None,
                                     vocab_size=self.dims.vocab)
        if self.p.cp > 1:
            parts = [torch.empty_like(lp) for _ in range(self.p.cp)]
            dist.all_gather(parts, lp.detach().contiguous(), group=self.pgs.cp)
            parts[self.c.cp] = lp
            order = torch.cat([self._cp_index(batch["tp_"], r) for r in range(self.p.cp)]).to(lp.device)
            lp = torch.cat(parts, dim=1)[:, torch.argsort(order)]
        lp = lp[:, : batch["t"]]
        return torch.cat([torch.zeros_like(lp[:, :1]), lp[:, :-1]], dim=1)

    def _run(self, batches: List[dict], forward_only: bool, loss_fn=None) -> List[dict]:
        """megatron-core's schedule over micro-batches; returns the last stage's per
        micro-batch results, broadcast to every pipeline stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        n = len(batches)

        def step(data, model):
            b = next(data)
            out = model(b["ids"], b["pos"], None)

            def head(output):
                if not self.last:
                    return output, {}
                lp = self._token_logprobs(output, b)
                if forward_only:
                    return output.new_zeros(()), {"lp": lp.detach().float().cpu()}
                loss, m = loss_fn(lp, b["rows"])
                # the schedule divides by the micro-batch count and multiplies by cp (Megatron's
                # per-rank partial losses); ours is already the micro-batch's share of the step and
                # each cp rank's gradient covers only its chunks: undo the division, keep the cp factor
                return loss * n, {"loss": float(loss.detach()), **{k: float(v) for k, v in m.items()}, "rows": b["n"]}

            return out, head

        fb = get_forward_backward_func(pp_size=self.p.pp)
        t = max(b["ids"].shape[1] for b in batches)
        got = fb(forward_step_func=step, data_iterator=iter(batches), model=[self.model], num_microbatches=n,
                 seq_length=t, micro_batch_size=batches[0]["ids"].shape[0], forward_only=forward_only,
                 pg_collection=self.pgs, p2p_communicator=P2PCommunicator(self.pgs.pp, self.tcfg))
        if self.p.pp > 1:
            box = [got if self.last else None]
            last = self.ranks[next(g for g in mesh_groups(self.p)["pp"] if self.me in g)[-1]]
            got, _ = sealed.broadcast(box[0], last, self.pgs.pp)  # MAC checked before unpickling
        return got

    def _chunks(self, input_ids: torch.Tensor, mbs: int):
        n = input_ids.shape[0]
        for a in range(0, n, mbs):
            rows = slice(a, min(a + mbs, n))
            b = self._batch(input_ids[rows])
            b["rows"], b["n"] = rows, rows.stop - rows.start
            yield b

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        mbs = getattr(self.train_cfg, "micro_batch_size", 1) or 1
        got = self._run(list(self._chunks(input_ids, mbs)), forward_only=True)
        return torch.cat([g["lp"] for g in got])

    def train_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_fn: LossFn,
                   micro_batch_size: int) -> Dict[str, float]:
        assert self.optimizer is not None, "inference-only backend has no optimizer"
        self.model.train()
        lr = lr_at(self.step_count, self.train_cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        n = input_ids.shape[0]
        mbs = n if not micro_batch_size or micro_batch_size >= n else micro_batch_size
        got = self._run(list(self._chunks(input_ids, mbs)), forward_only=False, loss_fn=loss_fn)
        loss = sum(g["loss"] for g in got)  # every stage has it (_run broadcasts the last stage's)
        # The gradients are judged here, before optimizer.step(), which clips and applies in one
        # call. Under fp16 the optimizer's loss scaler judges its scaled gradients itself: an
        # overflow lowers the scale and megatron skips that update, which is how the scale
        # settles, not a fault (not counted); a non-finite loss still is.
        ok = torch.tensor(True) if self.precision == "fp16" else tensors_finite(self._main_grads())
        finite = self.nonfinite.agree(ok & math.isfinite(loss))
        grad_norm = float("nan")
        if finite:
            stepped, grad_norm, _ = self.optimizer.step()
            if stepped:
                self.step_count += 1  # the schedule's position: applied updates only (models/nonfinite.py)
            grad_norm = float(grad_norm or 0.0)
        else:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        skip = self.nonfinite.record(finite, f"loss {loss:.4g}")
        metrics: Dict[str, float] = {}
        for g in got:
            for k, v in g.items():
                if k not in ("loss", "rows"):
                    metrics[k] = metrics.get(k, 0.0) + v * g["rows"] / n
        return {**metrics, "loss": loss, "lr": lr, "grad_norm": grad_norm, "micro_batches": len(got), **skip}

    def _main_grads(self):
        """This rank's gradients as megatron's DDP holds them (param.main_grad, views of its
        grad buffers, reduced over data parallel by the schedule's finalize step)."""
        for p in self.core.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                yield g

    @torch.no_grad()
    def greedy(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, eos_id: int,
               pad_id: int) -> torch.Tensor:
        """A teacher's accuracy check, one full forward per new token (greedy.py)."""
        return greedy_rows(self, input_ids, attention_mask, max_new_tokens, eos_id, pad_id)

    # -------------------------------------------------------------------- weights out
    def refit_specs(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        return dict(self.hf_specs)

    def dp_rank_of(self, role_rank: int) -> int:
        return coords_of(role_rank, self.p).dp

    def refit_source_layout(self, specs):
        """The trainer ranks' boxes for the refit planner (Megatron's sharding, HF names)."""
        return megatron_layout(specs, self.dims, self.style, self.p)

    def source_layout(self, dtype_name: str):
        """The protocol's source layout: computed from the sharding rule, no collective needed."""
        from hpc_rl.refit.vllm_layout import wire_specs

        return self.refit_source_layout(wire_specs(self.refit_specs(), dtype_name))

    def local_shards(self, dtype: Optional[torch.dtype] = None) -> Shards:
        state = {k: v for k, v in self.core.state_dict().items() if isinstance(v, torch.Tensor)}
        out = local_hf_shards(state, self.dims, self.style, self.p, self.me)

        def ready(boxes):  # one box, or a Mamba in_proj / conv1d held as several (nemotron_h_refit.py)
            done = [(s, (t if dtype is None else t.to(dtype)).detach()) for s, t in pieces(boxes)]
            return done if isinstance(boxes, list) else done[0]

        return {k: ready(b) for k, b in out.items()}

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every HF weight, whole, on CPU, on every rank (a gather of all ranks' boxes)."""
        mine = {k: [(s, t.cpu()) for s, t in pieces(b)] for k, b in self.local_shards().items()}
        everyone: List[Any] = sealed.all_gather(mine, self.pgs_world())
        out = {n: torch.empty(shape, dtype=dt) for n, (shape, dt) in self.hf_specs.items()}
        for boxes in everyone:
            for n, held in boxes.items():
                for s, t in held:
                    out[n][tuple(slice(a, a + k) for a, k in zip(s, t.shape))] = t.to(out[n].dtype)
        return out

    def pgs_world(self):
        if not hasattr(self, "_world_group"):
            self._world_group = dist.new_group(self.ranks, use_local_synchronization=True)
        return self._world_group

    # -------------------------------------------------------- checkpoints (hpc_rl/ckpt)
    def _mp_key(self, name: str) -> str:
        """A key shared by the replicas of a tensor (DCP writes one copy of each key)."""
        c = self.c
        if ".experts." in name:
            return f"model/etp{c.etp}.ep{c.ep}.pp{c.pp}/{name}"
        return f"model/tp{c.tp}.pp{c.pp}/{name}"

    def dcp_state(self, with_optimizer: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(model, optimizer) state for torch.distributed.checkpoint, keyed so that every
        rank's local tensors are distinct entries: Megatron's parameters are plain local
        tensors (no DTensors), so a resume needs the same mesh (the model fingerprint's local
        shapes and the keys say so)."""
        model = {self._mp_key(k): v for k, v in self.core.state_dict().items() if isinstance(v, torch.Tensor)}
        optim: Dict[str, Any] = {}
        if with_optimizer and self.optimizer is not None:
            # per rank: its shard of the distributed optimizer's state, under its mesh rank
            optim = {f"rank{self.me}": {"param_state": self.optimizer.get_parameter_state_dp_reshardable(),
                                        "common": self.optimizer.state_dict()}}
        return model, optim

    def load_dcp_state(self, model: Dict[str, Any], optim: Dict[str, Any]) -> None:
        local = {k.split("/", 2)[2]: v for k, v in model.items()}
        self.core.load_state_dict(local, strict=False)
        if optim and self.optimizer is not None:
            mine = optim[f"rank{self.me}"]
            self.optimizer.load_state_dict(mine["common"])
            self.optimizer.load_parameter_state_from_dp_reshardable(mine["param_state"])

