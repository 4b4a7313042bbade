"""run.dir_mode: the mode of a run directory and its subdirectories (hpc_rl/rundir.py).

Ranks unpickle and torch.load(weights_only=False) what a run directory holds (result
pickles, checkpoints' extra state), so whoever can write there runs code as the job: a mode
that lets the group or others write is refused, never honoured."""

from __future__ import annotations

from typing import List, Union

from .errors import Violation
from .schema import RunConfig

_OCTAL = set("01234567")


def parse_dir_mode(value: Union[str, int]) -> int:
    """An octal string ("0700", "750", "0o750") or a number (0o750) -> the mode; ValueError
    saying why not."""
    if isinstance(value, bool):
        raise ValueError("is not a mode")
    if isinstance(value, int):
        mode = value
    else:
        digits = str(value).strip().lower().removeprefix("0o")
        if not digits or not set(digits) <= _OCTAL:
            raise ValueError("is not an octal mode")
        mode = int(digits, 8)
    if not 0 <= mode <= 0o777:
        raise ValueError("is not a permission mode from 0000 to 0777 (setuid, setgid and sticky bits are not taken)")
    if mode & 0o700 != 0o700:
        raise ValueError("the owner needs rwx (0700) on its own run directory")
    if mode & 0o022:
        raise ValueError("lets the group or others write: they could plant pickles and checkpoint files that the "
                         "ranks execute")
    return mode


def check_run_dir(out: List[Violation], cfg: RunConfig) -> None:
    try:
        parse_dir_mode(cfg.run.dir_mode)
    except ValueError as e:
        out.append(Violation("run.dir_mode", cfg.run.dir_mode, str(e),
                             'quote an octal mode: run.dir_mode="0700" (only you) or "0750" (the group may read); '
                             "YAML reads an unquoted 0750 as the number 488"))
