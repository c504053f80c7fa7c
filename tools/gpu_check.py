#!/usr/bin/env python
"""The one-shot GPU check (issue #19): run by tools/gpu_check.sh, which sets up the Python.

    tools/gpu_check.sh                 # on a CUDA machine, within a 300 s budget (not yet run on one)
    tools/gpu_check.sh --cpu           # the same steps on the CPU at tiny shapes (tested)
    tools/gpu_check.sh --out DIR       # results folder (default: $OUT when set, else bench/gpu_check)
    tools/gpu_check.sh --budget 300    # seconds for all steps (default 300 on CUDA, 900 on the CPU)
    tools/gpu_check.sh --skip model,layer   # leave steps out (recorded as skipped)

Steps, each in its own processes within what is left of the budget, the results file rewritten
after each:
  environment   versions, device, optional kernels (TE, apex, the fused softmax)
  gpu-tests     the gpu-marked tests (CUDA-only: skipped on the CPU)
  train-resume  a tiny run at world 1 (bf16 on CUDA) that saves at step 6 and 12, a second run
                resumed from step 6 whose losses must equal the first's, the checkpoints verified
  bf16-accumulation  the tiny model in bf16, 64 micro-batches a step, gradients accumulated in
                fp32 and in bf16: both runs' losses (tools/gpu_check_train.py)
  checkpoint-memory  tools/ckpt_memory.py at world 1: the host memory a save and a load add
  model         AoE vs MoE tokens/s: a 4-layer 732M-shaped GPTModel, AoE experts by grouped_mm
                ("aoe": auto picks it on CUDA) and by the loop ("aoe-loop"); CPU: the tiny model
  layer         the layer benchmark cut down: 732m, 4b and fine64 blocks in bf16; CPU: --quick

DIR/gpu_check.json: {"mode", "started", "wall_s", "ok", "steps": [{"name", "status" (ok, failed,
skipped), "seconds", "figures", "reason"}]}; DIR/gpu_check.log: every step's output; DIR/model/ and
DIR/layer/: the benchmark's results.json and README.md. Exit 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = ("tests/test_gpu_paths.py", "tests/test_grouped_experts.py")


#: What a launcher (torchrun, srun, a test's process group) sets: every step is a job of its own.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _own_job_env() -> dict:
    """This environment less the launcher's variables: a step started from inside a launched job
    would otherwise join its rendezvous (or find its port taken)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


class Check:
    """Runs the steps, writes the results file after each, and the log as it goes."""

    def __init__(self, out: Path, mode: str, budget: float):
        self.out, self.mode = out, mode
        self.deadline = time.perf_counter() + budget
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "gpu_check.log", "w", encoding="utf-8")
        self.start = time.perf_counter()
        self.results = {"mode": mode, "started": datetime.now(timezone.utc).isoformat(
            timespec="seconds"), "command": " ".join(sys.argv), "steps": []}

    def run(self, cmd: list, *, timeout: float, env=None) -> str:
        """Run ``cmd`` in the repository, its output streamed into the log; returns the output.
        A non-zero exit or the time limit raises with the output's last lines."""
        cmd = [str(c) for c in cmd]
        timeout = min(timeout, self.deadline - time.perf_counter())
        if timeout < 5:
            raise RuntimeError("the time budget (--budget) is spent")
        self.say("$ " + " ".join(cmd))
        start = self.log.tell()
        try:
            code = subprocess.run(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                  timeout=timeout, env={**_own_job_env(), **(env or {})}).returncode
            problem = f"exit {code}" if code else None
        except subprocess.TimeoutExpired:
            problem = f"timed out after {timeout:.0f} s"
        self.log.seek(0, os.SEEK_END)
        output = (self.out / "gpu_check.log").read_bytes()[start:].decode(errors="replace")
        if problem:
            raise RuntimeError(f"{problem}: " + " | ".join(output.strip().splitlines()[-12:]))
        return output

    def say(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.start:6.1f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def step(self, name: str, fn) -> None:
        self.say(f"== {name}")
        t0 = time.perf_counter()
        record = {"name": name}
        try:
            record.update(fn() or {})
            record.setdefault("status", "ok")
        except Exception as err:  # a failed step is recorded; the next one still runs
            record.update(status="failed", reason=f"{type(err).__name__}: {err}")
        record["seconds"] = round(time.perf_counter() - t0, 1)
        self.say(f"== {name}: {record['status']}" + (f" ({record['reason']})" if "reason" in record
                                                       else ""))
        self.results["steps"].append(record)
        self.write()

    def write(self) -> None:
        self.results["wall_s"] = round(time.perf_counter() - self.start, 1)
        self.results["ok"] = all(s["status"] != "failed" for s in self.results["steps"])
        tmp = self.out / "gpu_check.json.partial"
        tmp.write_text(json.dumps(self.results, indent=2) + "\n")
        os.replace(tmp, self.out / "gpu_check.json")


def environment(check: Check) -> dict:
    probe = ("import json, torch, importlib.metadata as m\n"
             "from aoe_megatron.runtime import compat\n"
             "v = lambda d: m.version(d)\n"
             "cuda = torch.cuda.is_available()\n"
             "print(json.dumps({'python': __import__('platform').python_version(),\n"
             " 'torch': torch.__version__, 'cuda': torch.version.cuda, 'megatron_core': v('megatron-core'),\n"
             " 'deepspeed': v('deepspeed'), 'device': torch.cuda.get_device_name() if cuda else 'cpu',\n"
             " 'transformer_engine': compat.have_transformer_engine(),\n"
             " 'transformer_engine_usable': compat.transformer_engine_status(),\n"
             " 'nvidia_apex': compat.have_nvidia_apex(),\n"
             " 'fused_softmax': compat.fused_softmax_available()}))\n")
    figures = json.loads(check.run([sys.executable, "-c", probe], timeout=120).splitlines()[-1])
    if check.mode == "cuda" and figures["device"] == "cpu":
        raise RuntimeError("torch sees no CUDA device (run with --cpu for the CPU form)")
    return {"figures": figures}


def _pytest_summary(output: str) -> str:
    """pytest's closing count line ("4 passed, 104 deselected in 18.37s"); not simply the last
    line: a process group's shutdown warning can follow it (the first GPU run's did)."""
    for line in reversed(output.strip().splitlines()):
        if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b.* in [\d.]+s", line):
            return line.strip("= ")
    raise RuntimeError(f"pytest printed no summary: {output.strip().splitlines()[-1:]}")


def gpu_tests(check: Check) -> dict:
    output = check.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *GPU_TEST_FILES],
                       timeout=240)
    summary = _pytest_summary(output)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)",
                                               summary)}
    if check.mode == "cpu":
        return {"status": "skipped", "figures": counts,
                "reason": f"CUDA-only: {counts.get('skipped', 0)} gpu-marked tests skip on the CPU"}
    if counts.get("passed", 0) == 0:
        raise RuntimeError(f"no gpu-marked test ran: {summary}")
    return {"figures": counts}


