"""``aoe-bench``: benchmark the AoE MoE layer against megatron-core's stock MoE layer (issue #11;
`make bench`).

    aoe-bench                      # full run: layer, model and EP=2 levels
    aoe-bench --quick --out /tmp/b # tiny shapes, 2 reps: seconds
    aoe-bench --only layer --shapes 732m,fine64 --reps 7
    aoe-bench --only layer --shapes 4b --arms aoe,aoe-d_wide64,aoe-d_wide64-nearest
    aoe-bench --device cuda --only model --models 732m-4l --model-archs moe,aoe,aoe-loop

Writes DIR/results.json (every number) and DIR/README.md (the tables, the command, the machine).
Timings are medians over reps with the arms alternating rep by rep after one warm-up each.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from aoe_megatron.bench.names import (ARCHS, ARM_FIELDS, DEFAULT_ARCHS, GPU_ONLY_MODELS, MODELS,
                                      QUICK_MODELS)
from aoe_megatron.runtime.command_line import CommandParser
from aoe_megatron.runtime.compat import quiet_cpu_fallback_warnings, transformer_engine_usable

PROG = "aoe-bench"
LEVELS = ("layer", "model", "ep")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _hide_cuda_for_cpu(argv) -> None:
    """--device cpu: hide CUDA before anything imports torch (megatron's CPU patches apply only
    without CUDA)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--device")
    if pre.parse_known_args(argv)[0].device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _check_names(ap, flag: str, names, known, quick_note: str = "") -> None:
    bad = [n for n in names or () if n not in known]
    if bad or names == []:
        ap.error(f"{flag}: unknown {bad or 'nothing'}; {quick_note}choose from {','.join(known)}")


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark the AoE MoE layer against megatron-core's stock MoE layer (layer,\n"
                    "model and EP=2 levels): time and memory per arm, written to OUT/results.json\n"
                    "and OUT/README.md.",
        epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes and 2 reps, to check the tool in seconds (default: off)")
    ap.add_argument("--out", type=Path, default=Path("bench"),
                    help="output folder for results.json and README.md, relative to the current "
                         "directory (default: %(default)s)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where to run; auto: cuda when available, else cpu (default: %(default)s)")
    ap.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                    help="compute dtype; auto: fp32 on CPU, bf16 on CUDA (default: %(default)s)")
    ap.add_argument("--reps", type=int,
                    help="timed reps per arm at the layer and EP levels (default: 5, the 4b shape "
                         "3; 2 with --quick)")
    ap.add_argument("--model-reps", type=int,
                    help="timed training steps per arch at the model level (default: 3; 2 with "
                         "--quick)")
    ap.add_argument("--only", type=_csv, default=list(LEVELS),
                    help=f"comma-separated levels to run, of {','.join(LEVELS)} (default: all)")
    ap.add_argument("--shapes", type=_csv,
                    help="comma-separated layer shapes to run (default: 732m,4b,fine64; with "
                         "--quick: tiny8,tiny64); run only when named: 732m-ep8,4b-ep8 (with "
                         "--quick: tiny8-ep8), the block as one rank of an EP=8 job computes it")
    ap.add_argument("--arms", type=_csv,
                    help=f"comma-separated layer arms, of {','.join(ARM_FIELDS)}; moe, the "
                         "baseline, always runs, and an arm that does not apply at a shape is "
                         "dropped there (default: all)")
    ap.add_argument("--models", type=_csv,
                    help=f"comma-separated model-level entries, of {','.join(MODELS)} (default: "
                         f"all, but on CPU not the GPU-only {','.join(GPU_ONLY_MODELS)}; with "
                         f"--quick: {','.join(QUICK_MODELS)})")
    ap.add_argument("--model-archs", type=_csv, default=list(DEFAULT_ARCHS),
                    help=f"comma-separated model-level archs, of {','.join(ARCHS)}; moe, every "
                         f"ratio's baseline, must be one (default: {','.join(DEFAULT_ARCHS)})")
    ap.add_argument("--te", choices=("auto", "on", "off"), default="auto",
                    help="megatron-core's TransformerEngine spec (grouped GEMM) for MoE; auto: on "
                         "with CUDA and a working TE installed (default: %(default)s)")
    return ap


def parse_args(argv):
    _hide_cuda_for_cpu(argv)

    ap = parser()
    args = ap.parse_args(argv)
    bad = sorted(set(args.only) - set(LEVELS))
    if bad or not args.only:
        ap.error(f"--only takes a comma-separated list of {', '.join(LEVELS)}; got {bad or 'nothing'}")
    args.reps_explicit = args.reps is not None
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.model_reps is None:
        args.model_reps = 2 if args.quick else 3
    for flag, value in (("--reps", args.reps), ("--model-reps", args.model_reps)):
        if value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    _check_names(ap, "--arms", args.arms, list(ARM_FIELDS))
    _check_names(ap, "--models", args.models, list(QUICK_MODELS if args.quick else MODELS),
                 "with --quick " if args.quick else "")
    _check_names(ap, "--model-archs", args.model_archs, list(ARCHS))
    if "moe" not in args.model_archs:
        ap.error(f"--model-archs must include moe (every ratio's baseline); got "
                 f"{','.join(args.model_archs)}")
    return ap, args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    start = time.perf_counter()
    ap, args = parse_args(argv)

    import torch

    quiet_cpu_fallback_warnings()
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        ap.error("--device cuda: torch sees no CUDA device here (use --device cpu)")
    device = "cuda" if args.device == "auto" and cuda else ("cpu" if args.device == "auto" else args.device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    have_te = device == "cuda" and transformer_engine_usable()  # imports and runs
    if args.te == "on" and not have_te:
        ap.error("--te on needs CUDA and a TransformerEngine that imports and runs there "
                 "(aoe_megatron.runtime.compat.transformer_engine_status says why not)")

    from aoe_megatron.bench import arms, driver, report  # deferred: torch loads after --help

    table = arms.QUICK_SHAPES if args.quick else arms.SHAPES
    if args.shapes and set(args.shapes) - set(table):
        ap.error(f"--shapes: unknown {sorted(set(args.shapes) - set(table))}; "
                 f"{'with --quick ' if args.quick else ''}choose from {','.join(table)}")

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    bench = driver.BenchRun(
        command=" ".join([PROG, *(shlex.quote(a) for a in argv)]), quick=args.quick,
        device=device, dtype_name=dtype_name, use_te=have_te if args.te == "auto" else args.te == "on",
        only=tuple(args.only), reps=args.reps, reps_explicit=args.reps_explicit,
        model_reps=args.model_reps, shapes=args.shapes, arms=args.arms, models=args.models,
        model_archs=args.model_archs)
    results = driver.run(bench, log=log)
    json_path, md_path = report.write(results, args.out)
    print()
    print(report.markdown(results))
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
