#!/usr/bin/env python
"""A Hugging Face folder (exported AoE, or Mixtral) back to a training checkpoint.

    python tools/convert_from_hf.py --hf hf/aoe-tiny --output runs/from-hf
    python -m aoe_megatron.train --preset tiny ... --load-weights runs/from-hf/step_00000300

The checkpoint holds the model weights (no optimizer state): continue pretraining with
--load-weights at any expert-parallel size. Checkpoint -> HF -> checkpoint restores every tensor.
"""

import argparse
import sys

from aoe_megatron.hf.checkpoint_io import ConversionError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, help="the Hugging Face model folder")
    ap.add_argument("--output", required=True, help="the checkpoint directory to create")
    ap.add_argument("--overwrite", action="store_true", help="replace --output once the new one is complete")
    args = ap.parse_args(argv)
    from aoe_megatron.hf.convert import import_from_hf

    try:
        import_from_hf(args.hf, args.output, overwrite=args.overwrite)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
