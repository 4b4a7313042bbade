"""The small batch and loss the backend tests share: token ids with two rows padded at the
end, and a masked mean of the log-probs (so every backend layout is compared on one thing)."""

import torch


def masked_batch(rows: int = 4, length: int = 12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 100, (rows, length), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0
    attn[3, 6:] = 0
    return ids, attn


def masked_loss(mask):
    def fn(lp, rows):  # scaled to the whole batch's tokens, so micro-batches add up
        m = mask[rows].float()
        return -(lp * m).sum() / mask.float().sum(), {}
    return fn
