#!/usr/bin/env python
"""A training checkpoint (any EP size, ZeRO-1/2) to a Hugging Face folder.

    python tools/convert_to_hf.py --checkpoint runs/demo/checkpoints --output hf/aoe-tiny

AoE models load with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True); stock
MoE checkpoints become transformers' own Mixtral (no remote code for the model). The tokenizer is
the preprocessing tokenizer with the training data's BOS policy, read from the data manifest
(the run's --data, recorded in the checkpoint; --data or --manifest when run elsewhere).
"""

import argparse
import sys

from aoe_megatron.hf.checkpoint_io import ConversionError


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    text = text.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a step_N directory, or a --ckpt-dir (its latest)")
    ap.add_argument("--output", required=True, help="the Hugging Face folder to create")
    ap.add_argument("--data", help="the training run's data config YAML (default: as recorded)")
    ap.add_argument("--manifest", help="a preprocessing .manifest.json instead of --data")
    ap.add_argument("--tokenizer-model", help="the sentencepiece model (default: the manifest's path)")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: the checkpoint's")
    ap.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    ap.add_argument("--overwrite", action="store_true", help="replace --output once the new one is complete")
    args = ap.parse_args(argv)
    from aoe_megatron.hf.convert import export_to_hf

    try:
        export_to_hf(args.checkpoint, args.output, data=args.data, manifest=args.manifest,
                     tokenizer_model=args.tokenizer_model, dtype=args.dtype,
                     max_shard_bytes=_size(args.max_shard_size), overwrite=args.overwrite)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
