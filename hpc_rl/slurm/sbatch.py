"""Render one heterogeneous sbatch script from a plan: one component per role.

The batch shell is the job's supervisor. It exports what ranks need to meet (containers
have no `scontrol`), starts one `srun --het-group=<k>` per role in the background, and
waits; when one role fails it stops the others and exits non-zero naming the role, so a
dead rank never leaves the rest of a 224-node allocation hanging on a collective.

Every run-directory path comes from hpc_rl/rundir.py, every HPC_RL_* name from
hpc_rl/runtime/env.py and the culprit scoring from hpc_rl/ft/culprit.py: the script holds
no second copy of those facts.

Scripts rendered without a run directory (the shipped `sbatch/` files) are for users who
submit by hand: they create their run directory on first start by planning the recipe
they were rendered from, with the checks launcher=slurm makes before it submits.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import List, Optional

from hpc_rl.config.schema import RunConfig
from hpc_rl.ft import culprit
from hpc_rl.plan.job_plan import JobPlan, RolePlan
from hpc_rl.rundir import RunDir, shell_role_file_name, umask_for
from hpc_rl.runtime import env
from hpc_rl.runtime.identity import PORT_BASE

# The run directory as the batch shell names it: every path below comes from RunDir.
SH = RunDir("$RUN_DIR")
RESTART_WORD = f"${env.RESTART}"
# launch.py's flag that plans a hand-submitted script's run with launcher=slurm's checks
BATCH_PLAN_FLAG = "--batch-plan"


@dataclass(frozen=True)
class RenderOptions:
    run_dir: Optional[str] = None  # None: created at job start under the submit directory
    python: Optional[str] = None  # None: launcher.slurm.python
    pickled: bool = False  # ranks run the executor's pickled submission (submitit) instead of the plain entry
    overrides: tuple = ()  # the launch overrides, replayed when a hand-submitted script plans its run


# The rendezvous port, from the job id and restart count (runtime/identity.py's
# rendezvous_port is the same arithmetic): a requeued job never meets its old store. It
# lies below the kernel's ephemeral range, where any outgoing connection may hold a port.
PORT_LINES = [
    "read -r eph_lo _ < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || eph_lo=32768",
    f"port_span=$(( eph_lo - {PORT_BASE} >= 1024 ? eph_lo - {PORT_BASE} : 10000 ))",
    'job_digits=$(echo "$SLURM_JOB_ID" | tr -cd 0-9)',
    f"export {env.MASTER_PORT}=$(( {PORT_BASE} + (10#${{job_digits:-0}} * 131 + {env.RESTART} * 17) % port_span ))",
]


def version_at_least(version: str, minimum: str) -> bool:
    def parts(v: str) -> List[int]:
        return [int(p) for p in v.split(".") if p.isdigit()]

    return parts(version) >= parts(minimum)


def placement_options(cfg: RunConfig, role: RolePlan) -> List[str]:
    """Keep each segment of a role inside one NVLink domain (block) or leaf switch (tree)."""
    cl = cfg.cluster
    seg = role.segment_size
    if seg <= 1 or role.nodes <= 1:
        return []
    if cl.topology == "block":
        if version_at_least(cl.slurm_version, "24.05"):
            return [f"--segment={seg}"]
        return [f"# --segment={seg} needs Slurm 24.05 (cluster.slurm_version={cl.slurm_version}): placement is checked after allocation"]
    if cl.topology == "tree":
        per_switch = cl.leaf_switch_nodes or seg
        switches = -(-role.nodes // per_switch)
        return [f"--switches={switches}@{cfg.launcher.slurm.switches_wait}"]
    return []


def component_options(cfg: RunConfig, role: RolePlan) -> List[str]:
    cl, sl = cfg.cluster, cfg.launcher.slurm
    opts = [f"--nodes={role.nodes}", f"--ntasks-per-node={role.tasks_per_node}"]
    if role.gpus_per_node > 0:
        opts.append(f"--gpus-per-node={role.gpus_per_node}")
    opts.append(f"--cpus-per-task={max(1, cl.cpus_per_node // role.tasks_per_node)}")
    if cl.exclusive:
        opts += ["--exclusive", "--mem=0"]
    # Every component repeats where and how long it runs: Slurm takes them per component.
    for flag, value in (("partition", cl.partition), ("account", cl.account), ("qos", cl.qos),
                        ("reservation", sl.reservation), ("time", sl.time)):
        if value:
            opts.append(f"--{flag}={value}")
    opts += placement_options(cfg, role)
    return opts


def job_name(cfg: RunConfig) -> str:
    """The het job's name (job handles check it on reattach: job ids come back)."""
    return cfg.launcher.slurm.job_name or "hpc_rl-" + (cfg.recipe or "run")


