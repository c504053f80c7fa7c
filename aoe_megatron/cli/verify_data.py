"""``aoe-verify-data``: check preprocessed datasets against their manifests, every byte: the
sizes, the ``.idx`` against the ``.bin``, and the sha256 of both files recorded while
preprocessing wrote them. Meant for use after copying a corpus to cluster storage; a training
launch checks only the sizes and the index (it reads a few bytes a file)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from aoe_megatron.data.blend import DataConfig
from aoe_megatron.data.integrity import verify_dataset
from aoe_megatron.data.preprocess import read_manifest


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="aoe-verify-data", allow_abbrev=False,
        description="Verify preprocessed datasets against their manifests: file sizes, the .idx "
                    "against the .bin, and the sha256 of both (reads every byte). Exit status 0: "
                    "all verify; 1: damage found (each damaged file named).")
    ap.add_argument("targets", nargs="+", metavar="DATA_YAML|PREFIX",
                    help="data config YAMLs (every prefix of their blends) or dataset prefixes "
                         "(PREFIX.bin, PREFIX.idx, PREFIX.manifest.json)")
    ap.add_argument("--log-interval", type=float, default=5.0, metavar="SECONDS",
                    help="seconds between progress lines while hashing (default: %(default)s)")
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


def main(argv=None) -> int:
    args = parser().parse_args(argv)
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
