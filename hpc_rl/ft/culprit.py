"""Which failed rank (or role) most likely caused the others to fail: one scoring table.

When one rank dies its peers fail too, seconds apart, and every supervisor must name the
one that started it. The local launcher (launchers/local.py, in Python, per rank) and the
batch shell (rendered by slurm/sbatch.py, in bash, per role: it sees one srun status per
role) score failures with the table below; the bash `score_of` is rendered from it.

The classes, from most to least likely the origin:

  killed     exit >= 128 (a shell's or the rank supervisor's 128 + signal; a negative
             Popen status): something outside the program ended it (OOM killer, a lost
             node, an injected kill). Nothing in its peers' failures could cause that.
  raised     it raised an error of its own.
  lost_peer  it raised, but its error report says it lost a peer ('Connection reset',
             'Broken pipe', ...): a consequence of someone else's failure.
  stopped    exit 75: its heartbeat thread stopped it on purpose because a peer died.

Why four levels: the local launcher used to score three (killed, raised, stopped) and
so could blame, in rank order, a trainer that only lost its connection over the generator
that raised the real error; the batch shell already told those apart by the error report.
The union keeps both distinctions, and each supervisor reads the evidence it has (the
local launcher a rank's own report, the batch shell every report of the role).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from hpc_rl.rundir import shell_role_file_name

STOPPED_BY_PEER_EXIT = 75  # a rank whose peer died exits with this on purpose (EX_TEMPFAIL: retry may work)
SIGNAL_EXIT_BASE = 128  # a shell reports death by signal N as 128 + N; so does runtime/supervise.py
# An error report mentioning one of these was caused by losing a peer (gloo/NCCL/TCPStore
# wording). Python `re` and `grep -E` read this pattern alike.
LOST_PEER_PATTERN = r"Connection (reset|closed)|Broken pipe|peer"

FINISHED, STOPPED, LOST_PEER, RAISED, KILLED = "finished", "stopped", "lost_peer", "raised", "killed"


@dataclass(frozen=True)
class Rule:
    name: str
    score: int  # higher: more likely the origin; -1: not a failure
    applies: Callable[[int, Callable[[], bool]], bool]  # (exit status, lost_peer()) -> does it apply?
    bash: str  # the same test in the rendered score_of ('' for the last rule: it always applies)


# Checked in order; the first that applies gives the class. The order matters: a killed rank
# may have left a 'connection reset' report before the signal, and is still the origin.
RULES = (
    Rule(FINISHED, -1, lambda rc, lost: rc == 0, '[ "$rc" -eq 0 ]'),
    Rule(KILLED, 3, lambda rc, lost: rc < 0 or rc >= SIGNAL_EXIT_BASE, f'[ "$rc" -ge {SIGNAL_EXIT_BASE} ]'),
    Rule(STOPPED, 0, lambda rc, lost: rc == STOPPED_BY_PEER_EXIT, f'[ "$rc" -eq {STOPPED_BY_PEER_EXIT} ]'),
    Rule(LOST_PEER, 1, lambda rc, lost: lost(), 'lost_peer "${roles[$1]}"'),
    Rule(RAISED, 2, lambda rc, lost: True, ""),
)
SCORES = {r.name: r.score for r in RULES}
# A culprit scoring this or more is no consequence of another failure: supervisors need not
# wait for a better one.
ORIGIN_SCORE = SCORES[RAISED]


def lost_peer(report: Optional[str]) -> bool:
    return bool(report) and re.search(LOST_PEER_PATTERN, report) is not None


def classify(rc: int, report: Callable[[], Optional[str]] = lambda: None) -> str:
    """The class of a rank that exited with `rc`; `report()` returns its error report's text
    (or None), read only when the exit status alone does not decide."""
    for rule in RULES:
        if rule.applies(rc, lambda: lost_peer(report())):
            return rule.name
    raise AssertionError("the last rule always applies")


def score(rc: int, report: Callable[[], Optional[str]] = lambda: None) -> int:
    return SCORES[classify(rc, report)]


def named_in_verdict(verdict: str) -> Optional[Tuple[str, int]]:
    """(role, rank) a heartbeat verdict (errors/dead_rank.<restart>.txt) names first: its first
    word is `role:rank` (runtime/rendezvous.py describe_rank). The batch shell reads the role
    the same way: ${verdict%% *}, then ${dead%:*}."""
    head = verdict.strip().split(" ", 1)[0]
    role, sep, rank = head.rpartition(":")
    return (role, int(rank)) if sep and role and rank.isdigit() else None


def render_bash(role_reports: Callable[[str], str]) -> List[str]:
    """The batch shell's `lost_peer <role>` and `score_of <index>` functions (its arrays
    `roles` and `rcs` hold each role's name and srun exit status). `role_reports(var)` is the
    quoted glob of every error report this restart of the role named by bash variable `var`."""
    lines = [
        "lost_peer() {  # lost_peer <role>: an error report of the role says it lost a peer",
        f"    local name={shell_role_file_name('1')}",
        f"    grep -qsE '{LOST_PEER_PATTERN}' {role_reports('name')}",
        "}",
        "score_of() {  # score_of <index>: the culprit score of that role (hpc_rl/ft/culprit.py)",
        "    local rc=${rcs[$1]:-0}",
    ]
    for k, rule in enumerate(RULES):
        if k == 0:
            lines.append(f"    if {rule.bash}; then echo {rule.score}")
        elif rule.bash:
            lines.append(f"    elif {rule.bash}; then echo {rule.score}")
        else:
            lines.append(f"    else echo {rule.score}; fi")
    lines.append("}")
    return lines

