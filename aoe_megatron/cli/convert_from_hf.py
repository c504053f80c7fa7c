"""``aoe-convert-from-hf``: a Hugging Face folder (exported AoE, or Mixtral) back to a training
checkpoint.

    aoe-convert-from-hf --hf hf/aoe-tiny --output runs/from-hf
    python -m aoe_megatron.train --preset tiny ... --load-weights runs/from-hf/step_00000300

The checkpoint holds the model weights (no optimizer state): continue pretraining with
--load-weights at any expert-parallel size. Checkpoint -> HF -> checkpoint restores every tensor.
"""

from __future__ import annotations

import argparse
import sys

from aoe_megatron.runtime.command_line import CommandParser


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-convert-from-hf", allow_abbrev=False,
        description="Import a Hugging Face folder (an exported AoE model, or Mixtral) as a "
                    "training checkpoint holding the weights only, for --load-weights.")
    ap.add_argument("--hf", required=True, help="the Hugging Face model folder to import; required")
    ap.add_argument("--output", required=True,
                    help="the checkpoint directory to create (it gets OUTPUT/step_N); required")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing --output once the new one is complete instead of "
                         "refusing (default: off)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)  # before any import of torch: --help answers at once
    from aoe_megatron.hf.checkpoint_io import ConversionError  # deferred: torch loads after --help
    from aoe_megatron.hf.convert import import_from_hf  # deferred: torch loads after --help

    try:
        import_from_hf(args.hf, args.output, overwrite=args.overwrite)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
