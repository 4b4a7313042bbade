"""vLLM engines spanning several generator tasks (#14, engines/spanning.py): the plan's
seats and routes, the engine's arguments in each task, the flagship's checks with stand-in
checkpoints, and tiny_mopd with a TP-2 engine over two generator tasks as local processes
until a worker is killed, which ends the run naming the engine and the worker (the het job
is in tests/test_tensor_parallel_rl.py; 120 steps in bench/rl_results.py engine_span)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.engines.spanning import seat_of
from hpc_rl.messaging.routes import Routes
from hpc_rl.plan import build_plan
from hpc_rl.refit.vllm_engine import EngineSpan, engine_kwargs

TINY = ["+recipe=tiny_mopd", "launcher=dry_run"]
SPAN = ["generator.parallel.tp=2", "generator.tasks_per_node=2"]  # one core per task: the engine takes both tasks
SMALL = ["algo.prompts_per_step=32", "trainer.global_batch_size=32", "data.samples_per_task=32",
         "data.eval_prompts_per_task=8", "trainer.micro_batch_size=8"]


def test_seats_number_engines_and_their_tasks():
    assert [(s.engine, s.node, s.leader) for s in (seat_of(r, 2) for r in range(4))] == \
        [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False)]
    assert str(seat_of(5, 4)) == "engine 1 task 1/4"


def test_routes_send_orders_to_each_engine_leader_only():
    plan = build_plan(load_config(TINY + SPAN))
    routes = Routes.from_plan(plan)
    first_generator = plan.role("trainer").tasks
    assert plan.role("generator").tasks_per_replica == 2 and routes.engine_tasks == 2
    assert routes.generators == [first_generator]  # one engine: its first task
    assert routes.leads_engine(0) and not routes.leads_engine(1)
    # the flagship: 512 generator tasks make 64 TP-8 engines; orders and rows go to/from 64 ranks
    ultra = Routes.from_plan(build_plan(load_config(["+recipe=ultra_mopd"])))
    assert len(ultra.generators) == 64 and ultra.generators[1] - ultra.generators[0] == 8


def test_every_task_of_an_engine_builds_it_from_the_same_arguments_but_its_node_rank():
    span = EngineSpan(tasks=2, node=0, master_addr="10.0.0.1", master_port=29600)
    lead = engine_kwargs("/m", tensor_parallel=2, span=span)
    follow = engine_kwargs("/m", tensor_parallel=2, span=EngineSpan(2, 1, "10.0.0.1", 29600))
    assert {k for k in lead if lead[k] != follow[k]} == {"node_rank"}
    assert (lead["nnodes"], lead["master_addr"], lead["master_port"]) == (2, "10.0.0.1", 29600)
    assert "nnodes" not in engine_kwargs("/m", tensor_parallel=2)  # an engine inside one task


def test_an_in_process_core_keeps_a_tp1_worker_in_the_rank_and_the_jobs_world_out_of_its_sight(tmp_path):
    import torch.distributed as dist

    from hpc_rl.refit.vllm_engine import hidden_job_world

    # tp=1: the worker in the caller's process (uni); tp=2: processes of their own; a core of
    # its own (GPU, spanning engines): vLLM's default
    assert engine_kwargs("/m", tensor_parallel=1, in_process_core=True)["distributed_executor_backend"] == "uni"
    assert engine_kwargs("/m", tensor_parallel=2, in_process_core=True)["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in engine_kwargs("/m", tensor_parallel=1)
    # the job's group (here of 1) is hidden while an engine builds and the same one comes back
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        job = dist.group.WORLD
        with hidden_job_world():
            assert not dist.is_initialized()  # what vLLM's worker checks before making its own world
        assert dist.is_initialized() and dist.group.WORLD is job and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


ULTRA_TEACHERS = ("general", "rlhf", "ifbench", "reasoning", "swe")


def _stand_in(path: Path, arch: str, model_type: str, experts_key: str) -> str:
    """A stand-in checkpoint directory (config, tokenizer config, an empty weights file): the
    flagship's checks read shapes and files, not weights. Its shape is made up, not Ultra's."""
    path.mkdir(parents=True)
    path.joinpath("config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": model_type, "num_attention_heads": 64, "num_key_value_heads": 8,
        "hidden_size": 8192, "intermediate_size": 16384, "moe_intermediate_size": 2048, experts_key: 128,
        "vocab_size": 131072, "num_hidden_layers": 4}))
    path.joinpath("tokenizer_config.json").write_text("{}")
    path.joinpath("model.safetensors").write_bytes(b"")
    return str(path)


def _ultra_with(checkpoint: str, tmp_path: Path, *extra: str) -> list:
    # cluster.gpu_memory_gib=null: no memory fit check here (tests/test_memory_model.py has it: the
    # stand-in checkpoints' shapes are not the flagship's).
    return ["+recipe=ultra_mopd", "launcher=slurm", f"model.path={checkpoint}", f"run.dir={tmp_path / 'run'}",
            *[f"teachers.{t}.checkpoint={checkpoint}" for t in ULTRA_TEACHERS], "cluster.gpu_memory_gib=null", *extra]


def _nemotron_h_stand_in(path: Path) -> str:
    """A Nemotron-H stand-in (config, tokenizer config, an empty weights file) whose layers,
    Mamba heads and groups, attention heads and experts split over the flagship's layouts
    (trainer tp 8 x cp 32 x ep 64, teachers tp 8 x cp 2 x ep 16, engines TP 8 / EP 8). Made
    up in the shape of NVIDIA's published Nemotron-H configs, not Ultra's own numbers."""
    pattern = "MEMEMEM*E" * 4 + "MEMEM*EM"
    path.mkdir(parents=True)
    path.joinpath("config.json").write_text(json.dumps({
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern), "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "mamba_num_heads": 256, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
        "conv_kernel": 4, "chunk_size": 128, "intermediate_size": 16384, "n_routed_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "moe_shared_expert_intermediate_size": 4096, "moe_latent_size": 1024, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 131072, "tie_word_embeddings": False}))
    path.joinpath("tokenizer_config.json").write_text("{}")
    path.joinpath("model.safetensors").write_bytes(b"")
    return str(path)


@pytest.mark.parametrize("cluster", ["gb200_nvl72", "h100"])
def test_the_flagship_with_nemotron_h_checkpoints_passes_every_check(tmp_path, capsys, cluster):
    """Issue #25: `+recipe=ultra_mopd launcher=slurm` with Nemotron-H checkpoints of the
    flagship's family leaves no key refused, and its dry run lists nothing this version
    cannot run (the submission itself is not made here)."""
    from hpc_rl.launch import main
    from hpc_rl.launchers.runnable import check_runnable

    ckpt = _nemotron_h_stand_in(tmp_path / "nemotron_h")
    extra = ["cluster=h100", "trainer.nodes=32"] if cluster == "h100" else []
    cfg = load_config(_ultra_with(ckpt, tmp_path, "model.num_experts=128", *extra))
    check_runnable(cfg)  # raises ConfigError naming anything this version would refuse
    assert (cfg.trainer.backend, cfg.model.architecture) == ("megatron", "nemotron_h")
    dry = ["+recipe=ultra_mopd", f"model.path={ckpt}", "model.num_experts=128", f"run.dir={tmp_path / 'dry'}",
           *[f"teachers.{t}.checkpoint={ckpt}" for t in ULTRA_TEACHERS], *extra]
    assert main(dry) == 0
    text = capsys.readouterr()
    assert "cannot run yet" not in text.out + text.err


def test_the_flagships_mamba_layout_is_checked_against_its_checkpoint_before_submission(tmp_path):
    """A checkpoint whose Mamba groups do not split over the trainer's tensor parallel is
    refused at launch, naming the rule megatron-core would assert on at start-up."""
    from hpc_rl.config import ConfigError
    from hpc_rl.launchers.runnable import check_runnable

    ckpt = Path(_nemotron_h_stand_in(tmp_path / "nemotron_h"))
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, n_groups=4)))
    with pytest.raises(ConfigError) as info:
        check_runnable(load_config(_ultra_with(str(ckpt), tmp_path, "model.num_experts=128")))
    found = [v for v in info.value.violations if v.key == "trainer.parallel"]
    assert found and "must divide the 4 Mamba groups" in found[0].problem, [v.render() for v in info.value.violations]


def test_the_flagships_shape_passes_every_check_with_an_moe_checkpoint_of_a_supported_architecture(tmp_path):
    from hpc_rl.launchers.runnable import check_runnable

    ckpt = _stand_in(tmp_path / "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", "num_experts")
    cfg = load_config(_ultra_with(ckpt, tmp_path, "model.architecture=qwen3_moe", "model.num_experts=128"))
    check_runnable(cfg)  # raises ConfigError naming anything this version would refuse
    assert (cfg.generator.parallel.tp, cfg.generator.parallel.ep, cfg.cluster.name) == (8, 8, "gb200_nvl72")


def test_an_expert_parallel_engine_needs_routed_experts(tmp_path):
    from hpc_rl.config import ConfigError
    from hpc_rl.launchers.runnable import check_runnable

    ckpt = _stand_in(tmp_path / "dense", "Qwen3MoeForCausalLM", "qwen3_moe", "no_experts_here")
    with pytest.raises(ConfigError) as info:
        check_runnable(load_config(_ultra_with(ckpt, tmp_path, "model.architecture=qwen3_moe")))
    found = [v for v in info.value.violations if v.key == "generator.parallel.ep"]
    assert found and "has no routed experts" in found[0].problem and found[0].fix == "set generator.parallel.ep=1"


def _launch(*args, **kw):
    cmd = [sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_mopd", *SPAN, *SMALL, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _logs(run: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("*.out")))


@pytest.mark.slow
def test_an_engine_spanning_two_tasks_runs_tiny_mopd_until_a_worker_dies_and_the_run_names_it(tmp_path):
    run = tmp_path / "run"
    proc = _launch("run.max_steps=30", f"run.dir={run}", "ft.progress_timeout_s=60")
    deadline, pid = time.monotonic() + 600, None
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"hosting the engine's workers from tp1, pids \[(\d+)\]", _logs(run)) if (run / "logs").exists() else None
        metrics = run / "metrics.jsonl"
        if found and metrics.exists() and '"kind": "step"' in metrics.read_text():
            pid = int(found.group(1))
            break
        time.sleep(1)
    assert pid is not None, "the run never reached its first step"
    # up to here the engine spanning two tasks ran tiny_mopd: both workers joined the refit group
    # (trainer rank 0, workers 1 and 2) and the first step sampled on refitted weights
    logs = _logs(run)
    assert "engine 0 spans generator tasks 0-1" in logs
    assert "engine 0 joined the refit group: 2 worker(s) as refit ranks [1, 2]" in logs
    first = next(json.loads(x) for x in metrics.read_text().splitlines() if '"kind": "step"' in x)
    assert first["token_mult_prob_error"] <= 1.001
    os.kill(pid, signal.SIGKILL)  # the follower task's vLLM worker (TP rank 1) dies mid-run
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert max(steps) < 30
    errors = "".join(p.read_text() for p in (run / "errors").glob("*"))
    named = f"vLLM engine 0: worker tp1 (pid {pid}, hosted by its task 1) was killed by SIGKILL (signal 9) from outside"
    assert named in errors, errors[-3000:]
    assert "hpc_rl: run failed in generator:" in err and "worker tp1" in err + out, (out[-2000:], err[-2000:])


def test_an_injected_failure_on_a_follower_fires_at_its_engines_step():
    from types import SimpleNamespace

    from hpc_rl.roles.generator import STEP_KEY, EngineFollowerRole

    import torch.distributed as dist

    from hpc_rl.runtime.signed_store import SignedStore, new_job_key

    store = SignedStore(dist.HashStore(), new_job_key().encode())  # the job's store, signed, in memory
    role = object.__new__(EngineFollowerRole)  # its workers are not needed to watch the steps
    role.seat, role._step = seat_of(1, 2), 0
    role.ctx = SimpleNamespace(store=store, cfg=SimpleNamespace(ft=SimpleNamespace(inject_failure="generator:1@3")),
                               ident=SimpleNamespace(role="generator", role_rank=1, restart=0))
    role._watch()  # the leader has not sampled a step yet
    store.set(STEP_KEY.format(restart=0, engine=0), "2")
    role._watch()
    store.raw.set(STEP_KEY.format(restart=0, engine=0), "9")  # forged (no MAC): ignored
    role._watch()
    store.set(STEP_KEY.format(restart=0, engine=0), "4")  # the watch missed step 3: it still fires for it
    with pytest.raises(RuntimeError, match=r"injected failure on generator:1 at step 3"):
        role._watch()
