"""Save time of bench/resume's checkpoint, this checkout against another (issue #34).

    git worktree add /tmp/before HEAD      # the code to compare with
    python -m aoe_megatron.bench.save --out bench/resume/save --before /tmp/before
    python -m aoe_megatron.bench.save --out /tmp/s --quick --reps 1       # seconds, no comparison

Each launch trains one step of bench/resume's widened tiny model (world 2, EP 2, mock data) and
saves it into a fresh folder; the arms alternate rep by rep, in turns (before, after, after,
before, ...), so a drift of the machine's load reaches both alike. Per launch: the save's seconds
from the train command's own line ("saved ... (X s"), the checkpoint's bytes, and the CPU seconds
of the whole command (its processes', from the kernel's accounting of waited-for children: the
same start-up and step in both arms, so their difference is the save's).

Writes DIR/results.json and DIR/README.md (median, min and max of each arm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from aoe_megatron.bench.resume import LARGE, QUICK, folder_bytes, train_args
from aoe_megatron.runtime import launch

SAVED = re.compile(r"saved (\S+) \(([\d.]+) s")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _one_save(tree: Path | None, out: Path, model: list) -> dict:
    """Train one step and save it with the code of ``tree`` (None: this checkout)."""
    ckpt, run_dir = out / "checkpoint", out / "run"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {"PYTHONPATH": str(tree)} if tree else {}
    cpu, began = _children_cpu(), time.perf_counter()
    done = launch.run(train_args(ckpt, run_dir, model, 1), nproc=2, env=env, threads=1,
                      cwd=tree, timeout=1800)
    wall, cpu = time.perf_counter() - began, _children_cpu() - cpu
    saved = SAVED.search(done.output)
    if done.returncode != 0 or "resumed from" in done.output or not saved:  # resumed: not fresh
        raise SystemExit(f"the train command failed ({done.returncode}):\n{done.output[-4000:]}")
    step_dir = Path(saved.group(1))
    record = {"save_s": float(saved.group(2)), "bytes": folder_bytes(step_dir),
              "command_cpu_s": round(cpu, 2), "command_s": round(wall, 2)}
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    return record


def _where(tree: Path | None) -> str:
    """Where ``aoe_megatron`` is imported from, launched as the arm launches it."""
    env = launch.child_env({"PYTHONPATH": str(tree)} if tree else {})
    probe = "import aoe_megatron; print(aoe_megatron.__file__)"
    return subprocess.run([sys.executable, "-c", probe], env=env, cwd=tree, capture_output=True,
                          text=True, check=True).stdout.strip()


def _summary(values: list) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", required=True, type=Path, help="where results go")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout (a git worktree) to compare with, arm 'before'")
    parser.add_argument("--reps", type=int, default=5, help="saves per arm (alternating)")
    parser.add_argument("--quick", action="store_true", help="the tiny model: seconds (tests)")
    args = parser.parse_args(argv)
    model = QUICK if args.quick else LARGE
    arms = {"after": None, **({"before": args.before.resolve()} if args.before else {})}
    imported = {arm: _where(tree) for arm, tree in arms.items()}
    if len(set(imported.values())) != len(arms):
        raise SystemExit(f"both arms import the same aoe_megatron: {imported}")
    began = time.time()
    results = {arm: [] for arm in arms}
    work = (args.out / "work").resolve()  # absolute: the other arm runs in its own checkout
    for rep in range(args.reps):
        order = list(arms) if rep % 2 else list(arms)[::-1]  # before first on even reps
        for arm in order:
            record = _one_save(arms[arm], work, model)
            results[arm].append(record)
            print(f"rep {rep + 1}/{args.reps} {arm}: saved {record['bytes'] / 1e9:.2f} GB in "
                  f"{record['save_s']:.1f} s; command {record['command_cpu_s']:.1f} CPU-s",
                  flush=True)
    shutil.rmtree(work, ignore_errors=True)
    size = results["after"][0]["bytes"]
    record = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
              "load_average_at_end": os.getloadavg(),
              "command": " ".join(["python -m aoe_megatron.bench.save",
                                   *(sys.argv[1:] if argv is None else map(str, argv))]),
              "imported": imported, "checkpoint_bytes": size, "world_size": 2,
              "duration_s": round(time.time() - began), "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    rows = ["| arm | save s: median (min-max) | GB/s: median (min-max) | command CPU-s: median "
            "(min-max) |", "|---|---|---|---|"]
    for arm, runs in results.items():
        rows.append(f"| {arm} | {_summary([r['save_s'] for r in runs])} | "
                    f"{_summary([r['bytes'] / 1e9 / r['save_s'] for r in runs])} | "
                    f"{_summary([r['command_cpu_s'] for r in runs])} |")
    (args.out / "README.md").write_text(
        f"# Save time\n\n{__doc__.split(chr(10) + chr(10), 1)[1]}\n"
        f"Checkpoint: {size / 1e9:.2f} GB at world size 2, page cache warm. {args.reps} saves per "
        f"arm. Measured {record['date']} on {record['machine']} in {record['duration_s']} s; load "
        f"average {record['load_average_at_end'][0]:.1f} at the end (other processes share the "
        f"machine: compare the arms, not single saves).\n"
        f"Reproduce: `{record['command']}`.\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
