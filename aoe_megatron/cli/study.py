"""``aoe-study``: the evidence study: does norm-based self-selection matter? Trains every arm of a
study spec (a packaged study, or a YAML file) with every seed through the real entry point,
evaluates each checkpoint on held-out text, runs the norm probe, and writes
studies/<name>/report.md, results.json and plots.

    aoe-study                          # the packaged `default` study (make study)
    aoe-study default --quick          # the same study, shrunk to minutes (the test's mode)
    aoe-study default --report-only    # rewrite the report from finished runs
    aoe-study v2 --plan                # a staged study: what is done, to do, waiting
    aoe-study v2 --budget-minutes 150  # start only the runs that end inside 150 minutes
    aoe-study v2 --jobs 2              # two runs at once, each on its share of the cores
    aoe-study v2 --stage compare --arms moe,aoe --seeds 1

Finished runs are reused and interrupted ones resume from their last checkpoint: run the same
command again after an interrupt. Logs: studies/<name>/runs/<arm>/seed<k>/train.log.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from aoe_megatron.runtime import resources
from aoe_megatron.runtime.command_line import CommandParser

PROG = "aoe-study"


def parser() -> argparse.ArgumentParser:
    known = ", ".join(resources.names("studies")) or "none installed"
    ap = CommandParser(
        prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train every arm x seed of a study spec, evaluate each checkpoint on held-out\n"
                    "text, run the norm probes, and write report.md, results.json and plots.",
        epilog="\n".join(__doc__.splitlines()[4:]))
    ap.add_argument("spec", nargs="?", default="default",
                    help=f"the study to run: a packaged study's name (one of: {known}) or a "
                         "YAML file (default: %(default)s)")
    ap.add_argument("--quick", action="store_true",
                    help="run the spec's quick: section instead (few arms, seeds and steps; "
                         "minutes) (default: off)")
    ap.add_argument("--out", type=Path,
                    help="output folder for runs, report and plots (default: studies/<name> in "
                         "the current directory, <name> ending in -quick with --quick)")
    ap.add_argument("--report-only", action="store_true",
                    help="write the report from the runs already finished and train nothing "
                         "(default: off)")
    staged = ap.add_argument_group("a staged study (one with stages:, e.g. v2)")
    staged.add_argument("--plan", action="store_true",
                        help="print the plan (runs done, to do, waiting, their estimated "
                             "minutes, the best settings so far) and run nothing (default: off)")
    staged.add_argument("--stage", type=_names, default=(), metavar="NAMES",
                        help="run only these stages, comma-separated (default: every stage)")
    staged.add_argument("--arms", type=_names, default=(), metavar="NAMES",
                        help="run only these arms, comma-separated (default: every arm)")
    staged.add_argument("--seeds", type=_seeds, default=(), metavar="SEEDS",
                        help="run only these seeds, comma-separated (default: every seed)")
    staged.add_argument("--budget-minutes", type=float, metavar="MIN",
                        help="start only runs whose estimated duration ends inside MIN minutes "
                             "from now; the report then covers what has finished (default: no "
                             "limit)")
    staged.add_argument("--jobs", type=_positive, default=1, metavar="N",
                        help="train up to N runs at once, each process with its share of the "
                             "cores (on 2 cores, two one-thread runs trained 1.7x the tokens a "
                             "second of one two-thread run, measured 2026-12-07); the budget's "
                             "estimates come from the durations of finished runs, so the first "
                             "part at a new N may overrun a little (default: 1)")
    return ap


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of runs, 1 or more: {text!r}")
    return value


def _names(text: str) -> tuple:
    return tuple(n for n in text.split(",") if n)


def _seeds(text: str) -> tuple:
    try:
        return tuple(int(n) for n in text.split(",") if n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are integers, comma-separated: {text!r}") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    from aoe_megatron.study.runner import (  # deferred: torch loads after --help
        run_study, table1_probe)
    from aoe_megatron.study.spec import SpecError, load_study  # deferred: torch loads after --help

    try:
        study = load_study(args.spec, quick=args.quick)
    except (SpecError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    data = Path(study.data)
    if not data.is_file():
        print(f"error: the study's data config {data} does not exist (make study-data builds the "
              f"study corpus)", file=sys.stderr)
        return 2
    staged_flags = (args.plan or args.stage or args.arms or args.seeds or args.jobs != 1
                    or args.budget_minutes is not None)
    if staged_flags and not study.stages:
        print(f"error: --plan, --stage, --arms, --seeds, --budget-minutes and --jobs apply to a staged "
              f"study; {study.name} has no stages:", file=sys.stderr)
        return 2
    if study.stages:
        bad = _unknown(args, study)
        if bad:
            print(f"error: {bad}", file=sys.stderr)
            return 2
    out = args.out or Path("studies") / study.name
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join([PROG, *argv])
    if study.stages:
        return _staged(study, out, args, command)
    print(f"study {study.name}: {len(study.arms)} arms x {len(study.seeds)} seeds -> {out}", flush=True)
    t0 = time.perf_counter()

    def one_stage() -> int:
        if args.report_only:
            from aoe_megatron.study.runner import (  # deferred: torch loads after --help
                collect_finished)

            results = collect_finished(study, out)
        else:
            results = run_study(study, out, echo=lambda line: print(line, flush=True))
            table1_probe(study, out, echo=lambda line: print(line, flush=True))
        from aoe_megatron.study.report import write_report  # deferred: torch loads after --help

        write_report(study, out, results, wall_seconds=time.perf_counter() - t0, command=command.strip())
        print(f"report: {out / 'report.md'} (results.json, *.png beside it)", flush=True)
        return 0

    return _guarded(one_stage)


def _guarded(work) -> int:
    """``work()``'s exit code; a failed run or missing file: 1; an interrupt: 130, saying how to
    resume."""
    from aoe_megatron.study.runner import StudyError  # deferred: torch loads after --help

    try:
        return work()
    except (StudyError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume (finished runs are kept)",
              file=sys.stderr)
        return 130


def _unknown(args, study) -> str:
    stages, arms = {s.name for s in study.stages}, {a.name for a in study.arms}
    for given, known, what in ((args.stage, stages, "stages"), (args.arms, arms, "arms")):
        if set(given) - known:
            return f"unknown {what} {sorted(set(given) - known)} (the study's: {sorted(known)})"
    return ""


def _staged(study, out: Path, args, command: str) -> int:
    from aoe_megatron.study import plan as planning  # deferred: torch loads after --help
    from aoe_megatron.study.staged import (  # deferred: torch loads after --help
        collect_staged, describe, run_staged)

    echo = lambda line: print(line, flush=True)  # noqa: E731
    t0 = time.perf_counter()

    def staged() -> int:
        if args.plan:
            describe(study, out, planning.make_plan(study, out), echo=echo)
            return 0
        if not args.report_only:
            run_staged(study, out, stages=args.stage, arms=args.arms, seeds=args.seeds,
                       budget_minutes=args.budget_minutes, jobs=args.jobs, echo=echo)
        from aoe_megatron.study.report_staged import (  # deferred: torch loads after --help
            write_staged_report)

        results = collect_staged(study, out)
        write_staged_report(study, out, results, wall_seconds=time.perf_counter() - t0,
                            command=command.strip())
        missing = len(results["missing"])
        echo(f"report: {out / 'report.md'}" + (f" (partial: {missing} runs missing, listed there)"
                                               if missing else ""))
        return 0

    return _guarded(staged)


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
