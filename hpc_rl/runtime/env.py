"""RankEnv: the `HPC_RL_*` environment variables a rank starts with, named in one place.

A launcher tells every rank who it is and where to meet through these variables: the
local launcher sets them per process (`RankEnv.to_env()`), the batch shell rendered by
hpc_rl/slurm/sbatch.py exports them from the names below, and a rank reads them once
(`RankEnv.from_env()`). Where a Slurm variable says the same thing (SLURM_PROCID for the
role rank: one `srun` per role makes Slurm's numbers role-local), it is read when the
HPC_RL_ name is unset, so roles never parse Slurm variables themselves.

Set by launchers for every rank:
  HPC_RL_ROLE          the rank's role (trainer, generator, teacher/<group>, env)
  HPC_RL_ROLE_RANK     rank within the role          (else SLURM_PROCID)
  HPC_RL_ROLE_SIZE     ranks of the role             (else SLURM_NTASKS)
  HPC_RL_LOCAL_RANK    rank on its node              (else SLURM_LOCALID)
  HPC_RL_NODE          node name                     (else SLURMD_NODENAME)
  HPC_RL_RESTART       restart count of the job      (else SLURM_RESTART_COUNT)
  HPC_RL_JOB_ID        the (het) job id              (else SLURM_HET_JOB_ID, SLURM_JOB_ID)
  HPC_RL_RUN_DIR       the run directory
  HPC_RL_MASTER_ADDR   host of the TCPStore (trainer rank 0)
  HPC_RL_MASTER_PORT   its port (else derived: runtime/identity.py rendezvous_port)
  HPC_RL_PICKLED       1: run the executor's pickled submission (slurm/rank_entry.py)
  HPC_RL_JOB_END       the job's end, epoch seconds (batch shell; empty when unknown)
  HPC_RL_JOB_KEY       the job's secret (runtime/signed_store.py): made at launch, or by the
                       batch shell of a hand-submitted script; it MACs every store value and
                       every pickled message. Not a RankEnv field: it is never printed,
                       logged or written into the run directory.
Set by the rank's own processes:
  HPC_RL_T_START       when the rank's interpreter started (its supervisor's, if any)
  HPC_RL_SUPERVISED    1 in the child a rank supervisor started (runtime/supervise.py)
  HPC_RL_PLACED_RANK, HPC_RL_PLACED_ROLE_RANK   ranks after placement at rendezvous
Read elsewhere, not part of a rank's identity (they stay beside their readers):
  HPC_RL_RECIPES       the Hydra config tree (hpc_rl/config/compose.py)
  HPC_RL_ASSETS        the tiny-model cache (hpc_rl/models/assets.py)
  HPC_RL_CPU_AFFINITY  benchmarks: role=cpus;... pins a role's process (hpc_rl/runtime/groups.py)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Callable, Dict, Mapping, Optional, Tuple

ROLE = "HPC_RL_ROLE"
ROLE_RANK = "HPC_RL_ROLE_RANK"
ROLE_SIZE = "HPC_RL_ROLE_SIZE"
LOCAL_RANK = "HPC_RL_LOCAL_RANK"
NODE = "HPC_RL_NODE"
RESTART = "HPC_RL_RESTART"
JOB_ID = "HPC_RL_JOB_ID"
RUN_DIR = "HPC_RL_RUN_DIR"
MASTER_ADDR = "HPC_RL_MASTER_ADDR"
MASTER_PORT = "HPC_RL_MASTER_PORT"
PICKLED = "HPC_RL_PICKLED"
JOB_END = "HPC_RL_JOB_END"
JOB_KEY = "HPC_RL_JOB_KEY"
T_START = "HPC_RL_T_START"
SUPERVISED = "HPC_RL_SUPERVISED"
PLACED_RANK = "HPC_RL_PLACED_RANK"
PLACED_ROLE_RANK = "HPC_RL_PLACED_ROLE_RANK"

# Slurm's own names for the same facts, read in this order when the HPC_RL_ name is unset.
# SLURM_HET_JOB_ID before SLURM_JOB_ID: in component k of a het job SLURM_JOB_ID is the
# component's id, while result pickles and the store port use the job's (leader's) id.
SLURM_EQUIVALENTS: Dict[str, Tuple[str, ...]] = {
    ROLE_RANK: ("SLURM_PROCID",),
    ROLE_SIZE: ("SLURM_NTASKS",),
    LOCAL_RANK: ("SLURM_LOCALID",),
    NODE: ("SLURMD_NODENAME",),
    RESTART: ("SLURM_RESTART_COUNT",),
    JOB_ID: ("SLURM_HET_JOB_ID", "SLURM_JOB_ID"),
}

# What the batch shell exports for every rank; pyxis is told to pass exactly these into a
# container (--container-env) so the image's own environment cannot shadow them.
CONTAINER_ENV = (ROLE, RUN_DIR, JOB_ID, RESTART, MASTER_ADDR, MASTER_PORT, PICKLED, JOB_KEY)


def _flag(text: str) -> bool:
    return text == "1"


def _var(name: str, parse: Callable[[str], object] = str):
    return field(default=None, metadata={"env": name, "parse": parse})


@dataclass(frozen=True)
class RankEnv:
    """The variables of one rank; None where unset (callers choose their defaults)."""

    role: Optional[str] = _var(ROLE)
    role_rank: Optional[int] = _var(ROLE_RANK, int)
    role_size: Optional[int] = _var(ROLE_SIZE, int)
    local_rank: Optional[int] = _var(LOCAL_RANK, int)
    node: Optional[str] = _var(NODE)
    restart: Optional[int] = _var(RESTART, int)
    job_id: Optional[str] = _var(JOB_ID)
    run_dir: Optional[str] = _var(RUN_DIR)
    master_addr: Optional[str] = _var(MASTER_ADDR)
    master_port: Optional[int] = _var(MASTER_PORT, int)
    pickled: Optional[bool] = _var(PICKLED, _flag)
    job_end: Optional[str] = _var(JOB_END)  # kept as text: ft code parses it and explains a bad value
    t_start: Optional[float] = _var(T_START, float)
    supervised: Optional[bool] = _var(SUPERVISED, _flag)
    placed_rank: Optional[int] = _var(PLACED_RANK, int)
    placed_role_rank: Optional[int] = _var(PLACED_ROLE_RANK, int)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "RankEnv":
        """Read `env` (default os.environ). An empty value counts as unset; a value that does
        not parse raises ValueError naming the variable."""
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            name = f.metadata["env"]
            for source in (name, *SLURM_EQUIVALENTS.get(name, ())):
                text = env.get(source)
                if text not in (None, ""):
                    try:
                        values[f.name] = f.metadata["parse"](text)
                    except ValueError:
                        raise ValueError(f"{source}={text!r} is not a valid {f.name.replace('_', ' ')}") from None
                    break
        return cls(**values)

    def to_env(self) -> Dict[str, str]:
        """The HPC_RL_* variables of the fields that are set, as a launcher exports them."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.metadata["env"]] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out
