"""docs/byoe.md ("Bring your own environment", issue 48) stays true, and a user's own
tool-using verifiers taskset runs by configuration alone. The page's command blocks marked
`<!-- byoe-test -->` run, in order, in one bash session with WORK an empty directory outside
the repository: they write a taskset with one tool server (verifiers' public API only, no
copy of the repo's examples), install it into .venv-verifiers as the docs say, check it
before submission (`--check`: the preflight loads it, builds its renderer, starts its tool
server and calls its tool), show a planted broken tool failing there by name, and run 2 GRPO
steps (one launch). The page's Gym blocks (a session of their own) write a NeMo Gym resources
server with a tool in a directory outside the repository, check it and run 2 GRPO steps, with
no bind or mkdir by hand. Each run's metrics must show tool calls parsed and executed on every
step, 0 environment errors and 0 changed policy tokens."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "byoe.md"
VENV_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"
BLOCK = re.compile(r"<!-- byoe-test: (verifiers|gym) -->\n```bash\n(.*?)\n```", re.S)
FENCE = re.compile(r"^```bash$", re.M)


def blocks(library: str):
    return [body for lib, body in BLOCK.findall(PAGE.read_text()) if lib == library]


def test_every_command_block_of_the_page_is_rehearsed():
    text = PAGE.read_text()
    assert len(BLOCK.findall(text)) == len(FENCE.findall(text)) >= 7
    body = "\n".join(blocks("verifiers"))
    for needle in ("pip install", "--check", "broken_tool", "run.max_steps=2", "@vf.tool"):
        assert needle in body, needle
    body = "\n".join(blocks("gym"))
    for needle in ("SimpleResourcesServer", "search_dirs", "--check", "run.max_steps=2"):
        assert needle in body, needle


def run_page(library: str, work: Path):
    """The page's blocks for `library` in one bash session, WORK a directory outside the
    repository and outside /tmp (which Gym's test interpreter binds anyway): under /var/tmp."""
    assert not str(work).startswith(str(REPO))
    script = "\n".join(["set -euo pipefail", "set -x", *blocks(library)])
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"  # the page's `python`: this one
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], cwd=work, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, WORK=str(work), HPC_RL=str(REPO), PATH=path))
    return proc, time.monotonic() - t0


@pytest.fixture
def outside_dir():
    work = Path(tempfile.mkdtemp(prefix="hpc_rl_byoe_", dir="/var/tmp"))
    work.chmod(0o755)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def page_run(env_interpreters_ready):
    work = Path(tempfile.mkdtemp(prefix="hpc_rl_byoe_", dir="/var/tmp"))
    work.chmod(0o755)
    try:
        proc, took = run_page("verifiers", work)
        yield work, proc, took
    finally:
        subprocess.run([str(VENV_PYTHON), "-m", "pip", "uninstall", "--quiet", "-y", "vf-calc"], capture_output=True,
                       timeout=300)
        shutil.rmtree(work, ignore_errors=True)


def test_the_page_runs_from_an_empty_directory(page_run):
    work, proc, took = page_run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the page's commands failed (rc={proc.returncode}, {took:.0f}s):\n{out[-6000:]}"
    assert "every check before submission passed" in out
    print(f"the page's commands took {took:.1f}s")


def test_a_planted_broken_tool_fails_before_submission_naming_it(page_run):
    work, proc, _ = page_run
    broken = (work / "broken.txt").read_text()
    assert "nothing was submitted" in broken, broken
    assert "env.agentic.verifiers.taskset" in broken
    assert "tool server CalcTools, tool 'calculator': raised RuntimeError: planted: this tool is broken" in broken


def test_two_grpo_steps_call_the_users_tool_with_exact_trajectories(page_run):
    work, proc, _ = page_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    check_steps(work / "runs" / "byoe")


def test_a_users_gym_resources_server_with_a_tool_runs_two_grpo_steps(env_interpreters_ready, outside_dir):
    proc, took = run_page("gym", outside_dir)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the page's Gym commands failed (rc={proc.returncode}, {took:.0f}s):\n{out[-6000:]}"
    assert "every check before submission passed" in out
    check_steps(outside_dir / "runs" / "byoe_gym")


def check_steps(run: Path):
    """2 GRPO steps of 16 episodes: tool calls parsed and run on each, no environment error,
    token-exact trajectories holding the tool's answers."""
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        a = s["agentic"]
        shown = ("episodes", "turns", "tool_calls", "tool_errors", "errors", "changed_policy_tokens", "policy_tokens",
                 "env_tokens")
        print(f"{run.name} step {s['step']}: " + ", ".join(f"{k} {a.get(k)}" for k in shown))
        assert a["episodes"] == 16 and a["errors"] == 0 and a["failed"] == 0, a
        assert a["tool_calls"] > 0 and a["tool_errors"] == 0, a  # parsed by the renderer, run by the tool server
        assert a["changed_policy_tokens"] == 0, a
        assert a["env_tokens"] > 0, a  # the tool's answers sit inside the trajectories (mask 0)


