#!/usr/bin/env python
"""Peak host memory of a checkpoint save and load, per rank, through the real trainer.

    python tools/ckpt_memory.py --world 2 --ep 1 --out bench/ckpt_memory/w2_ep1.json
    python tools/ckpt_memory.py --quick ...      # tiny shapes (the test)

Trains one step of a model large enough to see the optimizer state (about 141M parameters:
hidden 1024, 2 layers, 8 experts of ffn 2048), saves, then resumes in a second run and saves
again at its end. Each save and load logs the most any rank's resident memory rose above its
level before (``runtime/host_memory.py``: Linux's VmHWM, reset before the work); this collects
those lines, with the optimizer state's full size (fp32 master + 2 Adam moments, 12 bytes a
parameter) to compare them with.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {"large": ["--set", "hidden_size=1024", "--set", "num_attention_heads=16",
                    "--set", "ffn_hidden_size=2048", "--set", "num_experts=8",
                    "--set", "aoe.d_low=64"],
          "quick": []}
PEAK = re.compile(r"host memory peak \+([\d.]+) GiB")


def _run(args, ckpt: Path, run_dir: Path, steps: int) -> str:
    from aoe_megatron.runtime import launch

    done = launch.run(["--preset", "tiny", *SHAPES["quick" if args.quick else "large"],
                       "--mock-data", "--global-batch-size", 2 * args.world, "--micro-batch-size",
                       1, "--train-iters", steps, "--save-interval", 1, "--eval-interval", 0,
                       "--lr-warmup-iters", 1, "--expert-model-parallel-size", args.ep, "--zero-stage",
                       args.zero, "--ckpt-dir", ckpt, "--run-dir", run_dir],
                      nproc=args.world, threads=1, cwd=REPO, timeout=1800)
    if done.returncode:
        raise SystemExit(f"the training run failed:\n{done.output[-6000:]}")
    return done.output


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the tiny preset's shapes")
    ap.add_argument("--label", default="", help="a note kept in the results (e.g. the commit)")
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    args = ap.parse_args(argv)

    from aoe_megatron.models.params import count_parameters
    from aoe_megatron.train.values import parse_overrides
    from aoe_megatron.train.console import message
    from aoe_megatron.models.gpt import load_preset

    overrides = parse_overrides(SHAPES["quick" if args.quick else "large"][1::2])
    params = count_parameters(load_preset("tiny", **overrides)).total
    with tempfile.TemporaryDirectory(prefix="aoe-ckpt-memory-") as tmp:
        tmp = Path(tmp)
        first = _run(args, tmp / "ckpt", tmp / "run1", steps=1)
        second = _run(args, tmp / "ckpt", tmp / "run2", steps=2)
    save = [float(x) for line in map(message, first.splitlines() + second.splitlines())
            if line.startswith("saved ") for x in PEAK.findall(line)]
    load = [float(x) for line in map(message, second.splitlines())
            if line.startswith("resumed from ") for x in PEAK.findall(line)]
    if not save or not load:
        raise SystemExit("no host-memory figure in the logs (is /proc/self/clear_refs writable?)")
    state_gib = 12 * params / 2**30
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "label": args.label, "world": args.world, "ep": args.ep, "zero": args.zero,
              "parameters": params, "optimizer_state_gib": round(state_gib, 3),
              "save_peak_gib": save, "load_peak_gib": load}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{params / 1e6:.0f}M parameters, optimizer state {state_gib:.2f} GiB in all; "
          f"world {args.world}, EP {args.ep}, ZeRO-{args.zero}: save peak "
          f"{', '.join(f'+{x:.2f}' for x in save)} GiB, load peak "
          f"{', '.join(f'+{x:.2f}' for x in load)} GiB (busiest rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
