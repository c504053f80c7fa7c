"""A staged study's plan, read from its run folders: every run the stages ask for, in the order
they run (stage by stage, seed-major inside a stage), each finished, started, to do or waiting
on an earlier result; the best settings of each arm per stage; and duration estimates for a time
budget. Nothing here trains: ``study.staged`` runs what the plan says."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from aoe_megatron.checkpoint.layout import checkpoints
from aoe_megatron.models.gpt import merge_settings
from aoe_megatron.study.runner import run_paths
from aoe_megatron.study.spec import Arm, Study
from aoe_megatron.study.stages import apply_overrides, carried, edge_extension, run_id, sweep_points

DONE, TRAINED, STARTED, TODO, WAITING = "done", "trained", "started", "to do", "waiting"


@dataclass(frozen=True)
class PlannedRun:
    stage: str
    run_id: str
    arm: Arm  # the catalog arm with the stage's settings and the overrides: name = run id
    base: str  # the catalog arm's name
    overrides: dict
    seed: int
    status: str = TODO
    why: str = ""  # WAITING: on what

    @property
    def key(self) -> tuple:
        return (self.stage, self.run_id, self.seed)


@dataclass
class Plan:
    runs: list = field(default_factory=list)
    best: dict = field(default_factory=dict)
    """{stage: {arm: {"run_id", "overrides", "loss", "edge"}}}: decided once every run of the arm
    in that stage is done."""
    waiting: list = field(default_factory=list)
    """Group arms that could not be expanded yet: {"stage", "arm", "why", "seeds"}."""

    def of(self, stage: str) -> list:
        return [r for r in self.runs if r.stage == stage]


def _read(path: Path):
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def stage_arm(study: Study, stage, base: str, overrides: dict) -> Arm:
    """The catalog arm ``base`` as it runs in ``stage`` with ``overrides``."""
    arm = study.arm(base)
    preset = {"model": merge_settings(arm.preset["model"], stage.model),
              "train": merge_settings(arm.preset["train"], stage.train)}
    rid = run_id(base, overrides)
    return replace(arm, name=rid, preset=apply_overrides(preset, overrides),
                   folder=f"{stage.name}/{rid}")


def final_loss(out: Path, run: PlannedRun):
    """The held-out loss of a done run's last checkpoint, or None."""
    evaluation = _read(run_paths(out, run.arm, run.seed).eval)
    return evaluation["heldout"]["loss"] if evaluation else None


def status_of(study: Study, out: Path, arm: Arm, seed: int) -> str:
    paths = run_paths(out, arm, seed)
    record = _read(paths.record)
    if not record or record.get("fingerprint") != arm.fingerprint(seed, study.data):
        return STARTED if paths.root.is_dir() and record else TODO
    if not (record.get("finished") and paths.finished.is_file()):
        return STARTED
    evaluation = _read(paths.eval)
    steps = (_read(paths.finished) or {}).get("steps")
    return DONE if evaluation and evaluation.get("step") == steps else TRAINED


def _best(out: Path, runs: list) -> dict | None:
    """Lowest mean final held-out loss over the settings of one arm's runs (all done), or None;
    the mean is over the seeds every setting has (a sweep at one seed beside more seeds at one
    rate compares at that seed)."""
    if not runs or any(r.status != DONE for r in runs):
        return None
    by_id: dict = {}
    for r in runs:
        by_id.setdefault(r.run_id, (r.overrides, {}))[1][r.seed] = final_loss(out, r)
    shared = set.intersection(*(set(ls) for _, ls in by_id.values()))  # compare at equal seeds
    means = {rid: (ov, sum(ls[s] for s in (shared or ls)) / len(shared or ls))
             for rid, (ov, ls) in by_id.items()}
    rid = min(means, key=lambda k: means[k][1])
    overrides, loss = means[rid]
    rates = sorted({ov.get("lr") for ov, _ in means.values() if ov.get("lr") is not None})
    edge = None
    if len(rates) > 1 and overrides.get("lr") == rates[0]:
        edge = "low"
    elif len(rates) > 1 and overrides.get("lr") == rates[-1]:
        edge = "high"
    return {"run_id": rid, "overrides": overrides, "loss": loss, "edge": edge}


