"""The job's secret, and store values and messages that prove they came from the job.

Why: trainer rank 0's TCPStore listens on a port of a shared cluster network and has no
access control of its own; neither do gloo's connections. Any process that reaches the
port can read and write every key. Some of what ranks read there decides what a rank does
(abort verdicts, a vLLM leader's address, refit descriptors that used to be unpickled), so
every value our code writes carries an HMAC-SHA256 keyed by the job's secret and bound to
the key's name (a value signed for one key does not verify under another), and readers
verify it. A value without a valid MAC is invisible: `get` waits on as if the key were
unset, `check` says False; each rejection is counted (`REJECTED`) and logged once per key.
`seal` / `unseal` do the same for messages between ranks (messaging/p2p.py).

The secret (`HPC_RL_JOB_KEY`, named in runtime/env.py) is made at launch by the launcher
or by the batch shell of a hand-submitted script, and reaches ranks only through their
environment (Slurm hands every task of the job its environment). A rank started without
it fails at once (`MissingJobKey`).

What this does not cover, by design or by the store's nature:
- Integer counters written with `store.add` (rendezvous arrivals, heartbeats, store
  barriers) cannot carry a MAC: TCPStore adds server-side. A stranger can bump or reset
  them: a heartbeat counter kept alive for a dead rank delays its detection; a bumped
  barrier counter lets a rank leave a store barrier early (the transfer's own completion
  still gates a refit). Rendezvous does not trust its counter: it admits a rank only once
  its signed record verifies.
- Availability: a stranger can still overwrite or delete values (a signed value replaced
  by garbage is lost, and its reader waits until its timeout). Authentication turns
  forgery into, at worst, a failed run, never a wrong one or code run as the job's user.
- Confidentiality: values travel and sit in the store in the clear (they hold addresses,
  statuses and step numbers, not data).
- Keys written by C++ (gloo's and NCCL's rendezvous through `raw`, vLLM's own channels) are
  outside this wrapper: docs/security.md lists them as trusted-network-only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import Counter
from datetime import timedelta
from typing import Iterable, Mapping, Optional, Union

from . import env

TAG_BYTES = 32  # SHA-256
REJECTED: Counter = Counter()  # this process's rejected values, by what was checked (key or message kind)
# this process's authenticated work (runtime/auth_stats.py reports it, bench/auth_cost.py prices it):
# SignedStore calls by method (and the keys of check/wait), MACs made ("signs") and checked
# ("verifies") for store values and their payload bytes; sealed messages count in sealed.py
OPS: Counter = Counter()
_logged: set = set()
log = logging.getLogger("hpc_rl.signed_store")


class MissingJobKey(RuntimeError):
    """A rank (or one of its processes) was started without the job's secret."""


def new_job_key() -> str:
    """A fresh secret for one job: 32 random bytes as hex."""
    return secrets.token_hex(TAG_BYTES)


def job_key(environ: Optional[Mapping[str, str]] = None) -> bytes:
    """The job's secret from `environ` (default os.environ); MissingJobKey if unset."""
    value = (os.environ if environ is None else environ).get(env.JOB_KEY, "")
    if len(value) < 32:
        raise MissingJobKey(
            f"{env.JOB_KEY} is {'unset' if not value else 'too short'}: this process was started without the job's "
            f"secret, so it cannot prove it belongs to the job (store values and messages carry a MAC keyed by it). "
            f"Start ranks through `python -m hpc_rl.launch` or the rendered batch script, which make the secret "
            f"and pass it in the tasks' environment.")
    return value.encode()


def ensure_job_key() -> bytes:
    """For a standalone check or benchmark with no launcher (it hosts its own store): make a
    secret for this process tree unless one is set; child processes inherit it."""
    if not os.environ.get(env.JOB_KEY):
        os.environ[env.JOB_KEY] = new_job_key()
    return job_key()


