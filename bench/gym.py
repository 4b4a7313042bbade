"""A NeMo Gym environment run unchanged through GRPO (issue 27): `+recipe=tiny_gym_grpo`
(environments/gym's tiny_arith resources server with Gym's simple_agent and vllm_model,
nemo-gym 0.7.0) for 10 steps, locally and, with --slurm, as a het job on the local Slurm
cluster. Writes bench/results/gym.json: wall time, per-step episodes, errors, failures,
changed policy tokens, the engine-vs-trainer log-prob agreement and mean rewards.

Too long for the test suite (tests/test_gym_bridge.py checks the bridge in about a minute).
Needs the Gym interpreter (tests/gym_python.sh) and, for --slurm, `make cluster-up`.

    python bench/gym.py [--steps 10] [--local] [--slurm] [--out PATH]
"""


from adapted_env_run import ROOT, main

if __name__ == "__main__":
    main("tiny_gym_grpo", ROOT / "bench" / "results" / "gym.json", "gym")
