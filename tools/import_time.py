"""Import time of ``aoe_megatron`` + ``megatron.core`` on each CI leg's virtualenv (issue #33).

Each sample is a fresh process: ``import torch`` first (not counted: the same on both sides of a
comparison only within one torch), then ``import aoe_megatron, megatron.core`` timed in-process.
The sides alternate round by round (this VM has steal time); median, min and max per side.
On megatron-core 0.19.2 a third side takes ``patches/mcore_moe_router``'s import hook back out,
to show what it saves.

    python tools/import_time.py [--rounds 7] [--out FILE.json]

Sides whose virtualenv is missing (``make setup``, ``make setup-mcore019``) are skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_TIMED = """
import sys, time
import torch
started = time.perf_counter()
import aoe_megatron
if sys.argv[1] == "without-router-hook":
    from aoe_megatron.patches import mcore_moe_router
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "name", None) != mcore_moe_router.TARGET]
import megatron.core
from aoe_megatron.runtime.versions import installed_mcore
print(time.perf_counter() - started, installed_mcore(), torch.__version__,
      "torch._inductor.compile_fx" in sys.modules)
"""

SIDES = [  # (name, virtualenv, mode)
    ("0.16.1", ".venv", "as-shipped"),
    ("0.19.2", ".venv-mcore019", "as-shipped"),
    ("0.19.2 without the router hook", ".venv-mcore019", "without-router-hook"),
]


def sample(python: Path, mode: str) -> dict:
    done = subprocess.run([str(python), "-c", _TIMED, mode], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=True)
    seconds, mcore, torch_version, inductor = done.stdout.split()
    return {"s": float(seconds), "megatron_core": mcore, "torch": torch_version,
            "inductor_loaded": inductor == "True"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sides = [(name, ROOT / venv / "bin" / "python", mode) for name, venv, mode in SIDES
             if (ROOT / venv / "bin" / "python").exists()]
    if not sides:
        sys.exit("import_time.py: no virtualenv found (make setup, make setup-mcore019)")
    samples: dict = {name: [] for name, _, _ in sides}
    started = time.monotonic()
    for r in range(args.rounds):
        for name, python, mode in sides if r % 2 == 0 else reversed(sides):
            samples[name].append(sample(python, mode))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} "
              f"({platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores)",
              "rounds": args.rounds, "duration_s": round(time.monotonic() - started, 1), "sides": {}}
    for name, runs in samples.items():
        times = [x["s"] for x in runs]
        result["sides"][name] = {
            "median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
            "max_s": round(max(times), 3), "megatron_core": runs[0]["megatron_core"],
            "torch": runs[0]["torch"], "inductor_loaded": sorted({x["inductor_loaded"] for x in runs})}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