def make_plan(study: Study, out: Path) -> Plan:
    plan = Plan()
    for stage in study.stages:
        runs: dict = {}

        def add(base: str, overrides: dict, seeds, position: int) -> None:
            arm = stage_arm(study, stage, base, overrides)
            for seed in seeds:
                key = (arm.name, seed)
                if key not in runs:
                    runs[key] = (position, PlannedRun(stage.name, arm.name, arm, base, dict(overrides), seed,
                                                      status_of(study, out, arm, seed)))

        position = 0
        for group in stage.groups:
            for ref in group.arms:
                position += 1
                base, why = ref.name, ""
                if ref.best_of:
                    picks = {n: plan.best.get(ref.stage, {}).get(n) for n in ref.best_of}
                    if all(picks.values()):
                        base = min(picks, key=lambda n: picks[n]["loss"])
                    else:
                        why = f"{ref}: not every arm finished there"
                if not why and group.source:
                    best = plan.best.get(group.source, {}).get(base)
                    if best is None:
                        why = f"{base}'s best settings in stage {group.source} are not decided yet"
                if why:
                    plan.waiting.append({"stage": stage.name, "arm": str(ref), "why": why,
                                         "seeds": list(group.seeds),
                                         "candidates": list(ref.best_of or (ref.name,))})
                    continue
                if group.source:
                    add(base, carried(group, plan.best[group.source][base]["overrides"]),
                        group.seeds, position)
                    continue
                points = sweep_points(group) if group.sweep else [dict(group.set)]
                for overrides in points:
                    add(base, overrides, group.seeds, position)
                swept = [runs[(run_id(base, ov), s)][1] for ov in points for s in group.seeds]
                best = _best(out, swept)
                extra = edge_extension(group, best["overrides"]) if best else None
                if extra:
                    add(base, extra, group.seeds, position)
        ordered = sorted(runs.values(), key=lambda pr: (pr[1].seed, pr[0]))
        plan.runs += [pr[1] for pr in ordered]
        stage_best = {}
        for base in {pr[1].base for pr in ordered}:
            mine = [pr[1] for pr in ordered if pr[1].base == base]
            pending = any(w["stage"] == stage.name and base in w["candidates"] for w in plan.waiting)
            best = None if pending else _best(out, mine)
            if best:
                stage_best[base] = best
        plan.best[stage.name] = stage_best
    return plan


def select(plan: Plan, *, stages=(), arms=(), seeds=()) -> list:
    """The runs still to do (or resume, or evaluate) that match the filters, in plan order."""
    return [r for r in plan.runs if r.status in (TODO, STARTED, TRAINED)
            and (not stages or r.stage in stages) and (not arms or r.base in arms)
            and (not seeds or r.seed in seeds)]


def run_seconds(out: Path, run: PlannedRun) -> float | None:
    record = _read(run_paths(out, run.arm, run.seed).record) or {}
    evaluation = _read(run_paths(out, run.arm, run.seed).eval) or {}
    if run.status != DONE:
        return None
    return float(record.get("train_seconds", 0.0)) + float(evaluation.get("eval_seconds", 0.0))


RECENT = 5
"""Runs an estimate reads: the machine's load changes, so the latest say most."""


def _recent_median(out: Path, runs: list) -> float | None:
    """The median seconds of the ``RECENT`` runs of ``runs`` that finished last."""
    timed = [(run_paths(out, r.arm, r.seed).record.stat().st_mtime, run_seconds(out, r))
             for r in runs]
    latest = sorted(s for _, s in sorted(t for t in timed if t[1])[-RECENT:])
    if not latest:
        return None
    mid = len(latest) // 2
    return latest[mid] if len(latest) % 2 else (latest[mid - 1] + latest[mid]) / 2


def estimate_seconds(study: Study, out: Path, plan: Plan, run: PlannedRun) -> float | None:
    """A run's expected seconds: the median of the last ``RECENT`` done runs of its stage and
    arm, else of its stage, else the stage's ``minutes_per_run``; less the part a started run has
    done (its last checkpoint's step); None when nothing is known."""
    done = [r for r in plan.of(run.stage) if r.status == DONE]
    stage = next(s for s in study.stages if s.name == run.stage)
    seconds = (_recent_median(out, [r for r in done if r.base == run.base])
               or _recent_median(out, done) or stage.minutes_per_run * 60 or None)
    if seconds is None:
        return None
    if run.status in (STARTED, TRAINED):
        steps = int(run.arm.preset["train"].get("train_iters", 0)) or 1
        done_steps = _last_step(run_paths(out, run.arm, run.seed).ckpt)
        seconds *= max(0.1, 1 - done_steps / steps)
    return seconds


def _last_step(ckpt: Path) -> int:
    kept = checkpoints(ckpt)
    return int(kept[-1].name.split("_")[-1]) if kept else 0
