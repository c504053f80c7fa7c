"""``aoe-verify-data``: check preprocessed datasets against their manifests, every byte: the
sizes, the ``.idx`` against the ``.bin``, and the sha256 of both files recorded while
preprocessing wrote them. Meant for use after copying a corpus to cluster storage; a training
launch checks only the sizes and the index (it reads a few bytes a file).

``aoe-verify-data --adopt PREFIX ... [--tokenizer-model M]`` adopts datasets tokenized by
Megatron-LM (no manifest): it checks each and writes the manifest aoe-preprocess would have
written (``aoe_megatron.data.adopt``), after which they verify and train like any other."""

from __future__ import annotations

import argparse
import os
import sys
import time

from aoe_megatron.data.adopt import adopt
from aoe_megatron.data.config import DataConfig
from aoe_megatron.data.integrity import verify_dataset
from aoe_megatron.data.manifest import read_manifest
from aoe_megatron.data.tokenizer import Tokenizer
from aoe_megatron.runtime.command_line import CommandParser


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-verify-data", allow_abbrev=False,
        description="Verify preprocessed datasets against their manifests: file sizes, the .idx "
                    "against the .bin, and the sha256 of both (reads every byte). Exit status 0: "
                    "all verify; 1: damage found (each damaged file named); 2: usage error. With "
                    "--adopt, write the manifests of datasets tokenized by Megatron-LM instead.")
    ap.add_argument("targets", nargs="+", metavar="DATA_YAML|PREFIX",
                    help="data config YAMLs (every prefix of their blends) or dataset prefixes "
                         "(PREFIX.bin, PREFIX.idx, PREFIX.manifest.json)")
    ap.add_argument("--log-interval", type=float, default=5.0, metavar="SECONDS",
                    help="seconds between progress lines while hashing (default: %(default)s)")
    adopting = ap.add_argument_group(
        "adopting corpora tokenized by Megatron-LM (tools/preprocess_data.py: a .bin and .idx, "
        "no manifest)")
    adopting.add_argument("--adopt", action="store_true",
                          help="check each PREFIX and write its manifest instead of verifying "
                               "(exit status 1: some refused, each with the reason; default: "
                               "verify)")
    adopting.add_argument("--tokenizer-model", metavar="PATH",
                          help="with --adopt: the sentencepiece model the corpus was tokenized "
                               "with (default: the Llama-compatible 32k model fetched by "
                               "aoe-fetch-assets)")
    adopting.add_argument("--overwrite", action="store_true",
                          help="with --adopt: replace a manifest that exists (default: refuse "
                               "to)")
    return ap


def _prefixes(targets) -> list[str]:
    out = []
    for target in targets:
        if target.endswith((".yaml", ".yml")):
            out += DataConfig.load(target).prefixes
        else:
            out.append(target[:-4] if target.endswith((".bin", ".idx")) else target)
    return list(dict.fromkeys(out))


class _Progress:
    def __init__(self, total: int, interval: float):
        self.total, self.done, self.interval = total, 0, interval
        self.start = self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9) / 2**20
            print(f"  {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB hashed, "
                  f"{rate:.0f} MiB/s", file=sys.stderr, flush=True)


def _finding(found: dict) -> str:
    return (f"{found['finding']} ({found['found']:,} of {found['sampled']:,} sampled documents, "
            f"id {found['id']})")


def _adopt(args) -> int:
    try:
        prefixes = _prefixes(args.targets)
        Tokenizer(args.tokenizer_model)  # a missing tokenizer is a usage error, before any hashing
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    refused = 0
    for prefix in prefixes:
        sizes = sum(os.path.getsize(f"{prefix}{ext}") for ext in (".bin", ".idx")
                    if os.path.isfile(f"{prefix}{ext}"))
        progress = _Progress(sizes, args.log_interval)
        try:
            m = adopt(prefix, args.tokenizer_model, overwrite=args.overwrite, progress=progress)
        except (OSError, ValueError) as err:
            refused += 1
            print(f"{prefix}: REFUSED: {err}", flush=True)
            continue
        checks = m["adopted"]["checks"]
        print(f"{prefix}: adopted: {m['documents']:,} documents, {m['tokens']:,} tokens, "
              f"{m['dtype']}\n  EOD at the end: {_finding(checks['eod'])}; append_eod "
              f"{m['policy']['append_eod']}\n  BOS at the start: {_finding(checks['bos'])}; "
              f"prepend_bos {m['policy']['prepend_bos']}\n  checked and hashed "
              f"{sizes / 2**30:.2f} GiB in {time.monotonic() - progress.start:.1f} s; wrote "
              f"{prefix}.manifest.json",
              flush=True)
    print(f"{len(prefixes) - refused} of {len(prefixes)} dataset(s) adopted")
    return 1 if refused else 0


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.adopt:
        return _adopt(args)
    if args.tokenizer_model or args.overwrite:
        print("error: --tokenizer-model and --overwrite go with --adopt", file=sys.stderr)
        return 2
    try:
        prefixes = _prefixes(args.targets)
        manifests = {p: read_manifest(p) for p in prefixes}
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    total = sum(os.path.getsize(f"{p}{ext}") for p in prefixes for ext in (".bin", ".idx")
                if os.path.isfile(f"{p}{ext}"))
    progress, damaged = _Progress(total, args.log_interval), 0
    for prefix, manifest in manifests.items():
        if not manifest.get("files"):
            print(f"{prefix}: its manifest predates recorded sizes and hashes; checking the .idx "
                  f"against the .bin only", file=sys.stderr)
        problems = verify_dataset(prefix, manifest, progress)
        damaged += bool(problems)
        print(f"{prefix}: " + ("ok" if not problems else "DAMAGED\n  " + "\n  ".join(problems)),
              flush=True)
    print(f"{len(prefixes) - damaged} of {len(prefixes)} dataset(s) verify "
          f"({total / 2**30:.2f} GiB read in {time.monotonic() - progress.start:.1f} s)")
    return 1 if damaged else 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
