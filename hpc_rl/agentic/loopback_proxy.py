"""The loopback HTTP server an adapted environment library's model calls reach (the NeMo Gym
and verifiers bridges): an aiohttp app in a daemon thread with its own event loop (the
episode runner's loop is new each round), listening on 127.0.0.1 on an ephemeral port (and,
on request, on a unix socket), where every request needs a key made for this process.

The key is not the job's (docs/security.md): the library's processes hold this one only, so a
leak from them opens this one proxy, not the job's store or the generator. A request without
it is a 401, counted by the rank's authentication counters under the subclass's `LABEL`. The
subclasses add their routes (`routes`) and answer in their library's shape.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
import threading
from typing import Any, Dict, List


class LoopbackProxy:
    LABEL = "proxy"  # the auth counters' kind for requests without the key
    NAME = "loopback"  # for the thread and errors: the library it serves

    def __init__(self, model_name: str, host: str = "127.0.0.1"):
        self.model_name, self.host = model_name, host
        self.key = secrets.token_hex(32)
        self.live: Dict[str, Any] = {}  # the subclass's live episodes, by the token its requests carry
        self.rejected = self.served = self.refused = 0
        self._ready = threading.Event()
        self._box: Dict[str, Any] = {}
        threading.Thread(target=self._serve, name=f"hpc_rl-{self.NAME}-proxy", daemon=True).start()
        if not self._ready.wait(30) or "error" in self._box:
            raise RuntimeError(f"the {self.NAME} proxy did not start: {self._box.get('error')!r}")
        self.port = self._box["port"]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def routes(self, web) -> List[Any]:
        """The subclass's aiohttp routes (beside GET /v1/models)."""
        raise NotImplementedError

    def _serve(self) -> None:
        from aiohttp import web

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        expected = f"Bearer {self.key}".encode()

        @web.middleware
        async def authorize(request, handler):
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):
                self.rejected += 1
                from hpc_rl.runtime.signed_store import reject

                reject(self.LABEL)
                return web.json_response({"error": {"message": "a valid API key is required", "code": 401}}, status=401)
            return await handler(request)

        try:
            app = web.Application(middlewares=[authorize], client_max_size=64 << 20)
            app.add_routes([*self.routes(web), web.get("/v1/models", self._models)])
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            loop.run_until_complete(runner.setup())
            self._runner, self._loop = runner, loop
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((self.host, 0))
            loop.run_until_complete(web.SockSite(runner, sock, backlog=1024).start())
            self._box["port"] = sock.getsockname()[1]
        except BaseException as exc:
            self._box["error"] = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()

    def serve_unix(self, path: str) -> None:
        """Also listen on a unix socket (a library in its own network namespace reaches the
        proxy through it); the same key is required there."""
        from aiohttp import web

        async def start():
            await web.UnixSite(self._runner, path).start()

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)

    async def _models(self, request):
        from aiohttp import web

        # no max_model_len: the trajectory's budget is the chat's to enforce (a truncation, not an error)
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    def _refuse(self, status: int, message: str):
        from aiohttp import web

        self.refused += 1
        return web.json_response({"error": {"message": message, "code": status}}, status=status)
