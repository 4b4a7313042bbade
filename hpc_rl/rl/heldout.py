"""Which prompts a run trains on and which it validates on (data.validation), the same on
the launching machine (rl/inputs.py check_inputs) and on every rank (rl/loop.py).

Validation is on while data.eval_prompts_per_task > 0. Its rows come from
data.validation.path, or from a split of the training rows by item (data/validation.py:
data.validation.split of each agent's items, seeded by run.seed) that removes them from
training: the PromptIterator never draws them. With validation off nothing is held out, so
a run that does not validate trains on every row.
"""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

from hpc_rl.config.errors import Violation
from hpc_rl.config.schema import RunConfig
from hpc_rl.data.dataset import DatasetError, PromptDataset, PromptRecord
from hpc_rl.data.validation import distinct_items, overlap, split_by_item



def validation_on(cfg: RunConfig) -> bool:
    return cfg.data.eval_prompts_per_task > 0


def split(cfg: RunConfig, rows: PromptDataset) -> Tuple[PromptDataset, PromptDataset]:
    """(training, validation) of the dataset's rows. A validation file is read here; its
    overlap with the rows is refused at launch (problems), so a rank never meets one."""
    v = cfg.data.validation
    if not validation_on(cfg):
        return rows, PromptDataset([], None)
    if v.path:
        return rows, PromptDataset.from_jsonl(v.path, skip_invalid=cfg.data.skip_invalid)
    return split_by_item(rows, v.split, cfg.run.seed)


def eval_records(validation: PromptDataset, per_agent: int, seed: int) -> List[PromptRecord]:
    """A fixed sample of `per_agent` distinct validation items of every agent (each scored
    once however often its prompt repeats), the same at every validation of the run; fewer
    where the set has fewer."""
    by_agent: Dict[str, List[PromptRecord]] = {}
    for rec in distinct_items(validation.records):
        by_agent.setdefault(rec.agent, []).append(rec)
    rng = random.Random(f"eval:{seed}")
    out: List[PromptRecord] = []
    for agent in sorted(by_agent):
        rows = by_agent[agent]
        out.extend(rng.sample(rows, min(per_agent, len(rows))))
    return out


def problems(cfg: RunConfig, rows: PromptDataset) -> Tuple[List[Violation], PromptDataset]:
    """What is wrong with the validation set of these training rows, and the set (empty when
    it cannot be read). Overlapping rows are named by line, the first few of them."""
    v, out = cfg.data.validation, []
    if not validation_on(cfg):
        return out, PromptDataset([], None)
    try:
        train, val = split(cfg, rows)
    except DatasetError as e:
        return [Violation("data.validation.path", v.path, str(e), "fix that row, or set data.skip_invalid=true to skip malformed rows")], \
            PromptDataset([], None)
    except OSError as e:
        return [Violation("data.validation.path", v.path, f"cannot read it: {e.strerror or e}", "point it at a JSONL file")], \
            PromptDataset([], None)
    if v.path:
        hits = overlap(train, val)
        if hits:
            shown = ", ".join(f"line {a} (= {rows.path or 'training row'}:{b})" for a, b in hits[:5])
            out.append(Violation("data.validation.path", v.path,
                                 f"{len(hits)} of its {len(val)} rows are also training rows (same prompt, task and "
                                 f"answer): {shown}{' ...' if len(hits) > 5 else ''}; a validation set must be held out",
                                 f"remove those rows from {v.path} (or from the training data), or unset data.validation.path "
                                 "to split the training data by item (data.validation.split)"))
    if len(val) == 0 and v.path:
        out.append(Violation("data.validation.path", v.path, "it holds no usable row", "give it held-out prompts"))
    elif len(val) == 0:
        out.append(Violation("data.validation.split", v.split,
                             "the split holds out no item: it keeps at least one item of every agent for training, "
                             "so an agent needs two distinct prompts",
                             "give more distinct prompts, set data.validation.path to a held-out file, or "
                             "data.eval_prompts_per_task=0 to turn validation off"))
    if len(train) == 0:
        out.append(Violation("data.validation.split", v.split, "nothing is left to train on",
                             "lower data.validation.split or give more prompts"))
    return out, val
