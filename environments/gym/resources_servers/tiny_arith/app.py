"""tiny_arith as a NeMo Gym resources server, written against nemo-gym 0.7.0's public API
only (nemo_gym.base_resources_server): "What is 3 plus 5?" tasks, reward 1.0 for the exact
sum as the answer's last integer, 0.1 for an answer that is one integer but wrong (the
shape reward tiny_arith's verifiers rubric gives), else 0. Gym runs it unchanged: with
`gym env start --resources-server tiny_arith --search-dir environments/gym`, or as hpc_rl's
env.agentic.gym.resources_server (docs/agentic.md, "NeMo Gym environments").
"""

import re

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)

INT = re.compile(r"-?\d+")


class TinyArithConfig(BaseResourcesServerConfig):
    pass


class TinyArithRunRequest(BaseRunRequest):
    expected_answer: str


class TinyArithVerifyRequest(TinyArithRunRequest, BaseVerifyRequest):
    pass


class TinyArithVerifyResponse(BaseVerifyResponse):
    expected_answer: str
    extracted: str | None = None


def score(text: str, expected: str) -> tuple[float, str | None]:
    found = INT.findall(text)
    if not found:
        return 0.0, None
    if found[-1] == expected.strip():
        return 1.0, found[-1]
    return (0.1 if len(found) == 1 and text.strip() == found[0] else 0.0), found[-1]


class TinyArithResourcesServer(SimpleResourcesServer):
    ray_enabled = False  # a pure function of the answer: no Ray actors
    config: TinyArithConfig

    async def verify(self, body: TinyArithVerifyRequest) -> TinyArithVerifyResponse:
        text = "".join(part.text for item in body.response.output if item.type == "message"
                       for part in item.content if part.type == "output_text")
        reward, extracted = score(text, body.expected_answer)
        return TinyArithVerifyResponse(**body.model_dump(), reward=reward, extracted=extracted)


if __name__ == "__main__":
    TinyArithResourcesServer.run_webserver()
