"""`python -m hpc_rl.pipeline run|status|cancel|render` and `python -m hpc_rl.launch +pipeline=NAME`.

  run NAME [pipeline.dir=DIR] [stages.S.key=value] [key=value] [--wait]
        check every stage, then submit them chained by dependencies (again: resume)
  status DIR    the DAG with each stage's state, job, progress and ETA, and why a stage failed
  cancel DIR    scancel every queued or running stage
  render NAME [pipeline.dir=DIR] [--out DIR] [--plan FILE]
        every stage's sbatch script and submit.sh (hand submission), and the plan file

A bad config exits 2 listing every problem of every stage; nothing is submitted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

from hpc_rl.config.errors import ConfigError

from .spec import available, load_spec, split_args

USAGE = __doc__ or ""


def _flag_value(args: List[str], flag: str) -> Optional[str]:
    if flag in args:
        i = args.index(flag)
        if i + 1 < len(args):
            value = args[i + 1]
            del args[i:i + 2]
            return value
    return None


def default_out(name: str) -> str:
    """Where `render` writes a pipeline's scripts: sbatch/ultra_pipeline, sbatch/tiny_pipeline."""
    return f"sbatch/{name if name.endswith('pipeline') else name + '_pipeline'}"


def _pipeline_dir(spec, cli) -> Path:
    return Path(cli.dir or spec.dir).resolve()


def launch(args: List[str]) -> int:
    """+pipeline=NAME ... (from hpc_rl.launch): check, then submit or (launcher=dry_run) plan."""
    from .compose import check_all
    from .render import plan_table
    from .report import render_status
    from .submit import run, wait

    args = list(args)
    wait_flag = "--wait" in args
    args = [a for a in args if a != "--wait"]
    unknown = [a for a in args if a.startswith("--")]
    if unknown:
        print(f"hpc_rl: unknown option(s) {unknown}\n\n{USAGE}", file=sys.stderr)
        return 2
    cli = split_args(args)
    try:
        if not cli.pipeline:
            from hpc_rl.config.errors import Violation

            raise ConfigError([Violation("pipeline", None, "no pipeline chosen", f"add +pipeline=NAME, one of {available()}")])
        spec = load_spec(cli.pipeline)
        pdir = _pipeline_dir(spec, cli)
        checks = check_all(spec, cli, pdir)
        if any(c.cfg is not None and c.cfg.launcher.name == "dry_run" for c in checks):
            print(f"pipeline {spec.name}: {len(checks)} stages checked (launcher=dry_run: nothing submitted)")
            print(plan_table(spec, checks))
            from hpc_rl.config.memory_fit import memory_misfits
            from hpc_rl.config.support import unsupported

            for c in checks:  # as the dry run of one recipe lists them: launcher=slurm would refuse these
                cannot = unsupported(c.cfg) if c.cfg is not None else []
                if cannot:
                    print(f"  {c.name}: {len(cannot)} settings this version cannot run yet ({', '.join(v.key for v in cannot[:3])}"
                          f"{', ...' if len(cannot) > 3 else ''}); launcher=slurm refuses them")
                unfit = memory_misfits(c.cfg) if c.cfg is not None else []
                if unfit:
                    print(f"  {c.name}: {len(unfit)} roles do not fit their GPUs' memory "
                          f"({'; '.join(f'{v.key} needs {v.value}' for v in unfit)}); launcher=slurm refuses them")
            print(f"  hand submission: python -m hpc_rl.pipeline render {spec.name} --out {default_out(spec.name)}")
            return 0
        print(f"pipeline {spec.name}: {len(checks)} stages checked; submitting into {pdir}")
        rec = run(spec, cli, pdir, ["+pipeline=" + spec.name, *args])
    except ConfigError as err:
        print(f"hpc_rl: {err.render()}", file=sys.stderr)
        return err.exit_code
    print(f"  status:  python -m hpc_rl.pipeline status {pdir}\n  cancel:  python -m hpc_rl.pipeline cancel {pdir}")
    if not wait_flag:
        return 0
    rec = wait(pdir)
    print(render_status(rec))
    return 0 if all(s.state == "COMPLETED" for s in rec.stages.values()) else 1


def main(argv: Optional[List[str]] = None) -> int:
    from .report import render_status
    from .state import PipelineRecord, refresh

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + f"\npipelines: {', '.join(available())}")
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "run":
        if not rest:
            print(USAGE, file=sys.stderr)
            return 2
        return launch([f"+pipeline={rest[0]}", *rest[1:]])
    if cmd in ("status", "cancel"):
        if len(rest) != 1:
            print(USAGE, file=sys.stderr)
            return 2
        pdir = Path(rest[0])
        if cmd == "cancel":
            from .submit import cancel

            rec = cancel(pdir)
            print(render_status(refresh(rec)))
            return 0
        rec = PipelineRecord.load(pdir)
        if rec is None:
            print(f"hpc_rl: {pdir} holds no pipeline.json", file=sys.stderr)
            return 2
        refresh(rec)
        rec.save()
        print(render_status(rec))
        return 0
    if cmd == "render":
        from .compose import check_all
        from .render import plan_doc, render_files, write_files

        out = _flag_value(rest, "--out")
        plan_out = _flag_value(rest, "--plan")
        if not rest:
            print(USAGE, file=sys.stderr)
            return 2
        cli = split_args([f"+pipeline={rest[0]}", *rest[1:]])
        try:
            spec = load_spec(rest[0])
            pdir = Path(cli.dir or spec.dir)
            files = render_files(spec, cli, pdir)
            out_dir = Path(out or default_out(spec.name))
            for p in write_files(files, out_dir):
                print(f"wrote {p}")
            if plan_out:
                Path(plan_out).write_text(plan_doc(spec, check_all(spec, cli, pdir, launcher_checks=False)))
                print(f"wrote {plan_out}")
        except ConfigError as err:
            print(f"hpc_rl: {err.render()}", file=sys.stderr)
            return err.exit_code
        return 0
    print(f"hpc_rl: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2
