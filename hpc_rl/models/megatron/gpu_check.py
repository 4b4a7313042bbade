"""GPU check of the Megatron backend (tests/gpu/megatron_check.sh runs it on one GPU).

One process, one GPU: a tiny Llama checkpoint is built here; the Megatron backend loads it
(bf16, Transformer Engine layer specs when TE is installed, else megatron-core's local
specs); its log-probs are compared with the Hugging Face model's in bf16 on the same tokens;
it takes one train step (the weights must move, the loss and grad norm must be finite), then
one with a NaN loss (it must be skipped, the weights unchanged: models/nonfinite.py); then the
memory savers (gpu_memory_check.py: a step with full recompute and one with the optimizer's CPU
offload against a plain one, loss and update equality, peak memory; Llama only, NOT RUN yet);
then its weights go into a vLLM engine on the same GPU through the refit planner, and the
engine's sampled tokens' log-probs are compared with the backend's:

  hf_vs_megatron token_mult_prob_error   <= 1.05 (bf16 kernels differ: TE vs eager HF)
  vllm_vs_megatron token_mult_prob_error <= 1.01 (after the refit, bf16)

With `--model nemotron_h` the checkpoint is a dense hybrid Nemotron-H (M*M-, shapes the
mamba-ssm kernels take: hidden 256, attention head_dim 64, 8 Mamba heads of 32, 2 groups,
state 64, chunk 128) built by megatron-core as MambaModel (issue #25); that needs Transformer
Engine, mamba-ssm and causal-conv1d on the node, and the JSON names what is missing.

Results go to --out (bench/results/megatron_gpu.json) whatever happens, with the failing
stage named. Without CUDA it writes {"ran": false, ...} and exits 3.

    python -m hpc_rl.models.megatron.gpu_check [--model llama|nemotron_h] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from hpc_rl.models.families import DEFAULT, FAMILIES

GOALS = {"hf_vs_megatron": 1.05, "vllm_vs_megatron": 1.01}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sft_batch(tok):
    from hpc_rl.data.tasks import addition
    from hpc_rl.models.assets import _batch

    return _batch(tok, addition(16, seed=5))


def _spec(model: str):
    from hpc_rl.models.assets import ModelSpec, NemotronHModelSpec

    if _hybrid(model):
        return NemotronHModelSpec(hidden=256, pattern="M*M-", heads=4, mamba_heads=8, mamba_head_dim=32, n_groups=2,
                                  ssm_state=64, chunk=128, intermediate=512, max_positions=256)
    return ModelSpec(hidden=256, intermediate=512, layers=2, heads=4, max_positions=256)


def _hybrid(model: str) -> bool:
    """The family's layers are a Mamba/attention/MLP pattern (megatron-core's MambaModel)."""
    from hpc_rl.models import families

    return families.named(model).shape == "hybrid"


def run(out: dict, tmp: Path, model: str = DEFAULT) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.algo.metrics import token_mult_prob_error
    from hpc_rl.config.schema import OptimizerConfig, TrainerConfig
    from hpc_rl.models.assets import save_untrained
    from hpc_rl.models.fsdp2 import token_logprobs
    from hpc_rl.models.backend import parallel_sizes
    from hpc_rl.models.megatron.backend import MegatronBackend
    from hpc_rl.models.megatron.loading import have_te

    out["stage"] = "build checkpoint"
    out["model"] = model
    ckpt = save_untrained(tmp / "tiny", _spec(model), seed=0)
    tok = AutoTokenizer.from_pretrained(ckpt)
    out["transformer_engine"] = have_te()
    torch.cuda.set_device(0)
    port = _port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)
    dist.init_process_group("nccl", store=dist.PrefixStore("pg", store), rank=0, world_size=1)

    out["stage"] = "megatron backend"
    train = TrainerConfig(backend="megatron", precision="bf16", micro_batch_size=4,
                          optimizer=OptimizerConfig(name="adamw", lr=1e-3, grad_clip=1.0))
    t0 = time.perf_counter()
    backend = MegatronBackend(str(ckpt), dist.group.WORLD, "bf16", "cuda:0", train=train, parallel=parallel_sizes(train.parallel))
    out["build_s"] = time.perf_counter() - t0

    out["stage"] = "log-probs vs HF"
    b = _sft_batch(tok)
    mask = b["attention_mask"].bool().clone()
    mask[:, 0] = False
    hf = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        hf_lp = token_logprobs(hf(input_ids=b["input_ids"].cuda(), attention_mask=b["attention_mask"].cuda()).logits,
                               b["input_ids"].cuda()).float().cpu()
    del hf
    mc_lp = backend.logprobs(b["input_ids"], b["attention_mask"]).float().cpu()
    out["hf_vs_megatron"] = token_mult_prob_error(mc_lp, hf_lp, mask)
    out["hf_vs_megatron_max_abs"] = float((mc_lp - hf_lp).abs()[mask].max())

    out["stage"] = "train step"
    before = {k: t.detach().float().cpu().clone() for k, (_, t) in backend.local_shards().items()}
    keep = b["labels"] != -100

    def loss_fn(lp, rows):
        m = keep[rows].float().to(lp.device)
        return -(lp * m).sum() / keep.float().sum(), {}

    step = backend.train_step(b["input_ids"], b["attention_mask"], loss_fn, micro_batch_size=4)
    after = {k: t.detach().float().cpu() for k, (_, t) in backend.local_shards().items()}
    moved = sum(int(not torch.equal(before[k], after[k])) for k in before)
    out["train_step"] = {**step, "tensors_changed": moved, "tensors": len(before)}
    if not (moved and torch.isfinite(torch.tensor(step["loss"])) and step["grad_norm"] > 0):
        raise RuntimeError(f"the train step did not move the weights or was not finite: {out['train_step']}")

    out["stage"] = "non-finite step"  # a NaN loss: skipped on every rank, weights untouched (models/nonfinite.py)
    kept = {k: t.detach().float().cpu().clone() for k, (_, t) in backend.local_shards().items()}
    nan = backend.train_step(b["input_ids"], b["attention_mask"], lambda lp, rows: (loss_fn(lp, rows)[0] * float("nan"), {}),
                             micro_batch_size=4)
    same = all(torch.equal(kept[k], t.detach().float().cpu()) for k, (_, t) in backend.local_shards().items())
    out["nonfinite_step"] = {"skipped": nan["nonfinite_skipped"], "weights_unchanged": same}
    if not (nan["nonfinite_skipped"] == 1.0 and same):
        raise RuntimeError(f"a NaN loss was not skipped cleanly: {out['nonfinite_step']}")

    if not _hybrid(model):  # Nemotron-H's MambaStack has no full recompute (models/megatron/memory.py)
        out["stage"] = "memory savers"
        from hpc_rl.config.schema_trainer import MegatronMemoryConfig

        from .gpu_memory_check import run_variants

        def variant(megatron=None, **kw):
            return TrainerConfig(backend="megatron", precision="bf16", micro_batch_size=4, megatron=MegatronMemoryConfig(**(megatron or {})),
                                 optimizer=OptimizerConfig(name="adamw", lr=1e-3, grad_clip=1.0), **kw)

        out["memory_savers"] = run_variants(str(ckpt), b, loss_fn, variant)

    out["stage"] = "refit into vLLM"
    from hpc_rl.refit.vllm_engine import VLLMGenerator, refit_in_process

    gen = VLLMGenerator(str(ckpt), precision="bf16", max_model_len=256, memory_fraction=0.3, max_num_seqs=32)
    timing, _ = refit_in_process(gen, store, port, backend.full_state_dict(), version=1, prefix="refit0")
    out["refit_s"] = timing["refit_s"]
    from hpc_rl.data.tasks import mixed

    prompts = gen.chat_prompts([s["prompt"] for s in mixed(16, seed=3, tasks=("addition", "multiplication"))])
    r = gen.generate(prompts, temperature=1.0, max_tokens=16, seed=0)
    tlp = backend.logprobs(r.input_ids, r.attention_mask)
    out["vllm_vs_megatron"] = token_mult_prob_error(tlp, r.generation_logprobs, r.response_mask)
    out["vllm_tokens"] = int(r.response_mask.sum())
    out["stage"] = "done"


def main() -> int:
    ap = argparse.ArgumentParser()
    # a dense GPT family's tiny model, or the hybrid's (the tiny assets of the two kinds)
    ap.add_argument("--model", choices=[f.name for f in FAMILIES if f.megatron and f.tiny], default=DEFAULT)
    ap.add_argument("--out", default="bench/results/megatron_gpu.json")
    args = ap.parse_args()
    import torch

    out: dict = {"check": "megatron_gpu", "goals": GOALS, "ran": False}
    if not torch.cuda.is_available():
        out["why"] = "no CUDA device: megatron-core's forward needs one"
        code = 3
    else:
        out.update(ran=True, device=torch.cuda.get_device_name(0))
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="hpc_rl_mcore_") as tmp:
                run(out, Path(tmp), args.model)
        except BaseException as exc:  # the JSON says where it stopped
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["traceback"] = traceback.format_exc()[-4000:]
        out["seconds"] = time.perf_counter() - t0
        out["passed"] = (out.get("stage") == "done" and all(out.get(k, 9.0) <= g for k, g in GOALS.items())
                         and out.get("memory_savers", {}).get("passed", True))
        code = 0 if out["passed"] else 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "traceback"}, indent=2, default=str))
    return code


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    sys.exit(main())
