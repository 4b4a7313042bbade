"""Tiny model assets: built deterministically, self-contained checkpoints, cached by spec."""

from __future__ import annotations

from hpc_rl.models.assets import AssetSpec, ModelSpec, TrainSpec, build_assets
from hpc_rl.models.fsdp2 import check_checkpoint

MICRO = AssetSpec(
    model=ModelSpec(hidden=32, intermediate=64, layers=1, heads=2, max_positions=128),
    models=(("student", TrainSpec(("addition", "multiplication"), steps=3, batch=8, seed=1)),
            ("teacher_add", TrainSpec(("addition",), steps=3, batch=8, seed=2))),
    eval_samples=2,
)


def test_build_is_cached_and_checkpoints_are_self_contained(tmp_path):
    from transformers import AutoTokenizer

    logs = []
    assets = build_assets(MICRO, root=tmp_path, log=logs.append)
    assert set(assets.manifest["models"]) == {"student", "teacher_add"}
    assert any("training teacher_add" in line for line in logs)
    for name in ("student", "teacher_add"):
        cfg = check_checkpoint(str(assets[name]))  # weights + tokenizer + Llama architecture
        assert cfg["num_hidden_layers"] == 1
        tok = AutoTokenizer.from_pretrained(assets[name])
        text = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], tokenize=False,
                                       add_generation_prompt=True)
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    stamp = (assets.root / "manifest.json").stat().st_mtime
    again = build_assets(MICRO, root=tmp_path, log=logs.append)
    assert again.root == assets.root and (again.root / "manifest.json").stat().st_mtime == stamp
    assert sum("training" in line for line in logs) == 2  # nothing retrained
    other = AssetSpec(model=MICRO.model, models=MICRO.models[:1], eval_samples=2)
    assert other.key() != MICRO.key()


def test_the_shipped_sets_are_current_and_copied_into_an_empty_cache(tmp_path):
    """tiny_assets/: each shipped set is a current spec's (a stale one fails here), and an
    empty cache gets a byte-identical copy without training anything."""
    from hpc_rl.models.asset_cache import SHIPPED
    from hpc_rl.models.assets import ASSET_SETS

    shipped = sorted(p.name for p in SHIPPED.glob("tiny-*"))
    keys = {f"tiny-{spec.key()}": name for name, spec in ASSET_SETS.items()}
    assert shipped and set(shipped) <= set(keys), f"stale shipped sets: {set(shipped) - set(keys)}"
    assert {keys[s] for s in shipped} == {"tiny", "tiny_moe", "tiny_agentic"}  # what the suite and the demo use
    logs = []
    assets = build_assets(ASSET_SETS["tiny"], root=tmp_path, log=logs.append)
    assert logs == []  # nothing trained
    for f in (SHIPPED / assets.root.name).rglob("*"):
        if f.is_file():
            assert (assets.root / f.relative_to(SHIPPED / assets.root.name)).read_bytes() == f.read_bytes(), f
