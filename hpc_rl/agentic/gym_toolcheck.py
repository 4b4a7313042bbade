"""The Gym preflight's tool check (issue 48): run by Gym's interpreter in the env rank's jail
before a job is submitted (gym_bridge.preflight); imports nothing of hpc_rl (the standard
library, nemo-gym and what it ships: FastAPI's test client).

The resources server's `app.py` (found as Gym finds it: resources_servers/<name>/ under the
search directories) is imported, its SimpleResourcesServer subclass built without Gym's head
server, and each tool the first dataset row offers (`responses_create_params.tools`, each a
POST /<name> route of the server) called once in process, with arguments made from the tool's
JSON schema (a string "1", a number 1, ...). A tool that raises or answers 5xx is a problem
naming it; what a tool answers is not judged. Prints one JSON line: {"problems": [...]}.

    python -c "$(cat gym_toolcheck.py)" '{"roots": [search dirs], "resources_server": NAME, "row": {...}}'
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path

SAMPLE = {"string": "1", "integer": 1, "number": 1.0, "boolean": False, "array": [], "object": {}}


def sample_args(params: dict) -> dict:
    props = (params or {}).get("properties") or {}
    required = (params or {}).get("required") or list(props)
    return {k: SAMPLE.get((props.get(k) or {}).get("type"), "1") for k in required}


def server_class(app_py: Path):
    sys.path.insert(0, str(app_py.parent))
    spec = importlib.util.spec_from_file_location("hpc_rl_gym_toolcheck_app", app_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from nemo_gym.base_resources_server import SimpleResourcesServer

    found = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, SimpleResourcesServer)
             and c.__module__ == module.__name__]
    if len(found) != 1:
        raise RuntimeError(f"{app_py} defines {len(found)} SimpleResourcesServer subclasses, not one")
    return found[0]


def check(spec: dict) -> list:
    import nemo_gym

    name = spec["resources_server"]
    apps = [Path(r) / "resources_servers" / name / "app.py" for r in [*spec["roots"], nemo_gym.PARENT_DIR]]
    apps = [a for a in apps if a.exists()]
    tools = [t for t in (spec.get("row") or {}).get("responses_create_params", {}).get("tools") or ()
             if t.get("type", "function") == "function" and t.get("name")]
    if not apps or not tools:
        return []
    try:
        cls = server_class(apps[0])
        config_cls = cls.model_fields["config"].annotation
        config = config_cls.model_construct(name=name, host="127.0.0.1", port=0, entrypoint="app.py")
        server = cls.model_construct(config=config, server_client=None)
        from fastapi.testclient import TestClient

        client = TestClient(server.setup_webserver(), raise_server_exceptions=True)
    except Exception as exc:
        return [{"tool": None, "why": f"the server could not be built: {type(exc).__name__}: {exc}"[:1000]}]
    problems = []
    for tool in tools:
        args = sample_args(tool.get("parameters"))
        try:
            r = client.post("/" + tool["name"], json=args)
            if r.status_code == 404:
                problems.append({"tool": tool["name"], "why": f"the server has no POST /{tool['name']} route"})
            elif r.status_code >= 500:
                problems.append({"tool": tool["name"], "why": f"answered {r.status_code}: {r.text[:500]}"})
        except Exception as exc:
            problems.append({"tool": tool["name"], "why": f"raised {type(exc).__name__}: {exc}"[:800] + f" (called with {args})"})
    return problems


if __name__ == "__main__":
    print(json.dumps({"problems": check(json.loads(sys.argv[1]))}))
