"""``aoe-evaluate``: the paper's downstream evaluation (AoE, arXiv 2501.13074, Table 2) of a
Hugging Face model, offline.

    aoe-evaluate fetch-data --data-dir eval_data          # once, with network
    aoe-evaluate MODEL_DIR --data-dir eval_data --output runs/eval/aoe

ARC-E, PIQA, SIQA, WINO, HELLA zero-shot; MNLI, QNLI, SST2, MRPC, QQP three-shot (fixed by the
protocol), scored with lm-eval's own task definitions on local JSONL data
(DATA_DIR/<task>/<split>.jsonl). Writes OUTPUT/results.json, results.md (Table 2 layout) and
samples/<task>.jsonl (per-example correctness, for aoe-mcnemar).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

from aoe_megatron.evaluation.data import MissingDataError, fetch_data
from aoe_megatron.evaluation.harness import (EvalConfig, EvaluationError, force_offline,
                                             markdown_table, run_evaluation)
from aoe_megatron.evaluation.protocol import PAPER_TASKS, ProtocolError, resolve_tasks
from aoe_megatron.runtime.command_line import CommandParser

TASK_HELP = ("tasks to {} (lm-eval names; siqa is accepted for social_iqa) (default: the "
             "paper's ten: " + " ".join(t.name for t in PAPER_TASKS) + ")")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def parser() -> argparse.ArgumentParser:
    """The evaluation's parser (``aoe-evaluate MODEL ...``); fetch_parser() is fetch-data's."""
    ap = CommandParser(
        prog="aoe-evaluate", allow_abbrev=False,
        description="Score a Hugging Face model folder offline on the AoE paper's ten downstream "
                    "tasks (Table 2 protocol, lm-eval task definitions) and write results.json, "
                    "results.md and per-example samples.",
        epilog="`aoe-evaluate fetch-data --help`: downloading the task data (needs network).")
    ap.add_argument("model", type=Path,
                    help="Hugging Face model folder to evaluate (config.json, weights, tokenizer)")
    ap.add_argument("--data-dir", type=Path, required=True,
                    help="folder of the task data, DIR/<task>/<split>.jsonl; required")
    ap.add_argument("--output", type=Path, required=True,
                    help="output directory for results and samples (must be new or empty); "
                         "required")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the outputs of an earlier run in --output instead of refusing "
                         "(default: off)")
    ap.add_argument("--tasks", nargs="+", help=TASK_HELP.format("evaluate"))
    ap.add_argument("--device",
                    help="torch device to run on: cpu, cuda, cuda:N (default: cuda if available, "
                         "else cpu)")
    ap.add_argument("--batch-size", type=_positive_int, default=50,
                    help="examples per forward pass (default: %(default)s, as in the paper)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="dtype the model is loaded in (default: %(default)s)")
    ap.add_argument("--limit", type=_positive_int,
                    help="evaluate only the first N examples per task, for smoke runs; the "
                         "results are then incomplete (default: all)")
    ap.add_argument("--seed", type=int, default=1234,
                    help="seed of python/numpy/torch and of the few-shot sampler "
                         "(default: %(default)s)")
    ap.add_argument("--bootstrap-iters", type=_positive_int, default=1000,
                    help="bootstrap draws for the stderr of f1 (MRPC, QQP; not in the table); "
                         "acc's stderr is closed-form (default: %(default)s)")
    ap.add_argument("--datasets-cache", type=Path,
                    help="folder for the Arrow cache of the task data (default: Hugging Face "
                         "datasets' cache)")
    ap.add_argument("--num-fewshot", type=int, help=argparse.SUPPRESS)  # refused with a reason
    return ap


def fetch_parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-evaluate fetch-data", allow_abbrev=False,
        description="Download the splits the protocol needs (Hugging Face Hub, via `datasets`) "
                    "into DATA_DIR/<task>/<split>.jsonl. Needs network access.")
    ap.add_argument("--data-dir", type=Path, required=True,
                    help="folder to write DIR/<task>/<split>.jsonl into; required")
    ap.add_argument("--tasks", nargs="+", help=TASK_HELP.format("download data for"))
    ap.add_argument("--overwrite", action="store_true",
                    help="download files that exist again instead of keeping them (default: off)")
    return ap


def parse_eval_args(argv):
    ap = parser()
    args = ap.parse_args(argv)
    if args.num_fewshot is not None:
        shots = ", ".join(f"{t.name} {t.num_fewshot}" for t in PAPER_TASKS)
        ap.error(f"--num-fewshot cannot be set: the protocol fixes the shots per task ({shots})")
    return args


def parse_fetch_args(argv):
    return fetch_parser().parse_args(argv)


#: What the ``eval`` extra installs that these commands import.
EVAL_EXTRA = ("lm_eval",)


def missing_eval_extra() -> str | None:
    """The sentence for a missing ``eval`` extra (lm-eval is an optional dependency), or None."""
    missing = [name for name in EVAL_EXTRA if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"aoe-evaluate needs the eval extra ({', '.join(missing)} is not installed): "
            f'pip install "aoe-megatron[eval]" (from a checkout: pip install ".[eval]", or the '
            f"pinned versions: pip install -r requirements-eval.txt)")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def fetch_main(argv) -> int:
    args = parse_fetch_args(argv)
    _setup_logging()

    try:
        written = fetch_data(args.data_dir, resolve_tasks(args.tasks), overwrite=args.overwrite)
    except ProtocolError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{len(written)} file(s) written under {args.data_dir}")
    return 0


def eval_main(argv) -> int:
    args = parse_eval_args(argv)

    force_offline()  # before anything imports huggingface_hub / datasets
    _setup_logging()
    from lm_eval.utils import setup_logging

    setup_logging(logging.INFO)  # lm-eval's progress

    cfg = EvalConfig(
        model=args.model, data_dir=args.data_dir, output=args.output,
        tasks=tuple(args.tasks) if args.tasks else None, device=args.device,
        batch_size=args.batch_size, dtype=args.dtype, limit=args.limit, seed=args.seed,
        overwrite=args.overwrite, bootstrap_iters=args.bootstrap_iters,
        datasets_cache=args.datasets_cache)
    try:
        run = run_evaluation(cfg)
    except (EvaluationError, MissingDataError, ProtocolError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(markdown_table(run.summary))
    print(f"wrote {args.output}/results.json, results.md, samples/")
    return 0


def main(argv=None) -> int:
    """0 done, 1 a failed evaluation or download, 2 bad input or no ``eval`` extra."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fetch = bool(argv) and argv[0] == "fetch-data"
    parse_fetch_args(argv[1:]) if fetch else parse_eval_args(argv)  # --help needs no lm-eval
    if (missing := missing_eval_extra()) is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    return fetch_main(argv[1:]) if fetch else eval_main(argv)


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
