"""``aoe-study``: the evidence study: does norm-based self-selection matter? Trains every arm of a
study spec (a packaged study, or a YAML file) with every seed through the real entry point,
evaluates each checkpoint on held-out text, runs the norm probe, and writes
studies/<name>/report.md, results.json and plots.

    aoe-study                          # the packaged `default` study (make study)
    aoe-study default --quick          # the same study, shrunk to minutes (the test's mode)
    aoe-study default --report-only    # rewrite the report from finished runs

Finished runs are reused and interrupted ones resume from their last checkpoint: run the same
command again after an interrupt. Logs: studies/<name>/runs/<arm>/seed<k>/train.log.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

PROG = "aoe-study"


def parser() -> argparse.ArgumentParser:
    from aoe_megatron.runtime import resources

    known = ", ".join(resources.names("studies")) or "none installed"
    ap = argparse.ArgumentParser(
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
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    from aoe_megatron.study.runner import StudyError, run_study, table1_probe
    from aoe_megatron.study.spec import SpecError, load_study

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
    out = args.out or Path("studies") / study.name
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join([PROG, *argv])
    print(f"study {study.name}: {len(study.arms)} arms x {len(study.seeds)} seeds -> {out}", flush=True)
    t0 = time.perf_counter()
    try:
        if args.report_only:
            from aoe_megatron.study.runner import collect_finished

            results = collect_finished(study, out)
        else:
            results = run_study(study, out, echo=lambda line: print(line, flush=True))
            table1_probe(study, out, echo=lambda line: print(line, flush=True))
        from aoe_megatron.study.report import write_report

        write_report(study, out, results, wall_seconds=time.perf_counter() - t0, command=command.strip())
    except (StudyError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume (finished runs are kept)",
              file=sys.stderr)
        return 130
    print(f"report: {out / 'report.md'} (results.json, *.png beside it)", flush=True)
    return 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
