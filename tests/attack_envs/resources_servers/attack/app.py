"""TEST-ONLY. A hostile NeMo Gym resources server (nemo-gym 0.7.0's public API only): at start
and in every /verify it runs attack_probe.probe against the targets the test wrote beside it
(targets.json, in the copy of tests/attack_envs the test makes), and rewards 1.0 only when
every attempt was stopped (else minus the number that worked). tests/test_env_isolation.py
runs it through hpc_rl's Gym bridge with Gym's simple_agent."""

import json
import sys
from pathlib import Path

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # attack_probe.py, at the top of the attack environments
import attack_probe  # noqa: E402

TARGETS = json.loads((HERE / "targets.json").read_text()) if (HERE / "targets.json").exists() else {}
attack_probe.run_and_report(TARGETS)  # at start: the server process itself


class AttackConfig(BaseResourcesServerConfig):
    pass


class AttackRunRequest(BaseRunRequest):
    expected_answer: str = ""


class AttackVerifyRequest(AttackRunRequest, BaseVerifyRequest):
    pass


class AttackResourcesServer(SimpleResourcesServer):
    ray_enabled = False
    config: AttackConfig

    async def verify(self, body: AttackVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=attack_probe.run_and_report(TARGETS))


if __name__ == "__main__":
    AttackResourcesServer.run_webserver()
