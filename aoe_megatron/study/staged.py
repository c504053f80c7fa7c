"""Runs a staged study's plan (``study.plan``) inside an optional time budget, and gathers what
has finished for the report, naming what has not.

A run is trained (``runner.train_one``: reused, resumed or started), evaluated held-out at every
kept checkpoint, probed where the spec asks, Table 1's run exported and probed, and then, in a
stage with ``checkpoints: delete``, its checkpoints deleted (the records stay). After each run
the plan is read again: a sweep's extra rate, or the next stage's runs, appear once the results
they depend on are in. With a budget, a run starts only if its estimate (``plan.estimate_seconds``)
ends inside the budget.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from aoe_megatron.study import plan as planning
from aoe_megatron.study.runner import evaluate_one, run_paths, table1_probe, train_one
from aoe_megatron.study.spec import Study

WHY = {planning.TODO: "not run yet", planning.STARTED: "started, not finished (the same command "
       "resumes it)", planning.TRAINED: "trained, not evaluated yet"}


def _minutes(seconds) -> str:
    return "unknown" if seconds is None else f"{seconds / 60:.1f} min"


def describe(study: Study, out: Path, plan: planning.Plan, echo=print) -> None:
    """The plan, a line a stage and a line a run still to do (``--plan``)."""
    for stage in study.stages:
        runs = plan.of(stage.name)
        counts = {s: sum(r.status == s for r in runs) for s in
                  (planning.DONE, planning.TRAINED, planning.STARTED, planning.TODO)}
        waits = [w for w in plan.waiting if w["stage"] == stage.name]
        echo(f"stage {stage.name}: {len(runs)} runs planned ({', '.join(f'{n} {s}' for s, n in counts.items() if n)})"
             + (f"; {sum(len(w['seeds']) for w in waits)} more waiting" if waits else ""))
        for r in runs:
            if r.status != planning.DONE:
                est = planning.estimate_seconds(study, out, plan, r)
                echo(f"  {r.run_id} seed {r.seed}: {r.status} (about {_minutes(est)})")
        for w in waits:
            echo(f"  {w['arm']} seeds {w['seeds']}: waiting: {w['why']}")
        if plan.best.get(stage.name):
            echo("  best: " + ", ".join(f"{a} {b['run_id']} ({b['loss']:.4f})"
                                        for a, b in sorted(plan.best[stage.name].items())))


def _is_table1(study: Study, run: planning.PlannedRun) -> bool:
    t = study.table1
    return bool(t) and t.get("stage") == run.stage and t.get("arm") == run.base and \
        int(t.get("seed", study.seeds[0])) == run.seed


def execute(study: Study, out: Path, run: planning.PlannedRun, *, echo=print, jobs: int = 1,
            index_lock=None) -> None:
    """Train, evaluate, probe and tidy one run; ``jobs`` runs at once share the cores (each
    process gets its share of threads; with one job, the defaults: the cores over the run's
    processes for training, torch's own choice for evaluation)."""
    stage = next(s for s in study.stages if s.name == run.stage)
    cores = os.cpu_count() or 1
    train_threads = max(1, cores // (jobs * run.arm.world_size)) if jobs > 1 else None
    threads = max(1, cores // jobs) if jobs > 1 else None
    train_one(study, run.arm, run.seed, out, echo=echo, threads=train_threads,
              index_lock=index_lock)
    probe = run.base in study.probe.get("arms", []) and run.stage in study.probe.get("stages", [run.stage])
    evaluate_one(study, run.arm, run.seed, out, echo=echo, probe=probe, threads=threads)
    if _is_table1(study, run):
        table1_probe(study, out, echo=echo, arm=run.arm, threads=threads)
    paths = run_paths(out, run.arm, run.seed)
    if stage.checkpoints == "delete" and paths.ckpt.is_dir():
        shutil.rmtree(paths.ckpt)
        record = json.loads(paths.record.read_text())
        record["checkpoints_deleted"] = True
        paths.record.write_text(json.dumps(record, indent=2) + "\n")


def run_staged(study: Study, out: Path, *, stages=(), arms=(), seeds=(), budget_minutes=None,
               jobs: int = 1, echo=print) -> list:
    """Run the plan's runs that match the filters, in order, each only if it fits the budget, up
    to ``jobs`` at once (each with its share of the cores); returns the runs started, and says
    which were left and why. After a run fails no other starts; those running finish, then the
    failure is raised."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    deadline = None if budget_minutes is None else time.monotonic() + 60 * float(budget_minutes)
    left_out: dict = {}
    started: list = []
    running: dict = {}  # run key -> its future
    failure = None
    index_lock = threading.Lock() if jobs > 1 else None
    echo_lock = threading.Lock()

    def say(line: str) -> None:  # one line at a time from the runs' threads
        with echo_lock:
            echo(line)

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="study-run") as pool:
        while True:
            chosen = None
            if failure is None and len(running) < jobs:
                chosen = _next_run(study, out, stages, arms, seeds, deadline, left_out, running)
            if chosen is not None:
                run, seconds = chosen
                started.append(run)
                say(f"[{len(started)}] stage {run.stage}: {run.run_id} seed {run.seed} "
                    f"(about {_minutes(seconds)})")
                running[run.key] = pool.submit(execute, study, out, run, echo=say, jobs=jobs,
                                               index_lock=index_lock)
                continue
            if not running:
                break
            finished, _ = wait(list(running.values()), return_when=FIRST_COMPLETED)
            for key in [k for k, f in running.items() if f in finished]:
                error = running.pop(key).exception()
                if error is not None and failure is None:
                    failure = error
                    if running:
                        say(f"  {key[1]} seed {key[2]} failed: no other run starts; waiting for "
                            f"the {len(running)} running")
    if failure is not None:
        raise failure
    for (stage, rid, seed), why in left_out.items():
        echo(f"  left for a later invocation: {stage}/{rid} seed {seed}: {why}")
    waiting = [w for w in planning.make_plan(study, out).waiting
               if (not stages or w["stage"] in stages)]
    for w in waiting:
        echo(f"  waiting: stage {w['stage']}: {w['arm']}: {w['why']}")
    return started


def _next_run(study, out, stages, arms, seeds, deadline, left_out: dict, running: dict):
    """(run, estimated seconds): the first run of the plan, read anew, that matches the filters,
    is not running, and fits the budget (what does not is noted in ``left_out``); None when none."""
    plan = planning.make_plan(study, out)
    for run in planning.select(plan, stages=stages, arms=arms, seeds=seeds):
        if run.key in left_out or run.key in running:
            continue
        seconds = planning.estimate_seconds(study, out, plan, run)
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if seconds is None:
                left_out[run.key] = "no estimate of its duration (give the stage minutes_per_run)"
                continue
            if seconds > remaining:
                left_out[run.key] = f"about {_minutes(seconds)}, {_minutes(remaining)} left"
                continue
        return run, seconds
    return None


def _stage_shape(study: Study, stage) -> dict:
    arm = planning.stage_arm(study, stage, study.arms[0].name, {})
    train = arm.preset["train"]
    return {"steps": int(train.get("train_iters", 0)),
            "tokens_per_step": int(train["global_batch_size"]) * int(arm.model.seq_length)}


def collect_staged(study: Study, out: Path) -> dict:
    """The finished runs of every stage, the best settings per arm, and ``missing``: every
    planned run not done, and the groups waiting on an earlier stage."""
    plan = planning.make_plan(study, out)
    results: dict = {"stages": {}, "missing": []}
    for stage in study.stages:
        entry = {**_stage_shape(study, stage), "description": stage.description, "runs": {},
                 "best": plan.best.get(stage.name, {}),
                 "shapes": {name: planning.stage_arm(study, stage, name, {}).preset["model"]
                            for name in ("moe", "aoe") if name in {a.name for a in study.arms}}}
        for r in plan.of(stage.name):
            if r.status != planning.DONE:
                results["missing"].append({"stage": r.stage, "run_id": r.run_id, "seed": r.seed,
                                           "why": WHY[r.status]})
                continue
            paths = run_paths(out, r.arm, r.seed)
            run = entry["runs"].setdefault(r.run_id, {
                "arm": r.base, "label": study.arm(r.base).label, "overrides": r.overrides,
                "preset": r.arm.preset, "seeds": {}})
            run["seeds"][r.seed] = {key: json.loads(path.read_text()) for key, path in
                                    (("record", paths.record), ("finished", paths.finished),
                                     ("eval", paths.eval))}
        results["stages"][stage.name] = entry
    for w in plan.waiting:
        results["missing"] += [{"stage": w["stage"], "run_id": w["arm"], "seed": s,
                                "why": f"waiting: {w['why']}"} for s in w["seeds"]]
    return results
