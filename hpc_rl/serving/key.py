"""The generators' endpoint key: one per job, derived from the job's secret.

Derived rather than drawn: every rank of the job already holds the job's secret in its
environment (runtime/signed_store.py), so the generators that serve and the environment
ranks that call them compute the same key without it ever travelling through the store,
a file or a message. A different label than the store's MACs use keeps the two apart:
knowing the endpoint key (an environment's sandboxed tool might leak it) says nothing
about the job's secret or its MACs.

The key is never written to disk, logs or metrics: callers keep it in memory and put it
only in the `Authorization` header of their requests.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Mapping, Optional

from hpc_rl.runtime.signed_store import job_key

LABEL = b"hpc_rl generator endpoint"


def endpoint_key(environ: Optional[Mapping[str, str]] = None) -> str:
    """Hex HMAC-SHA256 of the job's secret over LABEL (MissingJobKey if the secret is unset)."""
    return hmac.new(job_key(environ), LABEL, hashlib.sha256).hexdigest()
