"""Validation: every invalid config gets an error naming the key, the value and a fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.support import render_unsupported, unsupported

ULTRA = ["+recipe=ultra_mopd"]

# (overrides on top of ultra_mopd, the key the violation must name, a fragment of its text)
INVALID = [
    (["trainer.parallel.ep=48"], "trainer.parallel.ep", "must divide the 256 GPUs of a pipeline stage"),
    (["trainer.nodes=32"], "trainer.parallel", "tp*cp*pp = 256 does not divide the role's 128 GPUs"),
    (["trainer.parallel.dp=2"], "trainer.parallel", "tp*cp*pp*dp = 512 but the role has 256 GPUs"),
    (["trainer.segment_size=12"], "trainer.segment_size", "segments of 12 nodes do not divide the role's 64 nodes"),
    (["trainer.segment_size=8"], "trainer.segment_size", "an EP group spans 16 nodes and must sit inside one segment"),
    (["trainer.segment_size=32"], "trainer.segment_size", "must fit in one NVLink domain (16 usable nodes of 18"),
    (["generator.segment_size=3"], "generator.segment_size", "segments of 3 nodes do not divide the role's 128 nodes"),
    (["generator.segment_size=1"], "generator.segment_size", "one vLLM instance (tp*pp = 8) spans 2 nodes"),
    (["teachers.rlhf.parallel.ep=5"], "teachers.rlhf.parallel.ep", "must divide the 16 GPUs"),
    (["routing.default=math"], "routing.default", "is not a defined teacher"),
    (["+routing.agents.coder=[my_agent]"], "routing.agents.coder", "routes to 'coder', which is not a defined teacher"),
    (["routing.agents.rlhf=[lc_judge_simple_agent]"], "routing.agents.rlhf", "is also routed to 'general'"),
    (["routing.agents.rlhf=[swe_pivot_django]"], "routing.agents.swe", "is also routed to 'rlhf' (by 'swe_pivot_django')"),
    (["teachers.swe.checkpoint=/checkpoints/ultra_mopd/teacher-general", "teachers.swe.nodes=8"],
     "teachers.swe.nodes", "shares checkpoint '/checkpoints/ultra_mopd/teacher-general' with 'general'"),
    (["teachers.ifbench.checkpoint=''"], "teachers.ifbench.checkpoint", "every teacher needs a checkpoint"),
    (["+trainer.nodez=3"], "trainer.nodez", "unknown key"),
    (["trainer.nodes=many"], "trainer.nodes", "must be an integer"),
    (["trainer.micro_batch_size=3"], "trainer.global_batch_size", "must divide by data parallel x micro batch = 1 x 3"),
    (["algo.prompts_per_step=1000"], "algo.prompts_per_step", "1000 rollouts per step is not a whole number of trainer batches (1024)"),
    (["trainer.max_seq_len=196600"], "trainer.max_seq_len", "multiples of 512 tokens"),
    (["generator.gpu_memory_utilization=1.5"], "generator.gpu_memory_utilization", "must lie in (0, 1]"),
    (["algo.name=grpo"], "algo.generations_per_prompt", "needs at least 2 generations"),
    (["algo.mismatch.min=1.5"], "algo.mismatch", "0 <= min <= 1 <= max"),
    (["trainer.optimizer.betas=[0.9,1.5]"], "trainer.optimizer.betas", "two numbers in [0, 1)"),
    (["trainer.scheduler.warmup_start_lr=1e-5"], "trainer.scheduler.warmup_start_lr", "must lie in [0, optimizer.lr"),
    (["launcher.name=slrum"], "launcher.name", "did you mean 'slurm'"),
    (["cluster=local_slurm"], "cluster.max_nodes", "the job needs 224 nodes"),  # het components never share a node
    (["cluster=local_slurm"], "trainer.backend", "Megatron-core's forward path needs CUDA"),
    (["trainer.parallel.tp=1", "trainer.parallel.cp=32"], "trainer.sequence_parallel", "needs tp > 1"),
    (["algo.async_rollout.enabled=false"], "algo.async_rollout.in_flight_weight_updates", "need asynchronous rollouts"),
    (["algo.async_rollout.in_flight_weight_updates=false", "algo.async_rollout.recompute_kv_cache_after_weight_updates=true"],
     "algo.async_rollout.recompute_kv_cache_after_weight_updates", "nothing to recompute"),
    (["algo.mismatch.kind=none"], "algo.mismatch.kind", "importance-sampling correction"),
    (["generator.sampling.min_tokens=-1"], "generator.sampling.min_tokens", "must lie in [0, max_tokens=196608]"),
    (["algo.async_rollout.max_trajectory_age_steps=0"], "algo.async_rollout.max_trajectory_age_steps", "every sample is 1 step old"),
    (["trainer.nodez=3"], "trainer.nodez", "did you mean trainer.nodes?"),
    (["refit.timeout_s=0"], "refit.timeout_s", "a refit without a deadline can hang the job"),
    (["refit.bucket_mb=0"], "refit.bucket_mb", "must be >= 1"),
    (["refit.transport=ucx"], "refit.transport", "torch"),
    (["ft.inject_failure=trainer:0:stall@4"], "ft.inject_failure", "stall<seconds>"),
    (["cluster.nvlink_domain_nodes=8"], "cluster.nvlink_domain_nodes", "fewer nodes than its 16 usable ones"),
    (["generator.max_model_len=262144"], "generator.max_model_len", "exceeds trainer.max_seq_len=196608"),
]


def _violations(overrides):
    with pytest.raises(ConfigError) as info:
        load_config(ULTRA + overrides)
    return info.value.violations


@pytest.mark.parametrize("overrides,key,fragment", INVALID, ids=[" ".join(o) for o, _, _ in INVALID])
def test_invalid_config_names_key_value_and_fix(overrides, key, fragment):
    violations = _violations(overrides)
    matching = [v for v in violations if v.key == key and fragment in v.problem + " " + v.fix]
    assert matching, f"expected {key!r} with {fragment!r}; got:\n" + "\n".join(v.render() for v in violations)
    for v in matching:
        assert v.fix, "every violation carries a fix"


def test_every_violation_reported_at_once():
    violations = _violations(["trainer.parallel.ep=48", "routing.default=math", "generator.gpu_memory_utilization=0",
                              "+env.colour=blue"])
    keys = {v.key for v in violations}
    assert {"trainer.parallel.ep", "routing.default", "generator.gpu_memory_utilization", "env.colour"} <= keys


def test_valid_overrides_compose():
    cfg = load_config(ULTRA + ["cluster=h100", "trainer.nodes=32"])
    assert cfg.cluster.name == "h100" and cfg.cluster.gpus_per_node == 8
    assert cfg.trainer.nodes == 32
    # a smaller EP that still tiles the trainer and sits inside a rack is fine on GB200
    assert load_config(ULTRA + ["trainer.parallel.ep=32"]).trainer.parallel.ep == 32


def test_injection_specs_parse():
    from hpc_rl.runtime.faults import Injection, parse_injection, parse_injections

    assert parse_injection("trainer:0:stall12@4") == Injection("trainer", 0, "stall", 12, 4)
    assert parse_injection("teacher/general:1:kill@save4") == Injection("teacher/general", 1, "kill", 0, "save4")
    assert parse_injection("generator:0") == Injection("generator", 0, "raise", 0, None)
    # several in one job, each on its attempt (the chaos drills that share a job)
    assert parse_injections("trainer:0:stall60@3+teacher/general:1:kill@6/restart1") == [
        Injection("trainer", 0, "stall", 60, 3, 0), Injection("teacher/general", 1, "kill", 0, 6, 1)]
    for bad in ("trainer:0@3+trainer:0@3", "trainer:0/restartx", "trainer:0+"):
        with pytest.raises(ValueError):
            parse_injections(bad)
    with pytest.raises(ConfigError) as info:
        load_config(["+recipe=tiny_grpo", "ft.inject_failure=trainer:0@3+teacher:0@4/restart1"])
    assert [v.key for v in info.value.violations] == ["ft.inject_failure"]
    assert "several joined by '+'" in info.value.violations[0].problem


def test_strict_routing_needs_no_default():
    cfg = load_config(ULTRA + ["routing.default=null", "routing.strict=true"])
    assert cfg.routing.strict and cfg.routing.default is None
    with pytest.raises(ConfigError) as info:
        load_config(ULTRA + ["routing.default=null"])
    assert [v.key for v in info.value.violations] == ["routing.default"]


def test_unknown_recipe_and_cluster_list_the_choices():
    with pytest.raises(ConfigError) as info:
        load_config(["+recipe=ultra_mpod"])
    assert "ultra_mopd" in info.value.violations[0].fix
    with pytest.raises(ConfigError) as info:
        load_config(ULTRA + ["cluster=gb300"])
    assert "gb200_nvl72" in info.value.violations[0].fix


def test_cli_exits_2_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *ULTRA, "trainer.parallel.ep=48",
                           f"run.root_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "trainer.parallel.ep = 48" in proc.stderr and "fix:" in proc.stderr
    assert "nothing was submitted" in proc.stderr
    assert not any(tmp_path.iterdir()), "a refused config leaves no run directory"


# Valid configs this version's runtime cannot honour: `unsupported` (hpc_rl/config/support.py)
# refuses them for real launches; the dry run plans them and lists them.
TINY = ["+recipe=tiny_mopd", "launcher=dry_run"]
UNSUPPORTED = [
    (TINY + ["generator.tasks_per_node=2", "generator.parallel.tp=2", "generator.parallel.ep=2"], "generator.parallel.ep",
     "ignores vLLM's expert map"),
    (TINY + ["generator.tasks_per_node=2", "generator.parallel.pp=2"], "generator.parallel.pp", "pipeline parallelism in the engine cannot be launched"),
    (TINY + ["generator.tasks_per_node=2", "generator.parallel.cp=2"], "generator.parallel.cp", "context parallelism in the engine cannot be launched"),
    (TINY + ["trainer.tasks_per_node=4", "trainer.parallel.cp=2", "trainer.parallel.tp=2"], "trainer.parallel.cp",
     "not both in one model"),
    (TINY + ["+teachers.add.tasks_per_node=2", "+teachers.add.parallel.pp=2"], "teachers.add.parallel.pp", "inference only"),
    (TINY + ["env.precision=fp32"], "env.precision", "load no model"),
    (TINY + ["trainer.tasks_per_node=2", "trainer.parallel.ep=2"], "trainer.parallel.ep", "only for an MoE student"),
    (TINY + ["model.architecture=gpt2"], "model.architecture", "generic: any other *ForCausalLM"),
    (ULTRA + ["model.architecture=gpt2"], "model.architecture", "converts llama, qwen2, qwen3, qwen3_moe, nemotron_h"),
    (ULTRA + ["trainer.backend=fsdp2"], "trainer.parallel.cp", "not both in one model"),
    (ULTRA + ["trainer.backend=fsdp2"], "trainer.parallel.ep", "only for an MoE student"),
]


@pytest.mark.parametrize("overrides,key,fragment", UNSUPPORTED, ids=[" ".join(o[1:]) or k for o, k, _ in UNSUPPORTED])
def test_unsupported_settings_are_valid_but_refused_naming_key_and_fix(overrides, key, fragment):
    cfg = load_config(overrides)  # structurally valid: the dry run plans it
    found = [v for v in unsupported(cfg) if v.key == key]
    assert found and fragment in found[0].problem + " " + found[0].fix, [v.render() for v in unsupported(cfg)]
    assert key in found[0].fix


@pytest.mark.parametrize("recipe", ["tiny_mopd", "tiny_mopd_moe", "tiny_mopd_nemotron", "tiny_grpo", "ultra_mopd_tiny", "comm_check"])
def test_shipped_runnable_recipes_ask_for_nothing_unsupported(recipe):
    assert unsupported(load_config([f"+recipe={recipe}"])) == []


def test_the_flagship_plans_and_lists_nothing_this_version_cannot_run():
    from hpc_rl.plan import build_plan

    cfg = load_config(ULTRA)
    assert build_plan(cfg).total_nodes == 224
    # trainer.backend=megatron on GB200 honours the trainer's and teachers' parallel layout (#16); async with
    # in-flight weight updates runs (#15); the generator's TP-8 x EP-8 engines span 8 tasks (#14); Nemotron-H
    # is a megatron architecture (#25): nothing is refused
    assert unsupported(cfg) == []
    text = render_unsupported(unsupported(load_config(ULTRA + ["model.architecture=gpt2"])))
    assert text.startswith("settings this version cannot run yet") and "gpt2" in text
    assert render_unsupported([]) == ""


def test_tensor_context_and_sequence_parallel_are_honoured_not_refused():
    # the fsdp2 backend splits the trainer and the teachers with DTensor TP (models/parallel/)
    cfg = load_config(TINY + ["trainer.tasks_per_node=2", "trainer.parallel.tp=2", "trainer.sequence_parallel=true",
                              "+teachers.add.tasks_per_node=2", "+teachers.add.parallel.tp=2"])
    assert unsupported(cfg) == []
    # context parallel too (its own K/V all-gather), on its own
    assert unsupported(load_config(TINY + ["trainer.tasks_per_node=2", "trainer.parallel.cp=2"])) == []
    keys = {v.key for v in unsupported(load_config(ULTRA))}
    assert "trainer.parallel.tp" not in keys and "trainer.sequence_parallel" not in keys


def _generator(overrides):
    from hpc_rl.plan import build_plan

    return next(r for r in build_plan(load_config(overrides)).roles if r.name == "generator")


def test_cpu_engines_host_their_workers_in_as_few_tasks_as_the_cores_allow():
    # local: 2 cores per node; one generator task owns both and starts the engine's 2 TP workers
    cfg = load_config(TINY + ["generator.parallel.tp=2"])
    assert unsupported(cfg) == []
    gen = _generator(TINY + ["generator.parallel.tp=2"])
    assert (gen.tasks_per_node, gen.parallel["tp"], gen.parallel["dp"], gen.tasks_per_replica) == (1, 2, 1, 1)
    # two generator nodes: two engines (dp 2), each of 2 workers in one task
    gen = _generator(TINY + ["generator.parallel.tp=2", "generator.nodes=2"])
    assert (gen.parallel["dp"], gen.tasks_per_replica, gen.segment_size) == (2, 1, 1)
    # two tasks per node own one core each: the engine spans both tasks, one worker each (#14)
    gen = _generator(TINY + ["generator.parallel.tp=2", "generator.tasks_per_node=2"])
    assert (gen.parallel["dp"], gen.tasks_per_replica, gen.segment_size) == (1, 2, 1)
    # TP 4 over two nodes of 2 cores: one engine spanning two tasks (two nodes, one segment)
    gen = _generator(TINY + ["generator.parallel.tp=4", "generator.nodes=2"])
    assert (gen.parallel["dp"], gen.tasks_per_replica, gen.segment_size) == (1, 2, 2)
    for extra in (["generator.tasks_per_node=2"], ["generator.tasks_per_node=2", "cluster=local_slurm"]):
        assert unsupported(load_config(TINY + ["generator.parallel.tp=2"] + extra)) == []


def test_gpu_engines_span_one_task_per_gpu():
    # ultra_mopd: TP-8 engines on 4-GPU GB200 nodes span 8 tasks (2 nodes); 512 tasks make 64 engines
    gen = _generator(ULTRA)
    assert (gen.tasks, gen.tasks_per_replica, gen.parallel["dp"]) == (512, 8, 64)
    assert "generator.parallel.tp" not in {v.key for v in unsupported(load_config(ULTRA + ["cluster=h100"]))}


def test_engine_expert_parallel_spans_its_tensor_parallel_workers():
    # accepted on GPU clusters with ep = tp (vLLM's EP group is the engine's TP workers)
    assert "generator.parallel.ep" not in {v.key for v in unsupported(load_config(ULTRA + ["cluster=h100"]))}
    with pytest.raises(ConfigError) as info:
        load_config(ULTRA + ["generator.parallel.ep=4"])
    found = [v for v in info.value.violations if v.key == "generator.parallel.ep"]
    assert found and "ep must equal tp=8" in found[0].problem and "generator.parallel.ep=8" in found[0].fix


def test_an_engine_whose_tasks_do_not_fill_the_role_is_invalid():
    # TP 4 at 2 workers per task spans 2 tasks; one node of one task cannot hold it
    with pytest.raises(ConfigError) as info:
        load_config(TINY + ["generator.parallel.tp=4"])
    found = [v for v in info.value.violations if v.key == "generator.parallel"]
    assert found and "engine tasks (tp*pp = 4 workers, 2 per task) = 2 does not divide the role's 1 CPU ranks" in found[0].problem
    assert "give the generator a multiple of 2 tasks" in found[0].fix


def test_a_cpu_generator_task_without_a_core_is_invalid():
    with pytest.raises(ConfigError) as info:
        load_config(TINY + ["generator.tasks_per_node=4"])
    found = [v for v in info.value.violations if v.key == "generator.tasks_per_node"]
    assert found and "would own 0 of the node's 2 cores" in found[0].problem and "<= 2" in found[0].fix


def test_the_wiring_check_is_not_refused_for_training_settings():
    # run.program=comm_check trains nothing: it checks the flagship's layout as it is
    assert unsupported(load_config(ULTRA + ["run.program=comm_check"])) == []
