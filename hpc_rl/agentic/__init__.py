"""Multi-turn, tool-using episodes with token-exact trajectories (issue #26).

history.py (token bookkeeping), contract.py (what an environment implements, limits,
registry), chat.py (the recording chat an episode talks through), runner.py (concurrent
episodes -> SampleRows), faults.py (errors and hangs: counted, logged once per kind, the
share that ends a run), figures.py (the episodes' metrics, merged over engines), tools.py
(vLLM's tool parsers), calculator.py (the tiny task),
local.py (a local vLLM engine or HF model as the policy), teacher.py (the tool-using tiny
teacher). docs/agentic.md explains the contract.

Kept empty of imports: envs/registry.py imports calculator.py, which must stay light.
"""
