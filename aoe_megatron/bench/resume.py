"""Resume time on a large checkpoint, by how its files are verified (issue #24).

    python -m aoe_megatron.bench.resume --out bench/resume/warm          # a ~2.3 GB checkpoint
    python -m aoe_megatron.bench.resume --out bench/resume/cold --cold   # page cache dropped (root)
    python -m aoe_megatron.bench.resume --out /tmp/r --quick --reps 1    # seconds

Trains one step of a widened tiny model (world 2, EP 2, mock data) and saves it, then resumes it
through the train command, the modes alternating rep by rep:

- ``full, 1 thread``: every file re-hashed by one thread per rank (what every resume did before);
- ``full, threads``: every file re-hashed, ``AOE_VERIFY_THREADS`` threads per rank;
- ``stamps``: the default: only files whose size, mtime or ctime changed since last hashed.

Writes DIR/results.json and DIR/README.md (medians, min and max of each mode's verification and
whole-resume seconds, from the train command's own log lines).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from aoe_megatron.runtime import launch
from aoe_megatron.checkpoint.integrity import STAMPS

# hidden 1024, 8 experts of ffn 2048 in 2 layers: ~2.3 GB with Adam's moments and the fp32 copy
LARGE = ["num_layers=2", "hidden_size=1024", "num_attention_heads=8", "ffn_hidden_size=2048",
         "num_experts=8", "aoe.d_low=256"]
QUICK = []
MODES = {"full, 1 thread": {"AOE_VERIFY_THREADS": "1"}, "full, threads": {}, "stamps": {}}
LINE = re.compile(r"verified (\S+): (\d+) files, (\d+) hashed \(([\d.]+) GB\) in ([\d.]+) s")
RESUMED = re.compile(r"resumed from \S+ at step \d+ in ([\d.]+) s")


def train_args(ckpt: Path, run_dir: Path, model: list, steps: int) -> list:
    sets = [a for kv in model for a in ("--set", kv)]
    return ["--preset", "tiny", *sets, "--mock-data", "--expert-model-parallel-size", "2",
            "--train-iters", str(steps), "--save-interval", "1", "--eval-interval", "0",
            "--log-interval", "1", "--save", ckpt, "--load", ckpt, "--run-dir", run_dir]


def _launch(args: list, env: dict) -> str:
    done = launch.run(args, nproc=2, env=env, threads=1, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the train command failed ({done.returncode}):\n{done.output[-4000:]}")
    return done.output


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", required=True, type=Path, help="where results and the checkpoint go")
    parser.add_argument("--reps", type=int, default=3, help="resumes per mode (alternating)")
    parser.add_argument("--quick", action="store_true", help="the tiny model: seconds (tests)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the checkpoint and the run directory afterwards")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before each resume, as on storage that is not "
                             "cached (needs root: writes /proc/sys/vm/drop_caches)")
    args = parser.parse_args(argv)
    out, model = args.out, QUICK if args.quick else LARGE
    ckpt, run_dir = out / "checkpoint", out / "run"
    shutil.rmtree(ckpt, ignore_errors=True)
    began = time.time()
    print(f"training and saving one step ({'tiny' if args.quick else 'widened tiny'} model)",
          flush=True)
    _launch(train_args(ckpt, run_dir, model, 1), {})
    step_dir = ckpt / "step_00000001"
    size = folder_bytes(step_dir)
    print(f"checkpoint {step_dir}: {size / 1e9:.2f} GB", flush=True)
    results = {mode: {"verify_s": [], "resume_s": [], "hashed": []} for mode in MODES}
    for rep in range(args.reps):
        for mode, env in MODES.items():
            if mode != "stamps":
                (step_dir / STAMPS).unlink(missing_ok=True)
            if args.cold:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            output = _launch(train_args(ckpt, run_dir, model, 1), env)
            verified, resumed = LINE.search(output), RESUMED.search(output)
            if not (verified and resumed):
                raise SystemExit(f"no verification or resume line in:\n{output[-3000:]}")
            results[mode]["verify_s"].append(float(verified.group(5)))
            results[mode]["resume_s"].append(float(resumed.group(1)))
            results[mode]["hashed"].append(int(verified.group(3)))
            print(f"rep {rep + 1}/{args.reps} {mode}: verified in {verified.group(5)} s, "
                  f"resumed in {resumed.group(1)} s ({verified.group(3)} of "
                  f"{verified.group(2)} files hashed)", flush=True)
    if not args.keep:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    record = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
              "command": " ".join(["python -m aoe_megatron.bench.resume",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "checkpoint_bytes": size, "world_size": 2, "page_cache": "dropped" if args.cold else "warm", "duration_s": round(time.time() - began),
              "results": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    rows = ["| verification | files hashed | verify s: median (min-max) | resume s: median (min-max) |",
            "|---|---|---|---|"]
    for mode, r in results.items():
        rows.append(f"| {mode} | {r['hashed'][0]} | " + " | ".join(
            f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
            for v in (r["verify_s"], r["resume_s"])) + " |")
    (out / "README.md").write_text(
        f"# Resume time by verification mode\n\n{__doc__.split(chr(10) + chr(10), 1)[1]}\n"
        f"Checkpoint: {size / 1e9:.2f} GB at world size 2; page cache "
        f"{'dropped before each resume' if args.cold else 'warm'}. {args.reps} resumes per mode. "
        f"Measured {record['date']} on {record['machine']} in {record['duration_s']} s.\n"
        f"Reproduce: `{record['command']}`.\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
