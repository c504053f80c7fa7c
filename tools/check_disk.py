"""Refuse early, in one sentence, when a folder's file system has too little free space for what
comes next (the Makefile runs it before the second leg's multi-GB install: pip's own error comes
only after minutes of downloads, as "[Errno 28] No space left on device").

    python tools/check_disk.py --need-gib 8 --for "what needs it" FOLDER [FOLDER ...]

Exit 0 when each folder's file system has the space, 1 (and the sentence on stderr) when one has
not. Folders on the same file system are checked once. Standard library only: it runs before any
virtualenv exists."""

from __future__ import annotations

import argparse
import os
import shutil
import sys


def shortfalls(folders, need_bytes: int) -> list:
    """(folder, free bytes) for each file system among ``folders`` with under ``need_bytes`` free."""
    seen, short = set(), []
    for folder in folders:
        device = os.stat(folder).st_dev
        if device in seen:
            continue
        seen.add(device)
        free = shutil.disk_usage(folder).free
        if free < need_bytes:
            short.append((folder, free))
    return short


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--need-gib", type=float, required=True, help="free space needed, GiB")
    parser.add_argument("--for", dest="purpose", default="this step", help="what needs it (for the message)")
    parser.add_argument("folders", nargs="+", help="folders whose file systems must have the space")
    args = parser.parse_args(argv)
    missing = [f for f in args.folders if not os.path.isdir(f)]
    if missing:
        parser.error(f"not a folder: {', '.join(missing)}")
    short = shortfalls(args.folders, int(args.need_gib * 2**30))
    for folder, free in short:
        print(f"error: {args.purpose} needs about {args.need_gib:g} GiB free, and {folder!r} has "
              f"{free / 2**30:.1f} GiB: free some space (old virtualenvs, pytest's "
              f"/tmp/pytest-of-$USER, pip's cache) and run make again", file=sys.stderr)
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
