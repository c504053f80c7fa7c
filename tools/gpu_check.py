#!/usr/bin/env python
"""The one-shot GPU check (issues #19, #34): run by tools/gpu_check.sh, which sets up the Python.

    tools/gpu_check.sh                 # on a CUDA machine: the default steps within 330 s
    tools/gpu_check.sh --cpu           # the same steps on the CPU at tiny shapes (tested)
    tools/gpu_check.sh --out DIR       # results folder (default: $OUT when set, else bench/gpu_check)
    tools/gpu_check.sh --budget 330    # seconds for all steps (default 330 on CUDA, 900 on the CPU)
    tools/gpu_check.sh --skip layer    # leave steps out (recorded as skipped)
    tools/gpu_check.sh --steps ep-nccl,bf16-accumulation   # run these (default: the default set)

Steps, in this order, each in its own processes within its share of the budget (its time limit)
and what is left of the whole; the results file is rewritten after each. Shares on CUDA, with what
each took or is expected to take on one H100/H200 (docs/gpu.md says how the estimate was made):
  environment     versions, device, optional kernels (TE, apex, the fused softmax)            ~10 s
  gpu-tests       the gpu-marked tests (CUDA-only: skipped in the CPU form)               60 s, ~25
  ep-nccl         expert parallelism over NCCL with 2 ranks on the one GPU (a NCCL_HOSTID
                  per rank), gloo over CUDA tensors if NCCL refuses: tiny model, bf16, EP=2
                  ZeRO-1 for 8 steps saving at 4, resumed from 4, and EP=1, for aoe and moe
                  (tools/gpu_check_ep.py; the others tools/gpu_check_steps.py)           180 s, ~85
  layer           the layer bench's blocks at 732m, 4b, 732m-ep8 and 4b-ep8: moe (megatron-core's
                  SequentialMLP), moe-grouped, aoe-grouped_mm, aoe-d_wide64-nearest     90 s, ~50
  train-732m      the real trainer at world 1, the 12-layer 732M model, bf16, 10 steps per arch:
                  tokens/s, torch.cuda.max_memory_allocated, MFU against the datasheet and a
                  measured 8192^3 matmul                                                  90 s, ~45
  activations-4b  activation memory per layer at the 4B shape, 2 and 4 layers, micro-batch 2
                                                                                          60 s, ~30
  ep-nccl-zero2   optional, run only if its estimate is left: world 4 / EP 2 / ZeRO-2 on the
                  GPU against ep-nccl's EP=1 losses (skipped on the CPU)                  60 s, ~40
Not in the default set (already run on an H200, bench/gpu_check/README.md; --steps runs them):
  bf16-accumulation  tiny bf16 model, 64 micro-batches a step, fp32 vs bf16 accumulation
  checkpoint-memory  tools/ckpt_memory.py at world 1: the host memory a save and a load add

DIR/gpu_check.json: {"mode", "started", "wall_s", "ok", "steps": [{"name", "status" (ok, failed,
skipped), "seconds", "figures", "reason"}]}; DIR/gpu_check.log: every step's output; DIR/layer/:
the layer bench's results.json and README.md. Exit 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = ("tests/test_gpu_paths.py", "tests/test_grouped_experts.py")
#: step -> (its share of the budget on CUDA in s: its time limit; in the default set). Optional
#: steps (ep-nccl-zero2) also need their expected time left: OPTIONAL.
STEPS = {"gpu-tests": (60, True), "ep-nccl": (180, True), "layer": (90, True),
         "train-732m": (90, True), "activations-4b": (60, True), "ep-nccl-zero2": (60, True),
         "bf16-accumulation": (240, False), "checkpoint-memory": (120, False)}
OPTIONAL = {"ep-nccl-zero2": 45}
DEFAULT_BUDGET = {"cuda": 330.0, "cpu": 900.0}


class CommandFailed(RuntimeError):
    """A command's non-zero exit or time-out; ``output`` is everything it printed."""

    def __init__(self, message: str, output: str, *, timed_out: bool = False):
        super().__init__(message)
        self.output, self.timed_out = output, timed_out


