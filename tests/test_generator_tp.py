"""Tensor-parallel vLLM engines (generator.parallel.tp=2): how the refit group addresses
their workers. On CPU the engine is one generator task that starts its TP workers (vLLM's
multiprocessing executor) and each worker is a refit rank. The engine runs in the RL loop in
tests/test_tensor_parallel_rl.py (tp layout, locally and as a het job)."""

from __future__ import annotations


def test_the_refit_group_addresses_engine_g_tp_rank_j():
    # 2 trainer ranks, 2 engines of TP 2: engine g's worker j is refit rank 2 + g*2 + j
    from hpc_rl.refit.layout import Layout
    from hpc_rl.refit.engine_group import engine_first_rank, refit_setup

    specs = {"model.layers.0.mlp.down_proj.weight": ((8, 16), "float32"),
             "model.layers.0.input_layernorm.weight": ((8,), "float32")}
    setup = refit_setup(specs, 2, 2, "t", engine_tp=2)
    assert setup.world == 6
    assert [engine_first_rank(2, g, 2) for g in range(2)] == [2, 4]
    assert {r: setup.names[r] for r in range(2, 6)} == {2: "generator:0/tp0", 3: "generator:0/tp1",
                                                        4: "generator:1/tp0", 5: "generator:1/tp1"}
    dst = Layout.from_dict(setup.dst)
    assert dst.ranks() == [2, 3, 4, 5]  # every worker of every engine receives
