"""Checkpoints: bit-exact resume, atomicity, corruption fallback, retention, incompatibility,
FSDP2 sharding over 2 gloo ranks, and Hugging Face export — all on a real tiny Llama on disk."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpc_rl.ckpt import (
    IncompatibleCheckpointError,
    apply_retention,
    capture_rng_state,
    export_hf,
    find_resumable,
    list_checkpoints,
    load_checkpoint,
    model_fingerprint,
    read_status,
    restore_rng_state,
    save_checkpoint,
)
from hpc_rl.ckpt import checkpoint as ckpt_mod
from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig, check_checkpoint

from gloo_ranks import run_ranks

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
OPT = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)
RECIPE = "test_recipe"
CONFIG_YAML = f"recipe: {RECIPE}\ncheckpoint:\n  every_steps: 2\n  keep_last: 2\n"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _train_step(backend: FSDP2Backend) -> None:
    """One step whose batch depends on all three RNGs, the way a data loader with shuffling
    (python), augmentation (numpy) and sampling (torch) would: a resume that restores any one
    of them wrongly trains on other data and the weights diverge."""
    ids = torch.randint(8, 100, (4, 12))
    attn = torch.ones_like(ids)
    attn[1, random.randint(4, 11):] = 0
    scale = float(np.random.uniform(0.5, 1.5))

    def loss(lp, rows):
        m = attn[rows].float()
        return -scale * (lp * m).sum() / m.sum(), {}

    backend.train_step(ids, attn, loss)


def _optim_tensors(backend: FSDP2Backend) -> dict:
    names = {id(p): n for n, p in backend.model.named_parameters()}
    return {(names[id(p)], k): v.clone() for p, st in backend.optimizer.state.items() for k, v in st.items()}


def _snapshot(backend: FSDP2Backend) -> dict:
    return {"weights": {k: v.clone() for k, v in backend.full_state_dict().items()},
            "optim": _optim_tensors(backend), "step_count": backend.step_count}


def _assert_same(got: dict, want: dict) -> None:
    assert got["step_count"] == want["step_count"]
    assert set(got["weights"]) == set(want["weights"])
    for k, v in want["weights"].items():
        assert torch.equal(got["weights"][k], v), k
    assert set(got["optim"]) == set(want["optim"]) and want["optim"]
    for k, v in want["optim"].items():
        assert torch.equal(got["optim"][k], v), k


@dataclass
class Uninterrupted:
    root: Path
    at_step4: dict
    at_step6: dict
    rng_draws_after6: tuple


def _rng_draws() -> tuple:
    return torch.rand(3), np.random.rand(3), random.random()


@pytest.fixture(scope="module")
def uninterrupted(tiny_ckpt, tmp_path_factory) -> Uninterrupted:
    """Six training steps in one go, checkpointing at steps 2 and 4 on the way."""
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    _seed_all(0)
    backend = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    at4 = None
    for step in range(1, 7):
        _train_step(backend)
        if step in (2, 4):
            save_checkpoint(root, step, backend, {"rng": capture_rng_state(), "data_pos": step * 4}, CONFIG_YAML)
            if step == 4:
                at4 = _snapshot(backend)
    return Uninterrupted(root, at4, _snapshot(backend), _rng_draws())


def _copy_root(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "checkpoints"
    shutil.copytree(src, dst)
    return dst


def _fp(tiny_ckpt) -> dict:
    return model_fingerprint(FSDP2Backend(str(tiny_ckpt), train=False).model)


# ---------------------------------------------------------------------------------------------


def test_resume_from_step4_continues_bit_for_bit(tiny_ckpt, uninterrupted):
    root = uninterrupted.root
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]
    status = read_status(root)
    assert status["step"] == 4 and Path(status["path"]) == (root / "step_00000004").resolve()
    manifest = json.loads((root / "step_00000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["recipe"] == RECIPE and manifest["backend_step_count"] == 4
    assert manifest["fingerprint"]["model.embed_tokens.weight"][1] == SPEC.hidden
    assert {"config.yaml", "extra_state_rank00000.pt"} <= {f for f, e in manifest["files"].items() if "sha256" in e}
    assert any(f.startswith("dcp/") for f in manifest["files"])
    assert (root / "step_00000004" / "config.yaml").read_text() == CONFIG_YAML

    # A restarted process: other RNG states, a freshly loaded model and optimizer.
    _seed_all(12345)
    resumed = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    scan = find_resumable(root, model_fingerprint(resumed.model), RECIPE)
    assert scan.path == root / "step_00000004" and scan.step == 4 and scan.skipped == []
    extra = load_checkpoint(scan.path, resumed)
    restore_rng_state(extra["rng"])
    assert extra["data_pos"] == 16
    _assert_same(_snapshot(resumed), uninterrupted.at_step4)

    for _ in range(2):
        _train_step(resumed)
    _assert_same(_snapshot(resumed), uninterrupted.at_step6)
    draws = _rng_draws()
    assert torch.equal(draws[0], uninterrupted.rng_draws_after6[0])
    assert np.array_equal(draws[1], uninterrupted.rng_draws_after6[1])
    assert draws[2] == uninterrupted.rng_draws_after6[2]


def test_kill_during_save_leaves_tmp_that_is_ignored_then_removed(tiny_ckpt, uninterrupted, tmp_path, monkeypatch):
    root = _copy_root(uninterrupted.root, tmp_path)
    backend = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    load_checkpoint(root / "step_00000004", backend)
    _train_step(backend)

    # Die after the shards, extra state and config are written but before the manifest and
    # rename: exactly the window a SIGKILL during a save would hit.
    def killed(path):
        raise SystemExit("killed mid-save")
    monkeypatch.setattr(ckpt_mod, "_sha256", killed)
    with pytest.raises(SystemExit):
        save_checkpoint(root, 6, backend, {"data_pos": 24}, CONFIG_YAML)
    monkeypatch.undo()

    stale = list(root.glob(".tmp_step_6_*"))
    assert len(stale) == 1 and (stale[0] / "dcp").is_dir() and not (stale[0] / "manifest.json").exists()
    assert not (root / "step_00000006").exists() and read_status(root)["step"] == 4

    scan = find_resumable(root, model_fingerprint(backend.model), RECIPE)
    assert scan.path == root / "step_00000004" and scan.skipped == []

    apply_retention(root, keep_last=2)
    assert not stale[0].exists()
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]


@pytest.mark.parametrize("damage", ["flip_byte_extra", "truncate_dcp_shard", "delete_config", "garbage_manifest"])
def test_corrupt_newest_falls_back_to_previous_and_reports(tiny_ckpt, uninterrupted, tmp_path, damage):
    root = _copy_root(uninterrupted.root, tmp_path)
    newest = root / "step_00000004"
    if damage == "flip_byte_extra":
        f = newest / "extra_state_rank00000.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
        reason = "sha256 mismatch for extra_state_rank00000.pt"
    elif damage == "truncate_dcp_shard":
        shard = sorted((newest / "dcp").glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
        reason = f"dcp/{shard.name} is 100 bytes"
    elif damage == "delete_config":
        (newest / "config.yaml").unlink()
        reason = "missing file config.yaml"
    else:
        (newest / "manifest.json").write_text("{not json")
        reason = "unreadable manifest.json"

    scan = find_resumable(root, _fp(tiny_ckpt), RECIPE)
    assert scan.path == root / "step_00000002" and scan.step == 2
    assert len(scan.skipped) == 1 and scan.skipped[0][0] == newest
    assert reason in scan.skipped[0][1]
    # The fallback really loads.
    backend = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    assert load_checkpoint(scan.path, backend)["data_pos"] == 8 and backend.step_count == 2


def test_nothing_to_resume_starts_fresh(tiny_ckpt, tmp_path):
    scan = find_resumable(tmp_path / "none_yet", _fp(tiny_ckpt), RECIPE)
    assert not scan and scan.path is None and scan.skipped == []


def test_retention_keep_last_2_keep_every_3_over_steps_1_to_7(tiny_ckpt, tmp_path):
    root = tmp_path / "checkpoints"
    backend = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    _seed_all(0)
    kept_after = {}
    for step in range(1, 8):
        _train_step(backend)
        save_checkpoint(root, step, backend, {"data_pos": step}, CONFIG_YAML)
        apply_retention(root, keep_last=2, keep_every=3)
        kept_after[step] = {s for s, _ in list_checkpoints(root)}
    # newest two: {6, 7}; multiples of 3: {3, 6}
    assert kept_after[7] == {3, 6, 7}
    assert kept_after[2] == {1, 2} and kept_after[4] == {3, 4} and kept_after[5] == {3, 4, 5}

    # Stale temporaries and a step directory without a manifest go; complete ones stay.
    (root / ".tmp_step_8_abc").mkdir()
    (root / ".tmp_latest_checkpoint_status.json.abc").write_text("{}")
    (root / "step_00000008").mkdir()
    removed = {p.name for p in apply_retention(root, keep_last=2, keep_every=3)}
    assert removed == {".tmp_step_8_abc", ".tmp_latest_checkpoint_status.json.abc", "step_00000008"}
    assert {s for s, _ in list_checkpoints(root)} == {3, 6, 7}
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        apply_retention(root, keep_last=0, keep_every=3)


def test_incompatible_checkpoint_names_the_difference(tiny_ckpt, uninterrupted, tmp_path):
    root = _copy_root(uninterrupted.root, tmp_path)
    fp = _fp(tiny_ckpt)
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"recipe 'test_recipe' \(checkpoint\) vs 'ultra_mopd' \(this run\).*checkpoint\.dir="):
        find_resumable(root, fp, "ultra_mopd")

    vocab, hidden = fp["model.embed_tokens.weight"]
    wider = {**fp, "model.embed_tokens.weight": [vocab, 64]}
    with pytest.raises(IncompatibleCheckpointError) as e:
        find_resumable(root, wider, RECIPE)
    msg = str(e.value)
    assert f"parameter model.embed_tokens.weight shape [{vocab}, {hidden}] (checkpoint) vs [{vocab}, 64] (this run)" in msg
    assert "checkpoint.dir=<new dir>" in msg and str(root) in msg and "recipe '" not in msg

    fewer = {k: v for k, v in fp.items() if "layers.1." not in k}
    with pytest.raises(IncompatibleCheckpointError, match=r"parameter model\.layers\.1\.\S+ only in the checkpoint"):
        find_resumable(root, fewer, RECIPE)


def test_export_hf_loads_with_automodel_and_matches_logits(tiny_ckpt, uninterrupted, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    load_checkpoint(uninterrupted.root / "step_00000004", backend)
    out = export_hf(backend, tmp_path / "hf", tokenizer_dir=tiny_ckpt)
    check_checkpoint(str(out))  # what the trainer and vLLM loaders demand
    assert (out / "model.safetensors").exists() and not list(tmp_path.glob(".tmp_export_*"))

    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("hello world")["input_ids"] + list(range(8, 20))])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        want = backend.model.eval()(input_ids=ids, attention_mask=attn).logits
        got = hf(input_ids=ids, attention_mask=attn).logits
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    # The exported weights are the trained ones, not the starting checkpoint's.
    start = AutoModelForCausalLM.from_pretrained(tiny_ckpt, torch_dtype=torch.float32)
    assert not torch.equal(start.lm_head.weight, hf.lm_head.weight)

    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(backend, out)
    # Sharded output (tiny shard limit) loads the same.
    sharded = export_hf(backend, tmp_path / "hf_sharded", max_shard_bytes=64 * 1024)
    assert (sharded / "model.safetensors.index.json").exists()
    hf2 = AutoModelForCausalLM.from_pretrained(sharded, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(hf2(input_ids=ids, attention_mask=attn).logits, got)


# ---------------------------------------------------------------------------------------------
# FSDP2 over two gloo ranks


def _sharded_worker(rank: int, world: int, tiny: str, root: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    def full_optim(b):
        sd = get_optimizer_state_dict(b.model, b.optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # cpu_offload gathers on rank 0 only; Adam's scalar `step` tensors come back by reference
        # and the next step would bump them in place.
        return {name: {k: v.clone() for k, v in st.items()} for name, st in sd.get("state", {}).items()}  # rank 0 only

    group = dist.group.WORLD
    _seed_all(0)
    backend = FSDP2Backend(tiny, group=group, optim=OPT)
    _train_step(backend)
    path = save_checkpoint(root, 1, backend, {"rank": rank, "rng": capture_rng_state()}, CONFIG_YAML, group=group)
    saved_w, saved_o = backend.full_state_dict(), full_optim(backend)
    _train_step(backend)  # move on, so the reload below must really restore
    # Reloading into the moved-on backend (not a fresh one) spares a second model build in each
    # spawned rank; every restored tensor still has to come from the checkpoint to compare equal.
    extra = load_checkpoint(path, backend, group=group)
    loaded_w, loaded_o = backend.full_state_dict(), full_optim(backend)
    export_hf(backend, Path(root).parent / "hf_from_sharded", group=group)
    if rank == 0:
        torch.save({"path": str(path), "extra_rank": extra["rank"], "step_count": backend.step_count,
                    "saved_w": saved_w, "saved_o": saved_o, "loaded_w": loaded_w, "loaded_o": loaded_o}, out)
    else:
        assert extra["rank"] == 1  # each rank gets its own extra state back


def test_fsdp2_two_gloo_ranks_save_and_reload_same_full_state(tiny_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "checkpoints"
    out = tmp_path / "result.pt"
    run_ranks(_sharded_worker, 2, tmp_path / "store", str(tiny_ckpt), str(root), str(out))
    got = torch.load(out, weights_only=False)
    assert got["extra_rank"] == 0 and got["step_count"] == 1
    manifest = json.loads((root / "step_00000001" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {"extra_state_rank00000.pt", "extra_state_rank00001.pt"} <= set(manifest["files"])
    # Each rank wrote its own shard file.
    assert len(list((root / "step_00000001" / "dcp").glob("*.distcp"))) == 2

    assert set(got["loaded_w"]) == set(got["saved_w"])
    for k, v in got["saved_w"].items():
        assert torch.equal(got["loaded_w"][k], v), k
    assert set(got["loaded_o"]) == set(got["saved_o"]) and got["saved_o"]
    for name, st in got["saved_o"].items():
        for k, v in st.items():
            assert torch.equal(got["loaded_o"][name][k], v), (name, k)

    # DCP reshards: the 2-rank checkpoint loads into one unsharded process (with rank 0's extra state).
    single = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    scan = find_resumable(root, model_fingerprint(single.model), RECIPE)
    assert load_checkpoint(scan.path, single)["rank"] == 0 and single.step_count == 1
    for k, v in single.full_state_dict().items():
        assert torch.equal(v, got["saved_w"][k]), k

    # export_hf from the sharded backend: rank 0 wrote the gathered weights.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_from_sharded", torch_dtype=torch.float32)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, got["saved_w"][k]), k
