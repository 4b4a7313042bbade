"""LoRA on the fsdp2 student (issue 47): only the adapters train, the merged weights are peft's
merge, checkpoints hold the adapters and their optimizer state alone and resume bit for bit, the
PEFT export loads with peft and the merged export with transformers; the config refusals.
All on a real tiny Llama on disk, real peft, real torch.distributed.checkpoint."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hpc_rl.ckpt import IncompatibleCheckpointError, capture_rng_state, export_hf, load_checkpoint, save_checkpoint
from hpc_rl.ckpt.export_lora import export_adapter
from hpc_rl.config import ConfigError, load_config
from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig

from gloo_ranks import run_ranks

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
OPT = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)
LORA = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=None)
CONFIG_YAML = "recipe: test_lora\n"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)


def _backend(path, lora=LORA, **kw) -> FSDP2Backend:
    return FSDP2Backend(str(path), optim=OPT, lora=lora, **kw)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _train_step(backend: FSDP2Backend) -> None:
    """A step whose batch depends on the torch and numpy RNGs (a resume must restore both)."""
    ids = torch.randint(8, 100, (4, 12))
    attn = torch.ones_like(ids)
    scale = float(np.random.uniform(0.5, 1.5))
    backend.train_step(ids, attn, lambda lp, rows: (-scale * lp[rows].mean(), {}))


def _snapshot(backend: FSDP2Backend) -> dict:
    names = {id(p): n for n, p in backend.model.named_parameters()}
    optim = {(names[id(p)], k): v.clone() for p, st in backend.optimizer.state.items() for k, v in st.items()}
    return {"weights": {k: v.clone() for k, v in backend.model.state_dict().items()}, "optim": optim,
            "step": backend.step_count}


def _assert_same(got: dict, want: dict) -> None:
    assert got["step"] == want["step"] and set(got["weights"]) == set(want["weights"])
    for k, v in want["weights"].items():
        assert torch.equal(got["weights"][k], v), k
    assert set(got["optim"]) == set(want["optim"]) and want["optim"]
    for k, v in want["optim"].items():
        assert torch.equal(got["optim"][k], v), k


def test_only_adapters_train_and_merged_weights_are_peft_merge(tiny_ckpt):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _seed_all(0)
    b = _backend(tiny_ckpt)
    start = {k: v.clone() for k, v in b.model.state_dict().items()}
    trainable = [n for n, p in b.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 projections (the llama family's default targets) x (A, B)
    assert len(trainable) == 2 * 7 * 2
    assert {id(p) for g in b.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in b.model.named_parameters() if p.requires_grad}
    for _ in range(3):
        _train_step(b)
    after = b.model.state_dict()
    for n, v in after.items():  # the base never moves; both adapter matrices do (B starts at 0)
        assert torch.equal(v, start[n]) != (".lora_A." in n or ".lora_B." in n), n
    assert set(b.optimizer.state) == {p for n, p in b.model.named_parameters() if p.requires_grad}

    merged = b.full_state_dict()  # HF names, what refit and the merged export send
    ref = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    assert set(merged) == set(ref.state_dict())
    peft_model = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=b.model.hpc_rl_lora["config"].target_modules))
    peft_model.load_state_dict({"base_model.model." + k: v for k, v in after.items()}, strict=True)
    want = peft_model.merge_and_unload().state_dict()
    for k, v in want.items():
        assert torch.allclose(merged[k], v, atol=1e-6, rtol=0), k
    # local_shards (the refit's source) are the merged weights too, in HF names and shapes
    shards = b.local_shards()
    assert set(shards) == set(merged) and all(torch.equal(t, merged[n]) for n, (_, t) in shards.items())
    assert b.refit_specs() == {n: (tuple(t.shape), t.dtype) for n, t in merged.items()}


def test_checkpoint_holds_adapters_and_resume_is_bitwise(tiny_ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "checkpoints"
    _seed_all(0)
    b = _backend(tiny_ckpt)
    for step in range(1, 7):
        _train_step(b)
        if step == 4:
            path = save_checkpoint(root, 4, b, {"rng": capture_rng_state()}, CONFIG_YAML)
            at4 = _snapshot(b)
    at6 = _snapshot(b)

    keys = set(dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), sorted(model_keys)[:3]
    assert not any("base_layer" in k or "embed_tokens" in k for k in keys)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["lora"]["rank"] == 4 and manifest["lora"]["base_checkpoint"] == str(tiny_ckpt)

    from hpc_rl.ckpt import restore_rng_state

    resumed = _backend(tiny_ckpt)
    extra = load_checkpoint(path, resumed)
    restore_rng_state(extra["rng"])
    _assert_same(_snapshot(resumed), at4)
    for _ in range(2):
        _train_step(resumed)
    _assert_same(_snapshot(resumed), at6)

    # another rank, or full fine-tuning, is refused by name
    with pytest.raises(IncompatibleCheckpointError, match="rank"):
        load_checkpoint(path, _backend(tiny_ckpt, lora=SimpleNamespace(**{**vars(LORA), "rank": 8})))
    with pytest.raises(IncompatibleCheckpointError, match="LoRA adapters"):
        load_checkpoint(path, FSDP2Backend(str(tiny_ckpt), optim=OPT))


def test_checkpoint_refuses_another_base(tiny_ckpt, tmp_path):
    _seed_all(0)
    b = _backend(tiny_ckpt)
    _train_step(b)
    path = save_checkpoint(tmp_path / "ck", 1, b, {}, CONFIG_YAML)
    other = save_untrained(tmp_path / "other", SPEC, seed=1)
    with pytest.raises(IncompatibleCheckpointError, match="base_digest"):
        load_checkpoint(path, _backend(other))


def test_peft_export_loads_with_peft_and_merged_export_gives_same_greedy_tokens(tiny_ckpt, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _seed_all(0)
    b = _backend(tiny_ckpt)
    for _ in range(3):
        _train_step(b)
    adapter = export_adapter(b, tmp_path / "final_adapter", str(tiny_ckpt))
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    merged_dir = export_hf(b, tmp_path / "final_hf", tokenizer_dir=tiny_ckpt)

    ids = torch.tensor([[1, 9, 12, 30, 44, 17]])
    attn = torch.ones_like(ids)
    want = b.greedy(ids, attn, max_new_tokens=8, eos_id=-1, pad_id=0)
    with torch.no_grad():
        live = b.model.eval()(input_ids=ids, attention_mask=attn).logits
    base = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    with torch.no_grad():
        untrained = base(input_ids=ids, attention_mask=attn).logits
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        got = peft_model(input_ids=ids, attention_mask=attn).logits
    assert torch.equal(got, live)  # the same modules and weights: bit for bit
    assert not torch.allclose(untrained, live, atol=1e-4)  # and the adapters did train

    hf = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    out = hf.generate(ids, attention_mask=attn, do_sample=False, max_new_tokens=8, eos_token_id=-1, pad_token_id=0)
    assert torch.equal(out[:, ids.shape[1]:], want)


def _two_rank_worker(rank, world, path, out):
    torch.manual_seed(0)
    import torch.distributed as dist

    b = _backend(path, group=dist.group.WORLD)
    ids = torch.randint(8, 100, (4, 12))
    b.train_step(ids, torch.ones_like(ids), lambda lp, rows: (-lp[rows].mean(), {}))
    full = b.full_state_dict()  # rank 0 holds the whole merged state
    shards = {n: (s, t.clone()) for n, (s, t) in b.local_shards().items()}
    torch.save({"full": full, "shards": shards}, Path(out) / f"rank{rank}.pt")


def test_two_fsdp2_ranks_send_merged_shards(tiny_ckpt, tmp_path):
    run_ranks(_two_rank_worker, 2, tmp_path / "store", str(tiny_ckpt), str(tmp_path))
    full = torch.load(tmp_path / "rank0.pt")["full"]
    seen = {}
    for r in range(2):
        for n, (start, t) in torch.load(tmp_path / f"rank{r}.pt")["shards"].items():
            box = tuple(slice(s, s + k) for s, k in zip(start, t.shape))
            assert torch.equal(t, full[n][box]), (r, n)
            seen[n] = seen.get(n, 0) + t.numel()
    assert seen == {n: t.numel() for n, t in full.items()}  # the two ranks' boxes tile every weight


BASE = ["+recipe=tiny_grpo", "launcher=dry_run", "trainer.lora.enabled=true"]


@pytest.mark.parametrize("overrides,key,fragment", [
    (["trainer.backend=megatron", "cluster=h100"], "trainer.lora.enabled", "megatron-core 0.16.1"),
    (["trainer.parallel.tp=2", "trainer.nodes=2"], "trainer.parallel.tp", "peft replaces"),
    (["algo.ref_kl_coef=0.01", "reference.checkpoint=tiny:other"], "reference.checkpoint", "adapters off"),
    (["algo.ref_kl_coef=0.01", "reference.nodes=2"], "reference.nodes", "no reference rank group"),
    (["trainer.lora.refit=adapter", "trainer.lora.rank=1024"], "trainer.lora.rank", "max_lora_rank is at most 512"),
    (["trainer.lora.rank=0"], "trainer.lora.rank", "at least 1"),
    (["trainer.lora.dropout=1.0"], "trainer.lora.dropout", "[0, 1)"),
    (["trainer.lora.enabled=false", "trainer.lora.export_merged=true"], "trainer.lora.export_merged", "ignored"),
    (["trainer.lora.enabled=false", "trainer.lora.rank=8"], "trainer.lora.rank", "ignored"),
])
def test_lora_refusals_name_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as e:
        load_config([*BASE, *overrides])
    hits = [v for v in e.value.violations if v.key == key]
    assert hits and fragment in hits[0].problem + hits[0].fix, e.value.render()


def test_lora_tiny_grpo_validates():
    cfg = load_config(BASE)
    assert cfg.trainer.lora.enabled and cfg.trainer.lora.refit == "merged"


@pytest.mark.parametrize("recipe,overrides", [
    ("tiny_grpo", ["algo.async_rollout.enabled=true", "algo.async_rollout.in_flight_weight_updates=true",
                   "algo.async_rollout.recompute_kv_cache_after_weight_updates=true"]),
    ("tiny_agentic_grpo", []),  # multi-turn episodes (env.agentic.environment)
])
def test_the_adapter_refit_validates_in_flight_and_with_episodes(recipe, overrides):
    """Both were refused before the engines served the adapter from the first request on and the
    serving loop passed it (refit/adapter_refit.py; tests/test_in_flight_adapter_refit.py)."""
    cfg = load_config([f"+recipe={recipe}", *BASE[1:], "trainer.lora.refit=adapter", *overrides])
    assert cfg.trainer.lora.refit == "adapter"


def test_engine_max_lora_rank_is_the_smallest_vllm_accepts():
    from hpc_rl.refit.adapter_refit import engine_lora_options

    ranks = [engine_lora_options(SimpleNamespace(rank=r))["max_lora_rank"] for r in (1, 4, 8, 9, 300, 512)]
    assert ranks == [1, 8, 8, 16, 320, 512]


def test_memory_model_counts_the_adapters_peft_builds(tiny_ckpt):
    from hpc_rl.config.memory_inputs import role_inputs
    from hpc_rl.memory.model import role_memory

    b = _backend(tiny_ckpt, lora=SimpleNamespace(**{**vars(LORA), "rank": 2}))
    live = sum(p.numel() for p in b.model.parameters() if p.requires_grad)
    full, lora = ([role_memory(r.shape, r.setup) for r in role_inputs(load_config(
        ["+recipe=tiny_grpo", "launcher=dry_run", f"model.path={tiny_ckpt}", *extra])) if r.role == "trainer"][0]
        for extra in ([], ["trainer.lora.enabled=true", "trainer.lora.rank=2"]))
    assert "LoRA: {:,} adapter parameters".format(live) in " ".join(lora.notes)
    step_full, step_lora = full.phases["optimizer step"], lora.phases["optimizer step"]
    assert step_lora < step_full
    # the frozen base keeps its fp32 weights only (4 of full fine-tuning's 16 bytes per parameter); the
    # adapters have weights, gradients, Adam's moments and the CPU step's temporaries (4 + 4 + 8 + 8)
    base = sum(p.numel() for p in b.model.parameters()) - live
    assert step_lora == 4 * base + 24 * live


def test_adapter_dropout_sends_old_logprobs_to_the_separate_pass():
    from hpc_rl.roles.old_logprobs import separate_pass_reason

    rows = [SimpleNamespace(version_first=0, version_last=0)] * 4
    assert separate_pass_reason(load_config(BASE), rows, None, 1, True) is None  # GRPO, one step: the training forward
    reason = separate_pass_reason(load_config([*BASE, "trainer.lora.dropout=0.1"]), rows, None, 1, True)
    assert reason and "trainer.lora.dropout" in reason