def _bench(check: Check, name: str, flags: list, timeout: float) -> dict:
    device = ["--device", "cuda", "--dtype", "bf16"] if check.mode == "cuda" else ["--device", "cpu", "--quick"]
    check.run([sys.executable, "-m", "aoe_megatron.cli.bench", *device, *flags, "--out", check.out / name],
              timeout=timeout)
    return json.loads((check.out / name / "results.json").read_text())


def model(check: Check) -> dict:
    # the CPU form: 2 timed steps an arch, enough to show that each runs
    models = ["--models", "732m-4l", "--model-reps", "5"] if check.mode == "cuda" else ["--model-reps", "2"]
    res = _bench(check, "model", ["--only", "model", *models,
                                  "--model-archs", "moe,aoe,aoe-loop"], 300)
    figures = {}
    for name, m in res["model"]["models"].items():
        moe = m["archs"]["moe"]["tokens_per_s"]
        for arch, a in m["archs"].items():
            figures[f"{name}/{arch}"] = {"tokens_per_s": round(a["tokens_per_s"], 1),
                                         "mfu": round(a["mfu"], 4),
                                         "tokens_per_s_vs_moe": round(a["tokens_per_s"] / moe, 3)}
    return {"figures": figures}


def layer(check: Check) -> dict:
    shapes = ["--shapes", "732m,4b,fine64", "--reps", "7"] if check.mode == "cuda" else []
    res = _bench(check, "layer", ["--only", "layer", *shapes], 300)
    figures = {f"{shape}/{arm}": {"time_vs_moe": r["time"], "flops_vs_moe": round(r["flops"], 3)}
               for shape, s in res["layer"].items() for arm, r in s["ratios"].items()
               if isinstance(r, dict) and "time" in r and arm != "targets"}
    return {"figures": figures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cpu", action="store_true", help="the CPU form: tiny shapes, CUDA steps skipped")
    ap.add_argument("--budget", type=float, help="seconds for every step together (default: 300 "
                    "on CUDA, the lent GPU's 5 minutes; 900 on the CPU)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT")
                    else REPO / "bench" / "gpu_check", help="results folder")
    ap.add_argument("--skip", default="", help="steps to leave out, comma-separated (e.g. "
                    "model,layer when their figures are already in hand)")
    args = ap.parse_args(argv)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every child process runs on the CPU
    budget = args.budget or (900.0 if args.cpu else 300.0)
    check = Check(args.out.resolve(), "cpu" if args.cpu else "cuda", budget)
    check.step("environment", lambda: environment(check))
    if check.results["steps"][0]["status"] == "failed":
        return 1
    from gpu_check_train import bf16_accumulation, checkpoint_memory, train_resume  # tools/

    steps = {"gpu-tests": gpu_tests, "train-resume": train_resume,
             "bf16-accumulation": bf16_accumulation, "checkpoint-memory": checkpoint_memory,
             "model": model, "layer": layer}
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(steps):
        ap.error(f"--skip: unknown steps {sorted(skip - set(steps))}; the steps: {', '.join(steps)}")
    for name, fn in steps.items():
        if name in skip:
            check.step(name, lambda: {"status": "skipped", "reason": "--skip"})
            continue
        check.step(name, lambda fn=fn: fn(check))
    check.say(f"results: {check.out / 'gpu_check.json'} ({'ok' if check.results['ok'] else 'FAILED'})")
    return 0 if check.results["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
