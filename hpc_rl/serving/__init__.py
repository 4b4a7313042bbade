"""The generators' OpenAI-compatible endpoints (issue 26): a per-job key (key.py), the HTTP
server in a daemon thread (server.py), the engine's serving loop that batches its requests
into the generator's vLLM engine (loop.py), and the environment ranks' async client
(client.py). docs/serving.md describes them."""

from .client import EndpointClient, EndpointError
from .key import endpoint_key
from .loop import RequestError, RequestQueue, ServeStats, TokenRequest, TokenResult, serve
from .server import Endpoint, start_endpoint, tool_parser_class

__all__ = ["Endpoint", "EndpointClient", "EndpointError", "RequestError", "RequestQueue", "ServeStats", "TokenRequest",
           "TokenResult", "endpoint_key", "serve", "start_endpoint", "tool_parser_class"]
