"""Validation of the trainer's memory keys (`trainer.logprob_chunk_tokens`,
`trainer.logprob_batch_tokens`), beside validate.py. Their refusals on the megatron backend,
which does not read them, are support.py's rules."""

from __future__ import annotations

from typing import List

from .errors import check_positive, Violation


def check_memory(out: List[Violation], t) -> None:
    # None: the backend's default; 0: off (whole logits / every row in one forward)
    if t.logprob_chunk_tokens is not None:
        check_positive(out, "trainer.logprob_chunk_tokens", t.logprob_chunk_tokens, minimum=0)
    if t.logprob_batch_tokens is not None:
        check_positive(out, "trainer.logprob_batch_tokens", t.logprob_batch_tokens, minimum=0)
