"""Relays between an environment library's network namespace and the env rank, through unix
sockets in the library's jail directory (hpc_rl/envs/jail.py): the library has only its own
loopback, so its model calls go out through a local TCP port relayed to `proxy.sock` (the
rank's proxy), and the rank's calls come in through `gym.sock`, relayed to the port the
request's Host names.

Standard library only, and imports nothing of hpc_rl: it runs under the libraries' own
interpreters. The verifiers worker imports it from its own directory; Gym's launcher gets
this file's source ahead of its own (gym_servers.LAUNCH).
"""

import asyncio
import re
import threading


async def _pipe(r, w):
    try:
        while True:
            data = await r.read(65536)
            if not data:
                break
            w.write(data)
            await w.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        w.close()


def serve_relays(outward=None, inward=None):
    """Start the relays in a daemon thread: `outward` (a unix socket path) gets a TCP listener on
    127.0.0.1 whose connections go to it; `inward` (a path) is listened on, each connection
    relayed to 127.0.0.1:<the port of its Host header>. Returns the outward port (or None)."""

    async def out(r, w):
        pr, pw = await asyncio.open_unix_connection(outward)
        await asyncio.gather(_pipe(r, pw), _pipe(pr, w))

    async def into(r, w):
        head = await r.readuntil(b"\r\n\r\n")
        port = int(re.search(rb"(?im)^host:[^\r\n]*:(\d+)\s*$", head).group(1))
        tr, tw = await asyncio.open_connection("127.0.0.1", port)
        tw.write(head)
        await asyncio.gather(_pipe(r, tw), _pipe(tr, w))

    box = {}
    ready = threading.Event()

    def run():  # the relays' own loop, in their own thread: callable from inside another running loop
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            if outward:
                srv = loop.run_until_complete(asyncio.start_server(out, "127.0.0.1", 0))
                box["port"] = srv.sockets[0].getsockname()[1]
            if inward:
                loop.run_until_complete(asyncio.start_unix_server(into, inward))
        except BaseException as exc:
            box["error"] = exc
        ready.set()
        if "error" not in box:
            loop.run_forever()

    threading.Thread(target=run, daemon=True, name="hpc_rl-relay").start()
    ready.wait()
    if "error" in box:
        raise box["error"]
    return box.get("port")