#: What a launcher (torchrun, srun, a test's process group) sets: every step is a job of its own.
#: runtime/launch.py's LAUNCHER_VARS, repeated: this process imports nothing of the package
#: (importing it loads torch, 2 s of every check).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def _own_job_env() -> dict:
    """This environment less a launcher's variables: a step started from inside a launched job
    would otherwise join its rendezvous (or find its port taken)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


class Check:
    """Runs the steps, writes the results file after each, and the log as it goes."""

    def __init__(self, out: Path, mode: str, budget: float):
        self.out, self.mode = out, mode
        self.deadline = time.perf_counter() + budget
        out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="aoe-gpu-check-"))  # scratch: results stay in out
        self.shared: dict = {}  # what one step hands a later one (ep-nccl's EP=1 losses)
        self.log = open(out / "gpu_check.log", "w", encoding="utf-8")
        self.start = time.perf_counter()
        self.results = {"mode": mode, "started": datetime.now(timezone.utc).isoformat(
            timespec="seconds"), "command": " ".join(sys.argv), "budget_s": budget, "steps": []}

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def run(self, cmd: list, *, timeout: float, env=None) -> str:
        """Run ``cmd`` in the repository, its output streamed into the log; returns the output.
        A non-zero exit or the time limit raises ``CommandFailed``. The command runs in a session
        of its own: at its time limit the whole session is killed (torchrun's workers too)."""
        cmd = [str(c) for c in cmd]
        timeout = min(timeout, self.time_left())
        if timeout < 5:
            raise RuntimeError("the time budget (--budget) is spent")
        self.say("$ " + " ".join(cmd))
        start = self.log.tell()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                env={**_own_job_env(), **(env or {})}, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            problem = f"exit {code}" if code else None
        except subprocess.TimeoutExpired:
            problem = f"timed out after {timeout:.0f} s"
            self._kill(proc)
        except BaseException:  # Ctrl-C: take the step's processes down with the check
            self._kill(proc)
            raise
        self.log.seek(0, os.SEEK_END)
        output = (self.out / "gpu_check.log").read_bytes()[start:].decode(errors="replace")
        if problem:
            raise CommandFailed(f"{problem}: " + " | ".join(output.strip().splitlines()[-12:]),
                                output, timed_out=problem.startswith("timed out"))
        return output

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this check started, by its id
        except ProcessLookupError:
            pass
        proc.wait()

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
            record.update(getattr(err, "record", {}))  # figures a step had before it failed
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
             "from aoe_megatron.bench.measure import datasheet_peak_flops\n"
             "v = lambda d: m.version(d)\n"
             "cuda = torch.cuda.is_available()\n"
             "name = torch.cuda.get_device_name() if cuda else 'cpu'\n"
             "print(json.dumps({'python': __import__('platform').python_version(),\n"
             " 'torch': torch.__version__, 'cuda': torch.version.cuda, 'megatron_core': v('megatron-core'),\n"
             " 'deepspeed': v('deepspeed'), 'device': name,\n"
             " 'datasheet_bf16_peak': datasheet_peak_flops(name, torch.bfloat16),\n"
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


def gpu_tests(check: Check, timeout: float) -> dict:
    if check.mode == "cpu":  # make test collects them, and they skip there
        return {"status": "skipped", "reason": "CUDA-only: the gpu-marked tests skip on the CPU"}
    output = check.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *GPU_TEST_FILES],
                       timeout=timeout)
    summary = _pytest_summary(output)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)",
                                               summary)}
    if counts.get("passed", 0) == 0:
        raise RuntimeError(f"no gpu-marked test ran: {summary}")
    return {"figures": counts}


def _step_functions() -> dict:
    from gpu_check_ep import ep_nccl, ep_nccl_zero2  # tools/
    from gpu_check_steps import activations_4b, layer, train_732m
    from gpu_check_train import bf16_accumulation, checkpoint_memory

    return {"gpu-tests": gpu_tests, "ep-nccl": ep_nccl, "layer": layer,
            "train-732m": train_732m, "activations-4b": activations_4b,
            "ep-nccl-zero2": ep_nccl_zero2, "bf16-accumulation": bf16_accumulation,
            "checkpoint-memory": checkpoint_memory}


def _names(ap, flag: str, value: str) -> set:
    names = set(filter(None, value.split(",")))
    if names - set(STEPS):
        ap.error(f"{flag}: unknown steps {sorted(names - set(STEPS))}; the steps: {', '.join(STEPS)}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cpu", action="store_true", help="the CPU form: tiny shapes, CUDA steps skipped")
    ap.add_argument("--budget", type=float, help="seconds for every step together (default: 330 "
                    "on CUDA, leaving the 6-minute check time to install the wheels; 900 on the CPU)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT")
                    else REPO / "bench" / "gpu_check", help="results folder")
    ap.add_argument("--steps", default=",".join(n for n, (_, on) in STEPS.items() if on),
                    help="steps to run, comma-separated, in the check's own order (default: the "
                         "default set; the others are recorded as skipped)")
    ap.add_argument("--skip", default="", help="steps to leave out, comma-separated (e.g. "
                    "layer when its figures are already in hand)")
    args = ap.parse_args(argv)
    skip = _names(ap, "--skip", args.skip)
    chosen = _names(ap, "--steps", args.steps) - skip
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every child process runs on the CPU
    mode = "cpu" if args.cpu else "cuda"
    check = Check(args.out.resolve(), mode, args.budget or DEFAULT_BUDGET[mode])
    try:
        check.step("environment", lambda: environment(check))
        if check.results["steps"][0]["status"] == "failed":
            return 1
        functions = _step_functions()
        for name, (share, default) in STEPS.items():
            if name not in chosen:
                why = ("--skip" if name in skip else "not in --steps" if default else
                       "not in the default set: already run on an H200 "
                       "(bench/gpu_check/README.md); --steps runs it")
                check.step(name, lambda why=why: {"status": "skipped", "reason": why})
            elif name in OPTIONAL and mode == "cuda" and check.time_left() < OPTIONAL[name]:
                why = (f"optional, and the budget is short: {check.time_left():.0f} s left, it "
                       f"needs about {OPTIONAL[name]} s")
                check.step(name, lambda why=why: {"status": "skipped", "reason": why})
            else:
                check.step(name, lambda fn=functions[name], share=share: fn(check, share))
    finally:
        shutil.rmtree(check.work, ignore_errors=True)
    check.say(f"results: {check.out / 'gpu_check.json'} ({'ok' if check.results['ok'] else 'FAILED'})")
    return 0 if check.results["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
