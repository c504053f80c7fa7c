"""A training step's time through the real entry point, this checkout against another revision.

Issue #37 item 3 moved the routers' selection statistics off the hot path; this measures what a
training step costs before and after, for both architectures: ``python -m aoe_megatron.train`` at
world size 1 on --mock-data, this checkout's code against ``--ref``'s (a git worktree put on
``PYTHONPATH``), the runs alternating (ref, this; this, ref; ...) within each architecture. A run's
figure is the median of its logged ``ms_per_step`` (metrics.jsonl) after the first logging
interval (warm-up); each side reports the median, min and max over its runs, and CPU-seconds per
step (the run's own CPU time over its steps: start-up included, the same for both sides).

    python tools/step_time.py --ref 080d11d --this f38d0f1 --reps 3 --out bench/step_stats
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(code_root: Path, arch: str, args, work: Path) -> dict:
    """One training run with ``code_root``'s package first on the path: its step figures."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "aoe_megatron.train", "--preset", "tiny", "--arch", arch,
           "--mock-data", "--train-iters", str(args.steps), "--log-interval", str(args.log_interval),
           "--eval-interval", "0", "--micro-batch-size", str(args.batch), "--global-batch-size",
           str(args.batch), "--run-dir", str(run_dir)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, cwd=code_root, env=env, capture_output=True, text=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} (in {code_root}) failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    figures = [json.loads(line)["ms_per_step"] for line in
               (run_dir / "metrics.jsonl").read_text().splitlines()
               if '"ms_per_step"' in line and json.loads(line)["kind"] == "train"]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"ms_per_step": statistics.median(figures[1:]), "intervals": figures,
            "cpu_s_per_step": cpu / args.steps}


def _summary(runs: list) -> dict:
    ms = [r["ms_per_step"] for r in runs]
    cpu = [r["cpu_s_per_step"] for r in runs]
    return {"ms_per_step": {"median": statistics.median(ms), "min": min(ms), "max": max(ms)},
            "cpu_s_per_step": {"median": statistics.median(cpu), "min": min(cpu), "max": max(cpu)},
            "runs": runs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", required=True, help="the git revision to compare against")
    parser.add_argument("--this", default=None,
                        help="the revision measured against it (default: this checkout as it is)")
    parser.add_argument("--reps", type=int, default=3, help="runs per side and architecture")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="micro = global batch: one micro-batch a step")
    parser.add_argument("--archs", default="moe,aoe")
    parser.add_argument("--out", type=Path, required=True, help="folder for step_time.json and README.md")
    args = parser.parse_args(argv)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="aoe-step-time-"))
    trees = {"ref": work / "ref", "this": work / "this" if args.this else REPO}
    for side, rev in (("ref", args.ref), ("this", args.this)):
        if rev:
            subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(trees[side]), rev],
                           cwd=REPO, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", args.this or "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()
    dirty = not args.this and bool(subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
        text=True).stdout.strip())
    results = {}
    try:
        for arch in args.archs.split(","):
            sides = {"ref": [], "this": []}
            for rep in range(args.reps):
                order = ("ref", "this") if rep % 2 == 0 else ("this", "ref")
                for side in order:
                    run = _run(trees[side], arch, args, work)
                    sides[side].append(run)
                    print(f"{arch} {side} rep {rep + 1}: {run['ms_per_step']:.1f} ms/step, "
                          f"{run['cpu_s_per_step']:.3f} CPU s/step", flush=True)
            results[arch] = {side: _summary(runs) for side, runs in sides.items()}
            results[arch]["ratio_this_over_ref"] = (results[arch]["this"]["ms_per_step"]["median"]
                                                    / results[arch]["ref"]["ms_per_step"]["median"])
    finally:
        for side, rev in (("ref", args.ref), ("this", args.this)):
            if rev:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees[side])], cwd=REPO)
        subprocess.run(["rm", "-rf", str(work)])
    record = {"command": " ".join(["python", "tools/step_time.py", *(argv or sys.argv[1:])]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "wall_s": round(time.time() - started), "ref": args.ref,
              "this": head + (" (with uncommitted changes)" if dirty else ""),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "settings": {"preset": "tiny", "steps": args.steps, "log_interval": args.log_interval,
                           "micro_batch": args.batch, "global_batch": args.batch, "world_size": 1},
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_time.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# Training step time: {record['this']} against {args.ref}", "",
             f"Command: `{record['command']}`", "",
             f"Date {record['date']}, {record['wall_s']} s, {record['machine']}; tiny preset, world "
             f"size 1, --mock-data, micro = global batch {args.batch} (one micro-batch a step), "
             f"{args.steps} steps logged every {args.log_interval}; {args.reps} runs a side, "
             f"alternating. A run's figure: the median ms_per_step after its first interval.", "",
             "| arch | side | ms/step median (min-max) | CPU s/step median (min-max) |", "|---|---|---|---|"]
    for arch, res in results.items():
        for side in ("ref", "this"):
            ms, cpu = res[side]["ms_per_step"], res[side]["cpu_s_per_step"]
            lines.append(f"| {arch} | {side} | {ms['median']:.1f} ({ms['min']:.1f}-{ms['max']:.1f}) | "
                         f"{cpu['median']:.3f} ({cpu['min']:.3f}-{cpu['max']:.3f}) |")
    lines += ["", "this / ref, median ms/step: " + ", ".join(
        f"{arch} {res['ratio_this_over_ref']:.3f}" for arch, res in results.items()), ""]
    (args.out / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
