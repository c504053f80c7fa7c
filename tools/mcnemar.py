#!/usr/bin/env python
"""McNemar's test of two evaluation runs' per-example outcomes, pooled over their common tasks.

    python tools/mcnemar.py runs/eval/aoe runs/eval/moe [--json]

A_DIR / B_DIR: output directories of tools/evaluate.py (or their samples/ folders). Examples are
paired by (task, doc_id); the runs must have scored the same examples of each common task. Prints
the 2x2 table, b, c, n and the exact (default), continuity-corrected and plain chi-square p-values.
"""

import argparse
import json
import sys

from aoe_megatron.evaluation.mcnemar import TESTS, PairingError, compare_runs, format_report


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="run A (e.g. AoE): evaluate.py output dir, samples/ dir or .jsonl")
    ap.add_argument("b", help="run B (e.g. the MoE baseline)")
    ap.add_argument("--tasks", nargs="+", help="restrict to these tasks (default: all in common)")
    ap.add_argument("--test", choices=TESTS, default="exact",
                    help="test behind the reported p-value (default: exact; all three are shown; "
                         "auto: exact if b + c < 25, else chi2-cc)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = compare_runs(args.a, args.b, tasks=args.tasks, test=args.test)
    except PairingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
