"""An async client of a generator's endpoint, for the environment ranks' episodes.

One client (one aiohttp session) per environment rank and endpoint, shared by all its
concurrent episodes. Its connection pool is sized by the caller from the config: aiohttp's
default pool of 100 connections silently caps in-flight rollouts (NeMo RL saw it throttle
rollout traffic), and so would any default here. Requests beyond the pool wait for a free
connection inside aiohttp; the per-request timeout counts that wait too.

The key goes only into the Authorization header; it is not kept in the client's repr and
never appears in its errors.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Union


class EndpointError(RuntimeError):
    """The endpoint answered with an error (status and its message)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"endpoint error {status}: {message}")
        self.status, self.message = status, message


class EndpointClient:
    def __init__(self, base_url: str, key: str, max_connections: int, timeout_s: float = 600.0, connect_timeout_s: float = 30.0):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, not {max_connections}")
        self.base_url = base_url.rstrip("/")
        self.max_connections, self.timeout_s, self.connect_timeout_s = max_connections, timeout_s, connect_timeout_s
        self._headers = {"Authorization": f"Bearer {key}"}
        self._session = None

    def __repr__(self) -> str:
        return f"EndpointClient({self.base_url!r}, max_connections={self.max_connections})"

    def _client(self):
        import aiohttp

        # made on first use, inside the running event loop: an aiohttp session belongs to the
        # loop it was made in
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def _call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
                    timeout_s: Optional[float] = None) -> Dict[str, Any]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, connect=self.connect_timeout_s)
        async with self._client().request(method, self.base_url + path, json=body, timeout=timeout) as resp:
            raw = await resp.read()
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
            if resp.status != 200:
                message = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else None
                raise EndpointError(resp.status, message or raw[:500].decode("utf-8", "replace"))
            if not isinstance(data, dict):
                raise EndpointError(resp.status, "the endpoint's answer is not a JSON object")
            return data

    async def tokens(self, prompt_token_ids: Sequence[int], max_tokens: Optional[int] = None, temperature: float = 1.0,
                     top_p: float = 1.0, top_k: int = -1, seed: Optional[int] = None, stop: Sequence[str] = (),
                     stop_token_ids: Sequence[int] = (), min_tokens: int = 0, ignore_eos: bool = False,
                     timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """The token route: {"token_ids", "logprobs", "weight_version_first",
        "weight_version_last", "finish_reason"}."""
        body = {"prompt_token_ids": [int(t) for t in prompt_token_ids], "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "top_k": top_k, "seed": seed, "stop": list(stop), "stop_token_ids": [int(t) for t in stop_token_ids],
                "min_tokens": min_tokens, "ignore_eos": ignore_eos}
        return await self._call("POST", "/v1/tokens", body, timeout_s)

    async def chat(self, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]] = None,
                   timeout_s: Optional[float] = None, **params: Any) -> Dict[str, Any]:
        """/v1/chat/completions; `params`: OpenAI's (max_tokens, temperature, seed, stop,
        tool_choice, ...). The answer is OpenAI's with, in each choice, token_ids,
        token_logprobs and the weight versions, and the prompt's ids in prompt_token_ids."""
        body = {"model": params.pop("model", "hpc_rl"), "messages": messages, **params}
        if tools:
            body["tools"] = tools
        return await self._call("POST", "/v1/chat/completions", body, timeout_s)

    async def completions(self, prompt: Union[str, Sequence[int]], timeout_s: Optional[float] = None,
                          **params: Any) -> Dict[str, Any]:
        body = {"model": params.pop("model", "hpc_rl"), "prompt": prompt if isinstance(prompt, str) else list(prompt), **params}
        return await self._call("POST", "/v1/completions", body, timeout_s)

    async def models(self) -> Dict[str, Any]:
        return await self._call("GET", "/v1/models")

    async def health(self) -> Dict[str, Any]:
        return await self._call("GET", "/health")

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> "EndpointClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
