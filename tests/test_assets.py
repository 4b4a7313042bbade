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
