"""tools/gpu_check.py's expert-parallel steps (issue #34): ep-nccl and ep-nccl-zero2.

ep-nccl: for aoe and moe, in one job of two processes on the one GPU (tools/gpu_check_runs.py),
the tiny model (a 512-token vocabulary) in bf16 with ZeRO-1: EP=2 for 8 steps saving at 4, the
same resumed from its step-4 checkpoint (a fresh model and engine loading it), and EP=1. Checked:
the resumed losses against the first run's, EP=1's losses and gradient norms against EP=2's, the
checkpoints re-hashed. The CPU form: gloo, 4 steps saving at 2.

NCCL refuses two ranks on one GPU of one host; each rank gets its own NCCL_HOSTID
(``AOE_NCCL_HOST_PER_RANK``, runtime/distributed.default_backend) so that NCCL takes them for two
hosts joined by its socket transport (on the loopback interface here). If NCCL still refuses (the
job fails before a run ends, naming NCCL, or hangs), the runs are made again over gloo on the CUDA
tensors (``AOE_DIST_BACKEND=gloo``); "backend" and "backend_why" say which ran and why.

ep-nccl-zero2 (CUDA only, optional): world 4 / EP 2 / ZeRO-2 on the same settings, against
ep-nccl's EP=1 losses (the same 8 samples each step: 4 ranks x 1 micro-batch of 2 in this one,
2 ranks x 2 accumulated in ep-nccl's).
"""

from __future__ import annotations

import re

from gpu_check_steps import run_driver  # tools/

ARCHS = ("aoe", "moe")
#: (steps, the step saved at and resumed from)
LENGTH = {"cuda": (8, 4), "cpu": (4, 2)}
#: |resumed - uninterrupted| per step. The same layout resumed repeats the same sums in the same
#: order: expected exact (the H200's world-1 resume was); 1e-4 leaves bf16 one rounding.
RESUME_TOLERANCE = 1e-4
#: EP=2 against EP=1, bf16 (both forms run bf16). Step 1, identical weights and batch: only how
#: the bf16 expert GEMMs group rows differs (EP=2 computes each expert over both ranks' tokens in
#: one GEMM), a last-bit change in some outputs: loss within 1e-3, gradient norm within 1%.
#: Later steps add the reduction order: an expert's bf16 weight gradient is formed over both
#: ranks' rows at once at EP=2, per rank then summed in fp32 at EP=1 (2^-8 relative apart), and
#: Adam's normalised early updates carry that into the weights: loss within 1e-2, gradient norm
#: within 5%. (The CPU form, bf16, measured 6e-5 and 0.07%. EP=2 equal to EP=1 to fp32 precision
#: is the CPU tests' job: tests/test_expert_parallel.py, tests/test_deepspeed_ep.py.)
EP_TOLERANCE = {"loss_step1": 1e-3, "loss": 1e-2, "grad_norm_step1_rel": 1e-2,
                "grad_norm_rel": 5e-2}
