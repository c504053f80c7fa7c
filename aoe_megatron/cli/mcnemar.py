"""``aoe-mcnemar``: McNemar's test of two evaluation runs' per-example outcomes, pooled over their
common tasks.

    aoe-mcnemar runs/eval/aoe runs/eval/moe [--json]

A / B: output directories of aoe-evaluate (or their samples/ folders). Examples are paired by
(task, doc_id); the runs must have scored the same examples of each common task. Prints the 2x2
table, b, c, n and the exact (default), continuity-corrected and plain chi-square p-values.
"""

from __future__ import annotations

import argparse
import json
import sys

from aoe_megatron.evaluation.mcnemar import TESTS, PairingError, compare_runs, format_report
from aoe_megatron.runtime.command_line import CommandParser


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-mcnemar", allow_abbrev=False,
        description="McNemar's test of two aoe-evaluate runs' per-example outcomes, paired by "
                    "(task, example) and pooled over their common tasks.")
    ap.add_argument("a", help="run A (e.g. AoE): an aoe-evaluate output dir, its samples/ dir or "
                              "a samples .jsonl")
    ap.add_argument("b", help="run B (e.g. the MoE baseline), in the same forms as A")
    ap.add_argument("--tasks", nargs="+",
                    help="restrict the comparison to these tasks (default: all in common)")
    ap.add_argument("--test", choices=TESTS, default="exact",
                    help="test behind the reported p-value; all three are shown; auto: exact if "
                         "b + c < 25, else chi2-cc (default: %(default)s)")
    ap.add_argument("--json", action="store_true",
                    help="print the report as JSON instead of a table (default: off)")
    return ap


def parse_args(argv=None):
    return parser().parse_args(argv)


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