def header_options(cfg: RunConfig, run_dir: Optional[str]) -> List[str]:
    sl = cfg.launcher.slurm
    opts = [f"--job-name={job_name(cfg)}"]
    # The batch shell's own log: in the run directory when known, else beside the submit dir.
    out = str(RunDir(run_dir).batch_log) if run_dir else f"hpc_rl-{cfg.recipe}-%j.out"
    opts += [f"--output={out}", "--open-mode=append"]
    if sl.requeue:
        opts.append("--requeue")
    if sl.signal_grace_s > 0:
        opts.append(f"--signal=B:USR1@{sl.signal_grace_s}")
    if sl.dependency:
        # A dependency that can never be met (an upstream job failed) cancels this job instead
        # of leaving it pending forever (pipelines chain stages with afterok, hpc_rl/pipeline).
        opts += [f"--dependency={sl.dependency}", "--kill-on-invalid-dep=yes"]
    return opts


def container_flags(cfg: RunConfig) -> List[str]:
    c = cfg.container
    if not c.image:
        return []
    mounts = ["$RUN_DIR:$RUN_DIR", *c.mounts]
    return [
        f"--container-image={shlex.quote(c.image)}",
        f'--container-mounts="{",".join(mounts)}"',
        f'--container-workdir="{c.workdir or "$RUN_DIR"}"',
        "--no-container-mount-home",
        f"--container-env={','.join(env.CONTAINER_ENV)}",
    ]


def _sbatch_lines(opts: List[str]) -> List[str]:
    return [o if o.startswith("#") else f"#SBATCH {o}" for o in opts]


def render(cfg: RunConfig, plan: JobPlan, options: RenderOptions = RenderOptions()) -> str:
    python = options.python or cfg.launcher.slurm.python
    lines = [
        "#!/bin/bash",
        f"# hpc_rl heterogeneous job: recipe {plan.recipe} on {plan.cluster}, {plan.total_nodes} nodes, "
        f"{len(plan.roles)} components.",
        "# Rendered by hpc_rl (python -m hpc_rl.launch); submit with `sbatch <this file>`.",
        "# Components in order: " + ", ".join(f"{k}={r.name}" for k, r in enumerate(plan.roles)),
    ]
    for k, role in enumerate(plan.roles):
        if k == 0:
            lines += _sbatch_lines(header_options(cfg, options.run_dir))
        else:
            lines.append("#SBATCH hetjob")
        lines.append(f"# component {k}: {role.name} (tp={role.parallel['tp']} cp={role.parallel['cp']} "
                     f"ep={role.parallel['ep']} pp={role.parallel['pp']} dp={role.parallel['dp']})")
        lines += _sbatch_lines(component_options(cfg, role))
    lines.append("")
    lines += _body(cfg, plan, options, python)
    return "\n".join(lines) + "\n"


def _role_reports(var: str) -> str:
    """The quoted glob of every error report, this restart, of the role whose file name is in
    bash variable `var` ('*' stays outside the quotes so it expands)."""
    glob = str(SH.error_report(f"${var}", "*", RESTART_WORD))
    return '"' + '"*"'.join(glob.split("*")) + '"'


