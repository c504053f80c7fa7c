"""``aoe-checkpoints``: inspect and verify training checkpoints without starting a run.

    aoe-checkpoints list ckpt/aoe_732m          # steps, layout, which is latest
    aoe-checkpoints verify ckpt/aoe_732m        # every checkpoint against its manifest
    aoe-checkpoints verify ckpt/aoe_732m/step_00001000

`verify` re-hashes every file (sha256) and names each missing, truncated or corrupted one; it
exits 1 if any checkpoint fails, 2 on bad input. The trainer does the same check when it resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aoe_megatron.checkpoint.integrity import verify
from aoe_megatron.checkpoint.layout import (LATEST, STATE, VERIFIED, checkpoints, is_checkpoint,
                                            manifest_path, read_pointer, read_state)
from aoe_megatron.runtime.command_line import CommandParser

PATH_HELP = "a --ckpt-dir (every step_* checkpoint in it), or one step_* checkpoint"


class BadPath(ValueError):
    """PATH is not a checkpoint nor a folder of them: bad input, exit 2."""


def _targets(path: Path) -> list:
    if is_checkpoint(path) or manifest_path(path).is_file():
        return [path]
    found = checkpoints(path)
    if not found:
        raise BadPath(f"{path} is neither a checkpoint nor a directory of step_* checkpoints")
    return found


def _list(root: Path) -> int:
    marks = {read_pointer(root, LATEST): LATEST, read_pointer(root, VERIFIED): "last verified"}
    for path in _targets(root):
        try:
            state = read_state(path)
            layout = state.get("layout", {})
            desc = (f"step {state.get('step')}, world {layout.get('world_size')}, EP "
                    f"{layout.get('expert_parallel_size')}, ZeRO-{layout.get('zero_stage')}")
        except (OSError, ValueError) as err:
            desc = f"unreadable {STATE} ({type(err).__name__})"
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20
        labels = [label for name, label in marks.items() if name is not None and name == path.name]
        print(f"{path.name}  {desc}  {size:,.1f} MiB" + (f"  [{', '.join(labels)}]" if labels else ""))
    return 0


def _verify(root: Path) -> int:
    failed = 0
    for path in _targets(root):
        problems = verify(path)
        print(f"{path}: " + ("OK" if not problems else "FAILED"), flush=True)
        for problem in problems:
            print(f"  {problem}")
        failed += bool(problems)
    return 1 if failed else 0


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-checkpoints", allow_abbrev=False,
        description="Inspect and verify training checkpoints without starting a run: list their "
                    "steps and layouts, or re-hash every file against its manifest (exit 1 on "
                    "damage, 2 on bad input).")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                            help="what to do with PATH: list or verify")
    listing = sub.add_parser(
        "list", allow_abbrev=False,
        help="print each checkpoint's step, world size, EP size, ZeRO stage and size in MiB, "
             "marking the latest and the last verified",
        description="Print each checkpoint's step, layout and size (MiB); mark the latest and "
                    "the last verified one.")
    listing.add_argument("path", type=Path, help=f"what to list: {PATH_HELP}")
    verify = sub.add_parser(
        "verify", allow_abbrev=False,
        help="re-hash every file (sha256) against the checkpoint's manifest and name each "
             "missing, truncated or corrupted one; exit 1 if any checkpoint fails",
        description="Re-hash every file of each checkpoint (sha256) against its manifest; exit "
                    "1 if any fails, 2 on bad input.")
    verify.add_argument("path", type=Path, help=f"what to verify: {PATH_HELP}")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if not args.path.is_dir():
            raise BadPath(f"{args.path} is not a directory")
        return _list(args.path) if args.command == "list" else _verify(args.path)
    except BadPath as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
