"""``aoe-convert-to-hf``: a training checkpoint (any EP size, ZeRO-1/2) to a Hugging Face folder.

    aoe-convert-to-hf --checkpoint runs/demo/checkpoints --output hf/aoe-tiny

AoE models load with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True); stock
MoE checkpoints become transformers' own Mixtral (no remote code for the model). The tokenizer is
the preprocessing tokenizer with the training data's BOS policy, read from the data manifest
(the run's --data, recorded in the checkpoint; --data or --manifest when run elsewhere).
The checkpoint is verified against its manifest first: a damaged one is refused (exit 2) and no
output folder is made; --no-verify exports it anyway.
"""

from __future__ import annotations

import argparse
import sys

from aoe_megatron.checkpoint.integrity import CheckpointDamaged
from aoe_megatron.runtime.command_line import CommandParser


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    text = text.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-convert-to-hf", allow_abbrev=False,
        description="Export a training checkpoint (any expert-parallel size, ZeRO-1/2) to a "
                    "Hugging Face folder: AoE models with their remote code, stock MoE models as "
                    "transformers' Mixtral.")
    ap.add_argument("--checkpoint", required=True,
                    help="the checkpoint to export: a step_N directory, or a --ckpt-dir (its "
                         "latest checkpoint); required")
    ap.add_argument("--output", required=True,
                    help="the Hugging Face folder to create; required")
    ap.add_argument("--data",
                    help="the training run's data config YAML, whose manifest gives the tokenizer "
                         "(default: the path recorded in the checkpoint)")
    ap.add_argument("--manifest",
                    help="a preprocessing .manifest.json to take the tokenizer from instead of "
                         "--data (default: none)")
    ap.add_argument("--tokenizer-model",
                    help="the sentencepiece model to ship (default: the manifest's path)")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                    help="dtype of the exported weights (default: the checkpoint's)")
    ap.add_argument("--max-shard-size", default="5GB",
                    help="largest safetensors shard, in bytes or with a KB/MB/GB suffix "
                         "(default: %(default)s)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing --output once the new one is complete instead of "
                         "refusing (default: off)")
    ap.add_argument("--no-verify", action="store_true",
                    help="export without first checking the checkpoint's files against its "
                         "manifest (sha256 of every file); a damaged checkpoint is otherwise "
                         "refused and nothing is written (default: off)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)  # before any import of torch: --help answers at once
    from aoe_megatron.hf.checkpoint_io import ConversionError  # deferred: torch loads after --help
    from aoe_megatron.hf.convert import export_to_hf  # deferred: torch loads after --help

    try:
        export_to_hf(args.checkpoint, args.output, data=args.data, manifest=args.manifest,
                     tokenizer_model=args.tokenizer_model, dtype=args.dtype,
                     max_shard_bytes=_size(args.max_shard_size), overwrite=args.overwrite,
                     verify=not args.no_verify)
    except (ConversionError, CheckpointDamaged) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
