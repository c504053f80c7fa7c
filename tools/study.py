#!/usr/bin/env python
"""The evidence study: does norm-based self-selection matter? Trains every arm of a study spec
(run/studies/*.yaml) with every seed through the real entry point, evaluates each checkpoint on
held-out text, runs the norm probe, and writes studies/<name>/report.md, results.json and plots.

    python tools/study.py                    # run/studies/default.yaml (make study)
    python tools/study.py default --quick    # the same study, shrunk to minutes (the test's mode)
    python tools/study.py default --report-only   # rewrite the report from finished runs

Finished runs are reused and interrupted ones resume from their last checkpoint: run the same
command again after an interrupt. Logs: studies/<name>/runs/<arm>/seed<k>/train.log.
"""

import argparse
import sys
import time
from pathlib import Path

from aoe_megatron.study.runner import StudyError, run_study, table1_probe
from aoe_megatron.study.spec import SpecError, load_study

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("spec", nargs="?", default="default",
                    help="a study under run/studies/ (name) or a YAML path (default: default)")
    ap.add_argument("--quick", action="store_true",
                    help="the spec's quick: section (few arms, seeds and steps; minutes)")
    ap.add_argument("--out", type=Path, help="output folder (default: studies/<name>[-quick])")
    ap.add_argument("--report-only", action="store_true",
                    help="write the report from the runs already finished; train nothing")
    args = ap.parse_args(argv)
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
    out = args.out or ROOT / "studies" / study.name
    out.mkdir(parents=True, exist_ok=True)
    command = "python tools/study.py " + " ".join(argv if argv is not None else sys.argv[1:])
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
    raise SystemExit(main())