def _bootstrap(cfg: RunConfig, plan: JobPlan, options: RenderOptions, python: str) -> List[str]:
    """A script rendered without a run directory plans its run on first start, running the
    checks launcher=slurm runs before it submits (launch.py --batch-plan): a refused config
    ends the job here, its violations in the job's output, before any srun starts a rank."""
    q = shlex.quote
    replay = " ".join(q(o) for o in options.overrides if not o.startswith(("launcher=", "run.dir=")))
    # In a container, hpc_rl lives in the image: plan from inside it, on one task.
    runner = ""
    if cfg.container.image:
        runner = "srun --het-group=0 --nodes=1 --ntasks=1 " + " ".join(container_flags(cfg)) + " "
    return [
        "# Submitted by hand: plan the run into RUN_DIR on first start (a requeue finds it there), checked",
        "# as launcher=slurm checks before it submits; a refused config ends the job here, before any rank starts.",
        'if [ ! -f "$PLAN_FILE" ]; then',
        '    mkdir -p "$RUN_DIR"',
        f'    {runner}{python} -m hpc_rl.launch {BATCH_PLAN_FLAG} {replay} launcher=slurm run.dir="$RUN_DIR" || exit 2',
        "fi",
    ]


def _body(cfg: RunConfig, plan: JobPlan, options: RenderOptions, python: str) -> List[str]:
    q = shlex.quote
    grace = cfg.launcher.kill_grace_s
    R = RESTART_WORD
    if options.run_dir:
        run_dir_line = f"RUN_DIR={q(options.run_dir)}"
        bootstrap: List[str] = []
    else:
        run_dir_line = f'RUN_DIR="${{{env.RUN_DIR}:-$SLURM_SUBMIT_DIR/runs/{plan.recipe}-$SLURM_JOB_ID}}"'
        bootstrap = _bootstrap(cfg, plan, options, python)
    entry = "hpc_rl.slurm.rank_entry"
    mode = RunDir.mode(cfg)
    body = [
        "set -uo pipefail",
        "# Ranks unpickle and torch.load what the run directory holds: what this job makes there is",
        "# run.dir_mode at most. srun hands SLURM_UMASK (sbatch set it to the submitter's) to every task.",
        f"umask {umask_for(mode):04o}; export SLURM_UMASK={umask_for(mode):04o}",
        run_dir_line,
        f'export {env.RESTART}="${{SLURM_RESTART_COUNT:-0}}"',
        "# The job's secret (hpc_rl/runtime/signed_store.py): launcher=slurm passes it in sbatch's environment;",
        "# a script submitted by hand makes one here. srun hands it to every task; it is never written or echoed.",
        f'export {env.JOB_KEY}="${{{env.JOB_KEY}:-$(od -An -N32 -tx1 /dev/urandom | tr -d \' \\n\')}}"',
        "# The run directory's files this shell reads and writes (hpc_rl/rundir.py names them).",
        *SH.shell_lines(R),
        *bootstrap,
        'if [ -f "$FINISHED_FILE" ]; then  # a finished run is never run (or requeued) again',
        '    echo "hpc_rl: $RUN_DIR already finished; nothing to do"; exit 0',
        "fi",
        f'mkdir -p "$LOG_DIR" && chmod {mode:04o} "$RUN_DIR" "$LOG_DIR"  # an existing directory is tightened too',
        f'export {env.RUN_DIR}="$RUN_DIR"',
        f'export {env.JOB_ID}="$SLURM_JOB_ID"',
        f"export {env.PICKLED}={1 if options.pickled else 0}",
        "# Ranks meet on a TCPStore hosted by trainer rank 0, the first task of component 0.",
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)',
        'node_addr=$(scontrol show node "$first_node" 2>/dev/null | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        f'export {env.MASTER_ADDR}="${{node_addr:-$first_node}}"',
        *PORT_LINES,
        "# The switch/block topology for the ranks' placement (containers have no scontrol).",
        'scontrol show topology > "$TOPOLOGY_FILE" 2>/dev/null || true',
        f'echo "hpc_rl: job $SLURM_JOB_ID restart {R} started at $(date +%s.%N), run dir $RUN_DIR, '
        f'store ${env.MASTER_ADDR}:${env.MASTER_PORT}"',
        "",
        "# The job's end (epoch seconds): ranks start no checkpoint save that cannot finish before it.",
        'end_time=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null | head -n 1)',
        f'export {env.JOB_END}=$(date -d "$end_time" +%s 2>/dev/null || true)',
        "",
        "# Time limit near (USR1, --signal=B:USR1@grace): ask the ranks to save and stop; requeue below.",
        "trap 'echo \"hpc_rl: USR1 received at $(date +%s.%N): asking the ranks to save and stop\"; "
        "echo \"time limit near (USR1)\" > \"$SAVE_REQUEST_FILE\"' USR1",
        "",
        "roles=(); pids=()",
        "start_role() {  # start_role <het group> <role>",
        f"    local k=$1 role=$2 log={shell_role_file_name('2')}",
        f"    {env.ROLE}=$role srun --het-group=\"$k\" --kill-on-bad-exit=1 --open-mode=append \\",
        f"        --output=\"{SH.log('$log', R, 'out')}\" --error=\"{SH.log('$log', R, 'err')}\" \\",
    ]
    flags = container_flags(cfg)
    if flags:
        body.append("        " + " ".join(flags) + " \\")
    body += [
        f"        {python} -m {entry} \"$RUN_DIR\" &",
        "    roles+=(\"$role\"); pids+=($!)",
        "}",
    ]
    for k, role in enumerate(plan.roles):
        body.append(f"start_role {k} {q(role.name)}")
    body += [
        "",
        "stop_all() {  # SIGTERM every remaining step, SIGKILL after the grace period",
        "    local pid",
        "    for pid in \"${pids[@]}\"; do [ -n \"$pid\" ] && kill -TERM \"$pid\" 2>/dev/null; done",
        f"    local deadline=$(( SECONDS + {int(max(grace, 1))} ))",
        "    while [ $SECONDS -lt $deadline ]; do",
        "        local alive=0",
        "        for pid in \"${pids[@]}\"; do [ -n \"$pid\" ] && kill -0 \"$pid\" 2>/dev/null && alive=1; done",
        "        [ $alive -eq 0 ] && return",
        "        sleep 0.5",
        "    done",
        "    for pid in \"${pids[@]}\"; do [ -n \"$pid\" ] && kill -KILL \"$pid\" 2>/dev/null; done",
        "}",
        "",
        "# The culprit among the roles that failed close together, by the scoring table of",
        "# hpc_rl/ft/culprit.py: killed by a signal, before raised its own error, before only lost",
        "# a peer, before stopped on a heartbeat verdict. A killed rank's step can end seconds after",
        "# its peers' (its children exit late), so while only consequences have failed the choice",
        "# waits, up to 20 s.",
        *culprit.render_bash(_role_reports),
        "pick_culprit() {",
        "    local i score best='' best_score=-1",
        "    for i in \"${!roles[@]}\"; do",
        "        score=$(score_of \"$i\")",
        "        if [ \"$score\" -gt \"$best_score\" ]; then best=$i; best_score=$score; fi",
        "    done",
        "    [ \"$best_score\" -ge 0 ] && { failed_role=${roles[$best]}; status=${rcs[$best]}; }",
        "    culprit_score=$best_score",
        "}",
        "",
        "failed_role=''; status=0; rcs=(); first_fail=''; stopped=''; culprit_score=-1",
        "while :; do",
        "    running=0",
        "    for i in \"${!pids[@]}\"; do",
        "        pid=${pids[$i]}; [ -z \"$pid\" ] && continue",
        "        if kill -0 \"$pid\" 2>/dev/null; then running=1; continue; fi",
        "        wait \"$pid\"; rc=$?; pids[$i]=''; rcs[$i]=$rc",
        "        if [ $rc -ne 0 ] && [ -z \"$first_fail\" ]; then first_fail=$SECONDS; fi",
        "    done",
        "    if [ -n \"$first_fail\" ] && [ -z \"$stopped\" ]; then",
        "        pick_culprit; waited=$((SECONDS - first_fail))",
        "        if [ $running -eq 0 ] || [ $waited -ge 20 ] || [ -f \"$DEAD_RANK_FILE\" ] || \\",
        f"                {{ [ $waited -ge 3 ] && [ $culprit_score -ge {culprit.ORIGIN_SCORE} ]; }}; then",
        "            stopped=1",
        "            echo \"hpc_rl: a role failed (most likely culprit so far: $failed_role, exit $status); stopping the other roles\" >&2",
        "            stop_all",
        "        fi",
        "    fi",
        "    [ $running -eq 0 ] && break",
        "    sleep 1",
        "done",
        "",
        "dead_verdict=''",
        "if [ -f \"$DEAD_RANK_FILE\" ]; then  # heartbeats named the dead rank",
        "    verdict=$(head -n 1 \"$DEAD_RANK_FILE\")",
        "    dead=${verdict%% *}; dead=${dead%:*}",
        "    for r in \"${roles[@]}\"; do [ \"$r\" = \"$dead\" ] && failed_role=$dead; done",
        "    dead_verdict=$verdict",
        "fi",
        "# The outcome for job handles when accounting is off (squeue forgets finished jobs).",
        "detail=''",
        "if [ -n \"$failed_role\" ]; then",
        "    # the failed role's own errors; its peers' 'connection closed' errors are consequences",
        f"    failed_name={shell_role_file_name('failed_role')}",
        f"    for f in {_role_reports('failed_name')}; do",
        "        [ -f \"$f\" ] && detail=\"$detail$(head -n 1 \"$f\"); \"",
        "    done",
        "    # the dead rank's own report wins; the heartbeat verdict speaks when it left none",
        "    [ -z \"$detail\" ] && [ -n \"$dead_verdict\" ] && detail=\"$dead_verdict; \"",
        "    echo \"hpc_rl: job failed in role $failed_role: ${detail:-no rank of $failed_role reported an error (killed?)}\" >&2",
        "fi",
        "",
        "# Requeue: after a save on request (time limit) or a failure, within the retry budget.",
        "requeue=''",
        "if [ -f \"$FINISHED_FILE\" ]; then",
        "    status=0",
        "elif [ -f \"$STOPPED_FILE\" ]; then",
        "    requeue='saved on request (time limit near)'",
        "elif [ -f \"$FATAL_FILE\" ]; then  # a retry would fail the same way",
        "    detail=\"not requeued: $(head -n 1 \"$FATAL_FILE\"). $detail\"",
        "elif [ $status -ne 0 ]; then",
        "    requeue=\"role $failed_role failed\"",
        "else",
        "    requeue='the ranks exited without finishing'; status=1",
        "fi",
        f"max_restarts={int(cfg.ft.max_restarts) if cfg.launcher.slurm.requeue else 0}",
        "requeued=false",
        "if [ -n \"$requeue\" ]; then",
        f"    if [ \"{R}\" -lt \"$max_restarts\" ]; then",
        "        requeued=true",
        f"        echo \"hpc_rl: requeueing job $SLURM_JOB_ID: $requeue; restart $(({env.RESTART} + 1)) of at most $max_restarts\" >&2",
        "    else",
        f"        detail=\"retry budget exhausted after {R} restarts (ft.max_restarts=$max_restarts): $requeue. $detail\"",
        "        echo \"hpc_rl: job $SLURM_JOB_ID ends failed: $detail\" >&2",
        "        [ $status -eq 0 ] && status=1",
        "    fi",
        "fi",
        "detail=$(printf '%s' \"$detail\" | tr -d '\"\\\\')  # keep the JSON below valid",
        "tmp=\"$JOB_EXIT_FILE.tmp.$$\"  # written whole, then renamed: readers never see half of it",
        "printf '{\"job_id\": \"%s\", \"restart\": %s, \"exit_code\": %s, \"failed_role\": \"%s\", \"detail\": \"%s\", \"requeued\": %s}\\n' \\",
        f"    \"$SLURM_JOB_ID\" \"{R}\" \"$status\" \"$failed_role\" \"$detail\" \"$requeued\" > \"$tmp\" && mv \"$tmp\" \"$JOB_EXIT_FILE\"",
        "if [ \"$requeued\" = true ]; then",
        "    # the batch shell runs outside any container, so scontrol is at hand here",
        "    scontrol requeue \"$SLURM_JOB_ID\" || echo \"hpc_rl: scontrol requeue failed\" >&2",
        "    sleep 60  # Slurm ends this shell as it requeues the job",
        "fi",
        "exit $status",
    ]
    return body
