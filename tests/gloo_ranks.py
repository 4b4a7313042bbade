"""Run a test's worker function as `world` local processes over gloo, the way every
multi-rank CPU test here does.

Two things every such test needs, done once here:
- One thread per rank. Torch's default is a thread per core; two or four ranks on this
  machine's two cores then spin in each other's OpenMP barriers.
- No gloo teardown. `destroy_process_group` aborted a rank with SIGABRT ("terminate called
  without an active exception") on a loaded machine, after the results were written. Each
  rank passes a barrier and leaves with os._exit(0); an exception raised by the worker still
  reaches the parent through spawn's error file, since it is raised before the exit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, worker: Callable[..., None], world: int, store_path: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    worker(rank, world, *args)
    dist.barrier()
    os._exit(0)


def run_ranks(worker: Callable[..., None], world: int, store_path: Path, *args: Any) -> None:
    """Call `worker(rank, world, *args)` in `world` spawned processes joined in one gloo
    group (a FileStore at `store_path`, fresh per call); returns once all have left."""
    mp.start_processes(_entry, args=(worker, world, str(store_path), args), nprocs=world, join=True, start_method="spawn")
