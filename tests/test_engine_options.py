"""The generator's vLLM options (issue 44): generator.enforce_eager (CUDA graphs on GPU clusters
by default, refused off on CPU clusters with the measured reason), generator.kv_cache_dtype and
generator.engine_args, passed to vLLM and checked against vLLM's own lists before submission;
the arguments this project sets itself are refused in engine_args."""

from types import SimpleNamespace

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.validate_generator import SET_HERE
from hpc_rl.engines.vllm_args import engine_option_problems
from hpc_rl.refit.vllm_engine import EngineSpan, engine_kwargs, engine_options

GRPO = ["+recipe=tiny_grpo", "launcher=dry_run"]


def test_every_argument_the_project_sets_is_in_the_refusal_table():
    spanning = EngineSpan(tasks=2, node=0, master_addr="h", master_port=1)
    keys = set(engine_kwargs("m", tensor_parallel=2, span=spanning, expert_parallel=True, in_process_core=True))
    assert keys <= set(SET_HERE), keys - set(SET_HERE)


def test_cuda_graphs_on_gpu_clusters_eager_on_cpu_and_the_options_pass_through():
    g = SimpleNamespace(enforce_eager=None, kv_cache_dtype="fp8", engine_args={"block_size": 32})
    assert engine_options(g, on_gpu=True) == {"enforce_eager": False, "kv_cache_dtype": "fp8", "block_size": 32,
                                              "max_num_batched_tokens": 16384}  # GPU_BATCHED_TOKENS
    assert engine_options(g, on_gpu=False)["enforce_eager"] is True
    g.enforce_eager = True
    assert engine_options(g, on_gpu=True)["enforce_eager"] is True
    kw = engine_kwargs("m", options=engine_options(g, on_gpu=True))
    assert kw["kv_cache_dtype"] == "fp8" and kw["block_size"] == 32 and kw["enforce_eager"] is True


@pytest.mark.parametrize("override,key,fragment", [
    ("+generator.engine_args.seed=3", "generator.engine_args.seed", "set run.seed"),
    ("+generator.engine_args.max_num_batched_tokens=64", "generator.engine_args.max_num_batched_tokens", "chunked prefill"),
    ("+generator.engine_args.enforce_eager=false", "generator.engine_args.enforce_eager", "generator.enforce_eager"),
    ("generator.enforce_eager=false", "generator.enforce_eager", "cudagraph_mode NONE"),
])
def test_what_the_runtime_cannot_honour_is_refused_naming_key_and_fix(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(GRPO + [override])
    found = [v for v in info.value.violations if v.key == key and fragment in f"{v.problem} {v.fix}"]
    assert found, "\n".join(v.render() for v in info.value.violations)


def test_gpu_clusters_take_cuda_graphs_and_any_engine_argument_vllm_has():
    cfg = load_config(["+recipe=ultra_mopd", "launcher=dry_run", "generator.enforce_eager=false",
                       "generator.kv_cache_dtype=fp8_e4m3", "+generator.engine_args.enable_prefix_caching=true"])
    assert cfg.generator.enforce_eager is False and engine_option_problems(cfg) == []


def test_engine_arguments_are_checked_against_vllms_own_lists():
    cfg = load_config(GRPO + ["+generator.engine_args.block_sise=32", "generator.kv_cache_dtype=fp9"])
    got = {v.key: v for v in engine_option_problems(cfg)}
    assert "did you mean 'block_size'" in got["generator.engine_args.block_sise"].fix
    assert "fp8_e5m2" in got["generator.kv_cache_dtype"].fix
    assert engine_option_problems(load_config(GRPO)) == []


@pytest.mark.slow
def test_a_cpu_engine_is_built_with_the_kv_cache_dtype_and_engine_args_given():
    from hpc_rl.config.schema import GeneratorConfig
    from hpc_rl.engines.base import EngineSpec
    from hpc_rl.engines.vllm import VLLMEngine
    from hpc_rl.models.assets import resolve_model_ref

    g = GeneratorConfig(precision="fp32", gpu_memory_utilization=0.05, max_num_seqs=8, kv_cache_dtype="fp8_e5m2",
                        engine_args={"max_logprobs": 7})
    engine = VLLMEngine.from_spec(EngineSpec(resolve_model_ref("tiny:student"), g, max_model_len=64, seed=0, on_gpu=False))
    vc = engine.vllm.llm.llm_engine.vllm_config
    assert vc.cache_config.cache_dtype == "fp8_e5m2" and vc.model_config.max_logprobs == 7
    assert vc.model_config.enforce_eager is True  # a CPU engine: eager (no CUDA graphs there)
    engine.close()
