#!/usr/bin/env python
"""Inspect and verify training checkpoints without starting a run.

    python tools/checkpoints.py list ckpt/aoe_732m          # steps, layout, which is latest
    python tools/checkpoints.py verify ckpt/aoe_732m        # every checkpoint against its manifest
    python tools/checkpoints.py verify ckpt/aoe_732m/step_00001000

`verify` re-hashes every file (sha256) and names each missing, truncated or corrupted one; it
exits 1 if any checkpoint fails, 2 on bad input. The trainer does the same check when it resumes.
"""

import argparse
import json
import sys
from pathlib import Path


def _targets(path: Path) -> list:
    from aoe_megatron.train.checkpoint import checkpoints

    if (path / "state.json").is_file() or (path / "manifest.json").is_file():
        return [path]
    found = checkpoints(path)
    if not found:
        raise SystemExit(f"error: {path} is neither a checkpoint nor a directory of step_* "
                         f"checkpoints")
    return found


def _list(root: Path) -> int:
    from aoe_megatron.train.checkpoint import LATEST, VERIFIED, _pointer

    marks = {_pointer(root, LATEST): "latest", _pointer(root, VERIFIED): "last verified"}
    for path in _targets(root):
        try:
            state = json.loads((path / "state.json").read_text())
            layout = state.get("layout", {})
            desc = (f"step {state.get('step')}, world {layout.get('world_size')}, EP "
                    f"{layout.get('expert_parallel_size')}, ZeRO-{layout.get('zero_stage')}")
        except (OSError, ValueError) as err:
            desc = f"unreadable state.json ({type(err).__name__})"
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20
        labels = [label for name, label in marks.items() if name is not None and name == path.name]
        print(f"{path.name}  {desc}  {size:,.1f} MiB" + (f"  [{', '.join(labels)}]" if labels else ""))
    return 0


def _verify(root: Path) -> int:
    from aoe_megatron.train.integrity import verify

    failed = 0
    for path in _targets(root):
        problems = verify(path)
        print(f"{path}: " + ("OK" if not problems else "FAILED"), flush=True)
        for problem in problems:
            print(f"  {problem}")
        failed += bool(problems)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("list", "verify"))
    ap.add_argument("path", type=Path, help="a --ckpt-dir, or one step_* checkpoint")
    args = ap.parse_args(argv)
    if not args.path.is_dir():
        print(f"error: {args.path} is not a directory", file=sys.stderr)
        return 2
    return _list(args.path) if args.command == "list" else _verify(args.path)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
