"""A verifiers environment run unchanged through GRPO (issue 27): `+recipe=tiny_verifiers_grpo`
(environments/tiny_arith under verifiers 0.4.0's SingleAgentEnv, null harness, subprocess
runtime) for 10 steps, locally and, with --slurm, as a het job on the local Slurm cluster.
Writes bench/results/verifiers.json: wall time, per-step episodes, errors, failures,
changed policy tokens, the engine-vs-trainer log-prob agreement and mean rewards.

Too long for the test suite (tests/test_verifiers_bridge.py checks the bridge in seconds).
Needs `make verifiers-env` (and `make cluster-up` for --slurm).

    python bench/verifiers.py [--steps 10] [--local] [--slurm] [--out PATH]
"""


from adapted_env_run import ROOT, main

if __name__ == "__main__":
    main("tiny_verifiers_grpo", ROOT / "bench" / "results" / "verifiers.json", "verifiers")