def test_the_pythonic_renderer_reads_calls_and_gives_them_back_as_written(env_interpreters_ready):
    """hpc_rl/agentic/verifiers_renderer.py in the verifiers venv (renderers' types)."""
    code = """
import json, sys
sys.path.insert(0, sys.argv[1])
from verifiers_renderer import parse_pythonic, with_content
ok = parse_pythonic('[calculator(expression="37*8"), f(a=1, b=[2])]')
bad = parse_pythonic('[calculator(expression=os.system("x"))]')
print(json.dumps({"ok": [(c.name, c.arguments, c.status.value) for c in ok], "bad": [c.status.value for c in bad],
                  "plain": parse_pythonic("296"), "deep": [c.status.value for c in parse_pythonic("[" * 50000)],
                  "msg": with_content([{"role": "assistant", "content": None, "tool_calls": [
                      {"function": {"name": "calculator", "arguments": '{"expression": "37*8"}'}}]}])[0]["content"]}))
"""
    out = subprocess.run([str(VENV_PYTHON), "-c", code, str(REPO / "hpc_rl" / "agentic")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ok"] == [["calculator", {"expression": "37*8"}, "ok"], ["f", {"a": 1, "b": [2]}, "ok"]]
    assert got["bad"] == ["malformed_structure"] and got["plain"] == [] and got["deep"] == ["malformed_structure"]
    assert got["msg"] == '[calculator(expression="37*8")]'  # what the policy wrote, rendered again


def test_an_editable_install_anywhere_is_bound_into_the_jail(tmp_path):
    from hpc_rl.envs.jail import editable_dirs

    pkg = tmp_path / "src" / "mypkg"
    pkg.mkdir(parents=True)
    finder = tmp_path / "__editable___mypkg_0_1_finder.py"
    finder.write_text(f"import sys\nMAPPING: dict[str, str] = {{'mypkg': {str(pkg)!r}, 'gone': '/nonexistent/x'}}\n"
                      "NAMESPACES = {}\n")
    assert editable_dirs(finder) == [str(pkg)]
    finder.write_text("MAPPING = __import__('os').system('true')\n")  # read as a literal, never run
    assert editable_dirs(finder) == []


def test_the_gym_preflight_calls_each_tool_and_names_a_broken_one(env_interpreters_ready, outside_dir):
    """The page's Gym server, its tool planted broken: gym_bridge.preflight names it (before any
    submission); the server as written passes."""
    from types import SimpleNamespace

    from hpc_rl.agentic.gym_bridge import preflight

    first = blocks("gym")[0]
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + first], cwd=outside_dir, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, WORK=str(outside_dir)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    server = outside_dir / "my_gym" / "resources_servers" / "calc_tool"
    g = SimpleNamespace(python=".gym-python/bin/gym-python", resources_server="calc_tool",
                        search_dirs=[str(outside_dir / "my_gym")], dataset=str(server / "data" / "train.jsonl"))
    assert preflight(g) == []
    app = server / "app.py"
    app.write_text(app.read_text().replace("        m = EXPR.fullmatch(body.expression)",
                                           "        raise RuntimeError('planted: this tool is broken')\n"
                                           "        m = EXPR.fullmatch(body.expression)"))
    found = preflight(g)
    assert len(found) == 1 and found[0][0] == "env.agentic.gym.resources_server", found
    assert "tool 'calculator': raised RuntimeError: planted: this tool is broken" in found[0][2], found


def test_a_tool_server_that_cannot_start_is_refused_with_its_stderr(page_run):
    """The page's (editable) taskset, its tool server planted to die at start: the preflight says
    why in seconds, quoting the server's stderr (verifiers itself waits 180 s for a port)."""
    from types import SimpleNamespace

    from hpc_rl.agentic.verifiers_preflight import preflight
    from hpc_rl.rl.inputs import resolve_model_ref

    work, proc, _ = page_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    tools = work / "my_env" / "vf_calc" / "tools.py"
    text = tools.read_text()
    v = SimpleNamespace(taskset="vf-calc", taskset_args={}, harness="null", runtime="subprocess",
                        python=".venv-verifiers/bin/python", renderer=None)
    tools.write_text(text.replace("    CalcTools.run()", "    raise SystemExit('planted: the server cannot start')"))
    try:
        t0 = time.monotonic()
        found = preflight(v, resolve_model_ref("tiny_agentic:teacher_calc"), "pythonic")
        took = time.monotonic() - t0
    finally:
        tools.write_text(text)
    assert len(found) == 1 and found[0][0] == "env.agentic.verifiers.taskset", found
    assert "tool server CalcTools: exited with rc 1 before reporting its port" in found[0][2], found
    assert "planted: the server cannot start" in found[0][2] and took < 60, (found, took)