NCCL_ENV = {"AOE_DIST_BACKEND": "nccl", "AOE_NCCL_HOST_PER_RANK": "1",
            "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
#: the NCCL job's part of the step's time limit: a hang is cut there, leaving the rest to gloo
NCCL_SHARE = 0.7
GLOO_ENV = {"AOE_DIST_BACKEND": "gloo"}
NCCL_WORDS = re.compile(r"NCCL|nccl|Duplicate GPU|DistBackendError")


class StepFailed(RuntimeError):
    """A check that failed, with the figures measured (``record``, kept in the results)."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.record = {"figures": figures}


def _settings(mode: str) -> list:
    steps = LENGTH[mode][0]
    return ["--preset", "tiny", "--set", "vocab_size=512", "--mock-data", "--precision", "bf16",
            "--global-batch-size", 8 if mode == "cuda" else 4, "--micro-batch-size", 2,
            "--train-iters", steps, "--eval-interval", 0, "--log-interval", 1, "--lr", "3e-3",
            "--lr-warmup-iters", 1, "--distributed-timeout-minutes", 1]


def _ep_runs(work, mode: str) -> tuple[list, list]:
    half = LENGTH[mode][1]
    runs, ckpts = [], []
    for arch in ARCHS:
        base = [*_settings(mode), "--arch", arch, "--zero-stage", 1]
        ckpt, resumed = work / f"{arch}-ckpt", work / f"{arch}-from-{half}"
        ckpts.append(ckpt)
        runs += [{"name": f"{arch}-ep2", "args": [*base, "--expert-model-parallel-size", 2,
                                                  "--save-interval", half, "--save", ckpt,
                                                  "--run-dir", work / f"{arch}-ep2"]},
                 {"name": f"{arch}-resumed", "resume_from": {"ckpt": ckpt, "step": half,
                                                             "into": resumed},
                  "args": [*base, "--expert-model-parallel-size", 2, "--save-interval", half,
                           "--load", resumed, "--save", resumed,
                           "--run-dir", work / f"{arch}-resumed"]},
                 {"name": f"{arch}-ep1", "args": [*base, "--expert-model-parallel-size", 1,
                                                  "--run-dir", work / f"{arch}-ep1"]}]
    return runs, ckpts


def _refusal(err) -> str | None:
    """Why NCCL refused, or None when the failure is not NCCL refusing its ranks (a run
    finished, or the output neither names NCCL nor timed out)."""
    if err.partial.get("runs"):
        return None
    lines = [ln.strip() for ln in err.output.splitlines() if NCCL_WORDS.search(ln)]
    if lines:
        return " | ".join(dict.fromkeys(lines))[-600:]  # each distinct line once, the last ones
    return "it hung (killed at the step's time limit)" if err.timed_out else None


def _on_backend(check, name: str, make_runs, *, nproc: int, timeout: float) -> tuple:
    """(results, backend, why, env): NCCL first on CUDA, gloo when NCCL refuses; gloo on CPU."""
    if check.mode == "cpu":
        runs, ckpts = make_runs(check.work / name)
        return (run_driver(check, name, runs, nproc=nproc, timeout=timeout, env=GLOO_ENV,
                           verify=ckpts), "gloo", "the CPU form: gloo (NCCL needs CUDA)", GLOO_ENV)
    runs, ckpts = make_runs(check.work / f"{name}-nccl")
    try:
        res = run_driver(check, f"{name}-nccl", runs, nproc=nproc, timeout=NCCL_SHARE * timeout,
                         env=NCCL_ENV, verify=ckpts)
        return (res, "nccl", f"NCCL took {nproc} ranks on one GPU: a NCCL_HOSTID per rank, its "
                "socket transport over the loopback interface", NCCL_ENV)
    except RuntimeError as err:
        why = _refusal(err) if hasattr(err, "partial") else None
        if why is None:
            raise
    check.say(f"NCCL refused: {why}; the runs again over gloo on the CUDA tensors")
    runs, ckpts = make_runs(check.work / f"{name}-gloo")
    res = run_driver(check, f"{name}-gloo", runs, nproc=nproc,
                     timeout=max((1 - NCCL_SHARE) * timeout, 90),
                     env=GLOO_ENV, verify=ckpts)
    return res, "gloo", f"NCCL refused ({why}); gloo over CUDA tensors instead", GLOO_ENV


def _by_step(values: dict) -> dict:
    return {int(k): v for k, v in values.items()}


def _against(a: dict, b: dict) -> dict:
    """Loss and gradient-norm differences of run ``a`` from run ``b`` over their common steps."""
    la, lb = _by_step(a["losses"]), _by_step(b["losses"])
    ga, gb = _by_step(a["grad_norms"]), _by_step(b["grad_norms"])
    steps = sorted(set(la) & set(lb))
    rel = {s: abs(ga[s] - gb[s]) / abs(gb[s]) for s in steps
           if ga.get(s) is not None and gb.get(s)}
    return {"steps": steps, "loss_diff_step1": abs(la[steps[0]] - lb[steps[0]]),
            "max_loss_diff": max(abs(la[s] - lb[s]) for s in steps),
            "grad_norm_rel_step1": rel.get(steps[0]), "max_grad_norm_rel": max(rel.values(),
                                                                                default=None)}


def _ep_problems(arch: str, d: dict, what: str) -> list:
    limits = (("loss_diff_step1", "loss_step1"), ("max_loss_diff", "loss"),
              ("grad_norm_rel_step1", "grad_norm_step1_rel"), ("max_grad_norm_rel", "grad_norm_rel"))
    return [f"{arch} {what}: {key} {d[key]:.3g} > {EP_TOLERANCE[limit]:g}" for key, limit in limits
            if d[key] is not None and d[key] > EP_TOLERANCE[limit]]


def ep_nccl(check, timeout: float) -> dict:
    steps, half = LENGTH[check.mode]
    res, backend, why, env = _on_backend(check, "ep", lambda w: _ep_runs(w, check.mode), nproc=2,
                                         timeout=timeout)
    runs = res["runs"]
    figures = {"backend": backend, "backend_why": why, "steps": steps, "resumed_from": half,
               "tolerances": {"resume": RESUME_TOLERANCE, **EP_TOLERANCE},
               "verify_exit_codes": list(res.get("verify", {}).values()),
               "seconds": {n: round(r["seconds"], 1) for n, r in runs.items()}}
    problems = [f"checkpoint verification failed: {res.get('verify')}"
                for code in figures["verify_exit_codes"] if code]
    for arch in ARCHS:
        ep2, resumed, ep1 = (runs[f"{arch}-{k}"] for k in ("ep2", "resumed", "ep1"))
        after = sorted(_by_step(resumed["losses"]))
        if resumed["start"] != half or after != list(range(half + 1, steps + 1)):
            problems.append(f"{arch}: the resumed run started at {resumed['start']} and logged "
                            f"steps {after}, not {half + 1}-{steps}")
        resume = _against(resumed, ep2)
        ep = _against(ep1, ep2)
        figures[arch] = {"losses_ep2": [round(v, 6) for v in _by_step(ep2["losses"]).values()],
                         "max_resume_loss_diff": resume["max_loss_diff"], "ep1_vs_ep2": ep}
        if resume["max_loss_diff"] > RESUME_TOLERANCE:
            problems.append(f"{arch}: resumed losses differ by {resume['max_loss_diff']:.3g}")
        problems += _ep_problems(arch, ep, "EP=1 vs EP=2")
    check.shared["ep-nccl"] = {"backend": backend, "env": env,
                               "ep1": {arch: runs[f"{arch}-ep1"] for arch in ARCHS}}
    if problems:
        raise StepFailed("; ".join(problems), figures)
    return {"figures": figures}


def ep_nccl_zero2(check, timeout: float) -> dict:
    if check.mode == "cpu":
        return {"status": "skipped", "reason": "CUDA form only: 4 processes on this machine's "
                "cores would cost more than the rest of the check; on the GPU it compares "
                "world 4 / EP 2 / ZeRO-2 with ep-nccl's EP=1 losses"}
    base = check.shared.get("ep-nccl")
    if base is None:
        return {"status": "skipped", "reason": "needs ep-nccl's EP=1 runs (ep-nccl did not run "
                "them)"}
    work = check.work / "ep-zero2"
    runs = [{"name": arch, "args": [*_settings(check.mode), "--arch", arch, "--zero-stage", 2,
                                    "--expert-model-parallel-size", 2, "--run-dir", work / arch]}
            for arch in ARCHS]
    res = run_driver(check, "ep-zero2", runs, nproc=4, timeout=timeout, env=base["env"])
    figures, problems = {"backend": base["backend"], "world_size": 4, "zero_stage": 2}, []
    for arch in ARCHS:
        d = _against(res["runs"][arch], base["ep1"][arch])
        figures[arch] = {"vs_ep1_world2_zero1": d, "seconds": round(res["runs"][arch]["seconds"], 1)}
        problems += _ep_problems(arch, d, "world 4 EP=2 ZeRO-2 vs world 2 EP=1 ZeRO-1")
    if problems:
        raise StepFailed("; ".join(problems), figures)
    return {"figures": figures}
