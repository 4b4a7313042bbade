"""Greedy continuations on the Megatron backend (an inference-only teacher's own accuracy):
row by row, one full forward per new token through megatron-core's schedule. Functions of a
built MegatronBackend (backend.py), which calls them; nothing here imports it back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpc_rl.runtime import sealed

from .shards import mesh_groups


@torch.no_grad()
def greedy_rows(b, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, eos_id: int,
                pad_id: int) -> torch.Tensor:
    """Row by row (left padding stripped, so no padding mask is needed), one full forward
    per new token: a teacher's accuracy check, not a serving path."""
    outs = []
    for row, mask in zip(input_ids, attention_mask):
        seq = row[mask.bool()].tolist()
        new = []
        for _ in range(max_new_tokens):
            tok = next_token(b, torch.tensor([seq + new]))
            new.append(tok)
            if tok == eos_id:
                break
        outs.append(new + [pad_id] * (max_new_tokens - len(new)))
    return torch.tensor(outs, dtype=torch.long)


def next_token(b, ids: torch.Tensor) -> int:
    """Greedy next token: vocabulary-parallel argmax on the last stage's last position."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    b.model.eval()
    batch = b._batch(ids)
    last_pos = ids.shape[1] - 1
    where = (batch["pos"][0] == last_pos).nonzero()

    def step(data, model):
        bb = next(data)
        out = model(bb["ids"], bb["pos"], None)

        def head(output):
            if not b.last:
                return output, {}
            best = torch.tensor([-float("inf"), -1.0], device=output.device)
            if len(where):
                row = output[0, where[0, 0]].float()
                real = b.dims.vocab - b.c.tp * output.shape[-1]  # rows past it are padding
                row[max(real, 0):] = float("-inf")
                v, i = row.max(-1)
                best = torch.stack([v, (i + b.c.tp * output.shape[-1]).float()])
            cands = [torch.empty_like(best) for _ in range(b.p.tp * b.p.cp)]
            dist.all_gather(cands, best, group=b.pgs.tp_cp)
            top = max(cands, key=lambda c: float(c[0]))
            return output.new_zeros(()), {"tok": int(top[1])}

        return out, head

    got = get_forward_backward_func(pp_size=b.p.pp)(
        forward_step_func=step, data_iterator=iter([batch]), model=[b.model], num_microbatches=1,
        seq_length=batch["ids"].shape[1], micro_batch_size=1, forward_only=True, pg_collection=b.pgs,
        p2p_communicator=P2PCommunicator(b.pgs.pp, b.tcfg))
    box = [got[0]["tok"] if b.last else None]
    if b.p.pp > 1:
        last = b.ranks[next(g for g in mesh_groups(b.p)["pp"] if b.me in g)[-1]]
        box[0], _ = sealed.broadcast(box[0], last, b.pgs.pp)
    return box[0]