def _as_bytes(value: Union[str, bytes]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def mac(secret: bytes, label: str, payload: bytes) -> bytes:
    """HMAC-SHA256 of `payload`, bound to `label` (a store key, a message's route)."""
    return hmac.new(secret, label.encode() + b"\0" + payload, hashlib.sha256).digest()


def seal(secret: bytes, label: str, payload: Union[str, bytes]) -> bytes:
    """MAC || payload."""
    payload = _as_bytes(payload)
    return mac(secret, label, payload) + payload


def unseal(secret: bytes, label: str, blob: bytes) -> Optional[bytes]:
    """The payload if `blob` carries a valid MAC for `label`, else None (counted, logged once)."""
    blob = bytes(blob)
    tag, payload = blob[:TAG_BYTES], blob[TAG_BYTES:]
    if len(blob) >= TAG_BYTES and hmac.compare_digest(tag, mac(secret, label, payload)):
        return payload
    reject(label)
    return None


def reject(label: str) -> None:
    REJECTED[label] += 1
    if label not in _logged:
        _logged.add(label)
        log.warning("rejected a value without a valid job MAC under %r (not written by this job's ranks; "
                    "further rejections there are counted, not logged)", label)


def rejected_total() -> int:
    return sum(REJECTED.values())


class SignedStore:
    """A TCPStore whose values our code writes and reads are signed and verified.

    `raw` is the underlying c10d store, for the C++ users that need a real one (process
    groups' PrefixStores). Counters (`add`) pass through unsigned: see the module's note."""

    def __init__(self, raw, secret: bytes, poll_s: float = 0.05):
        self.raw, self._secret, self.poll_s = raw, secret, poll_s

    @classmethod
    def from_env(cls, raw, environ: Optional[Mapping[str, str]] = None) -> "SignedStore":
        return cls(raw, job_key(environ))

    def _timeout_s(self) -> float:
        try:
            return float(self.raw.timeout.total_seconds())
        except Exception:
            return 300.0

    def _valid(self, key: str) -> Optional[bytes]:
        blob = self.raw.get(key)
        OPS["verifies"] += 1
        OPS["verified_bytes"] += len(blob)
        return unseal(self._secret, key, blob)

    def _sign(self, key: str, value: Union[str, bytes]) -> bytes:
        blob = seal(self._secret, key, value)
        OPS["signs"] += 1
        OPS["signed_bytes"] += len(blob)
        return blob

    def set(self, key: str, value: Union[str, bytes]) -> None:
        OPS["set"] += 1
        self.raw.set(key, self._sign(key, value))

    def compare_set(self, key: str, expected: Union[str, bytes], desired: Union[str, bytes]) -> bytes:
        """Set `desired` if the key holds `expected` (empty: the key is unset)."""
        OPS["compare_set"] += 1
        exp = self._sign(key, expected) if len(_as_bytes(expected)) else b""
        return self.raw.compare_set(key, exp, self._sign(key, desired))

    def get(self, key: str) -> bytes:
        """The verified payload; blocks like TCPStore.get (up to the store's timeout) until
        a valid value is there. A forged value is skipped as if the key were unset."""
        OPS["get"] += 1
        deadline = time.monotonic() + self._timeout_s()
        while True:
            payload = self._valid(key)  # raw.get blocks until the key exists
            if payload is not None:
                return payload
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out: store key {key!r} holds only values without the job's MAC "
                                   f"(written by a process outside the job)")
            time.sleep(self.poll_s)

    def peek(self, key: str) -> Optional[bytes]:
        """The verified payload if the key is set with a valid value, else None; never blocks."""
        OPS["peek"] += 1
        return self._valid(key) if self.raw.check([key]) else None

    def check(self, keys: Iterable[str]) -> bool:
        """True when every key is set with a valid value."""
        keys = list(keys)
        OPS["check"] += 1
        OPS["check_keys"] += len(keys)
        return self.raw.check(keys) and all(self._valid(k) is not None for k in keys)

    def wait(self, keys: Iterable[str], timeout: Optional[timedelta] = None) -> None:
        """Until every key holds a valid value; raises like TCPStore.wait on timeout."""
        keys = list(keys)
        OPS["wait"] += 1
        OPS["wait_keys"] += len(keys)
        total = timeout.total_seconds() if timeout is not None else self._timeout_s()
        deadline = time.monotonic() + total
        while True:
            left = max(deadline - time.monotonic(), 0.001)
            self.raw.wait(keys, timedelta(seconds=left))
            if all(self._valid(k) is not None for k in keys):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out: store keys {keys} hold values without the job's MAC")
            time.sleep(self.poll_s)

    def add(self, key: str, amount: int) -> int:
        return self.raw.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.raw.delete_key(key)


def signed(store) -> SignedStore:
    """`store` if already signed, else the raw store wrapped with this process's job key
    (a vLLM worker or a standalone check that built its own TCPStore connection)."""
    return store if isinstance(store, SignedStore) else SignedStore.from_env(store)
