"""A staged study (run/studies/v2.yaml): the schema's errors, the plan read from run folders
(sweeps, the extra rate at an edge, carried and scaled rates, best_of, per-group seeds), the time
budget, the partial results naming what is missing; and the quick mode end to end through the
real entry points (training, every checkpoint evaluated, checkpoints deleted, the report)."""

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from aoe_megatron.study import plan as planning
from aoe_megatron.study import staged
from aoe_megatron.study.runner import StudyError, run_paths
from aoe_megatron.study.spec import SpecError, load_study, study_from_dict

ROOT = Path(__file__).resolve().parents[1]
V2 = yaml.safe_load((ROOT / "run/studies/v2.yaml").read_text())


def _spec(stages, arms=("moe", "aoe", "aoe_matched")):
    raw = copy.deepcopy(V2)
    raw["arms"] = [a for a in raw["arms"] if a["name"] in arms]
    raw["stages"] = stages
    raw.pop("report")
    return study_from_dict(raw)


def _finish(study, out, run, loss, seconds=60.0):
    """What a run leaves once trained and evaluated (the records the plan reads)."""
    paths = run_paths(out, run.arm, run.seed)
    paths.root.mkdir(parents=True, exist_ok=True)
    steps = run.arm.preset["train"]["train_iters"]
    paths.record.write_text(json.dumps({"fingerprint": run.arm.fingerprint(run.seed, study.data),
                                        "finished": True, "train_seconds": seconds}))
    paths.finished.write_text(json.dumps({"steps": steps, "final_loss": loss}))
    paths.eval.write_text(json.dumps({"step": steps, "heldout": {"loss": loss}, "eval_seconds": 0.0}))


def _runs(plan, stage):
    return {(r.run_id, r.seed): r for r in plan.of(stage)}


SWEEP = [{"name": "tune", "train": {"train_iters": 250}, "minutes_per_run": 3,
          "groups": [{"arms": ["moe", "aoe", "aoe_matched"], "seeds": [1],
                      "sweep": {"lr": [1.0e-3, 2.0e-3, 4.0e-3]}, "extend_at_edge": True},
                     {"arms": ["moe"], "seeds": [1, 2], "set": {"lr": 2.0e-3}}]},
         {"name": "compare", "train": {"train_iters": 1000},
          "groups": [{"arms": ["moe", "aoe", "aoe_matched"], "seeds": [1, 2], "from": "tune"}]},
         {"name": "width", "model": {"hidden_size": 256, "num_attention_heads": 8},
          "groups": [{"arms": ["moe", {"best_of": ["aoe", "aoe_matched"], "stage": "compare"}],
                      "seeds": [1], "from": "tune", "scale": {"lr": 0.5}}]}]


def test_sweep_edge_carry_scale_and_best_of_follow_the_results(tmp_path):
    study = _spec(SWEEP)
    plan = planning.make_plan(study, tmp_path)
    runs = _runs(plan, "tune")
    # three rates for every arm at seed 1, and MoE's 2e-3 once more at seed 2 (the same run id)
    assert sorted(runs) == sorted([(f"{a}-lr{lr}", 1) for a in ("moe", "aoe", "aoe_matched")
                                   for lr in ("0.001", "0.002", "0.004")] + [("moe-lr0.002", 2)])
    assert runs[("moe-lr0.004", 1)].arm.preset["train"]["min_lr"] == pytest.approx(4e-4)
    assert plan.of("compare") == [] and len(plan.waiting) == 3 + 2
    loss = {"moe": {1e-3: 3.0, 2e-3: 2.9, 4e-3: 2.8}, "aoe": {1e-3: 3.1, 2e-3: 3.0, 4e-3: 3.2},
            "aoe_matched": {1e-3: 2.95, 2e-3: 3.0, 4e-3: 3.1}}
    for r in plan.of("tune"):
        _finish(study, tmp_path, r, loss[r.base][r.overrides["lr"]] + (0.5 if r.seed == 2 else 0))
    plan = planning.make_plan(study, tmp_path)
    # best at an edge: one more rate beyond it (x2 above, /2 below); none in the middle
    extra = {k for k in _runs(plan, "tune") if k[0] not in {f"{a}-lr{lr}" for a in loss
                                                           for lr in ("0.001", "0.002", "0.004")}}
    assert extra == {("moe-lr0.008", 1), ("aoe_matched-lr0.0005", 1)}
    assert "moe" not in plan.best["tune"] and plan.best["tune"]["aoe"]["overrides"] == {"lr": 2e-3}
    # aoe's best is decided: its compare runs can start before the other arms' extra rates end
    assert [(r.stage, r.run_id) for r in planning.select(plan)] == [
        ("tune", "moe-lr0.008"), ("tune", "aoe_matched-lr0.0005"), ("compare", "aoe-lr0.002"),
        ("compare", "aoe-lr0.002")]
    for r in planning.select(plan, stages=("tune",)):
        _finish(study, tmp_path, r, {"moe": 2.85, "aoe_matched": 2.9}[r.base])
    plan = planning.make_plan(study, tmp_path)
    best = plan.best["tune"]
    # moe's 2e-3 ran at seeds 1 and 2: rates compare at the seed they share (seed 1: 2.8 best)
    assert best["moe"] == {"run_id": "moe-lr0.004", "overrides": {"lr": 4e-3}, "loss": 2.8, "edge": None}
    assert best["aoe_matched"]["overrides"] == {"lr": 5e-4} and best["aoe_matched"]["edge"] == "low"
    compare = _runs(plan, "compare")
    assert sorted(compare) == sorted((f"{a}-lr{lr}", s) for a, lr in
                                     (("moe", "0.004"), ("aoe", "0.002"), ("aoe_matched", "0.0005"))
                                     for s in (1, 2))
    assert [r.seed for r in plan.of("compare")] == [1, 1, 1, 2, 2, 2]  # seed-major
    for r in plan.of("compare"):
        _finish(study, tmp_path, r, {"moe": 2.5, "aoe": 2.7, "aoe_matched": 2.6}[r.base])
    plan = planning.make_plan(study, tmp_path)
    width = _runs(plan, "width")
    # the better AoE arm of compare (aoe_matched), both at half their best rate of tune
    assert sorted(width) == [("aoe_matched-lr0.00025", 1), ("moe-lr0.002", 1)]
    assert width[("moe-lr0.002", 1)].arm.model.hidden_size == 256
    assert width[("moe-lr0.002", 1)].arm.folder == "width/moe-lr0.002"
    assert plan.waiting == []


def test_the_budget_starts_only_runs_that_fit_and_the_report_names_the_rest(tmp_path, monkeypatch):
    study = _spec(SWEEP)
    started = []

    def fake_execute(study_, out, run, *, echo=print, **_):
        started.append(run.key)
        _finish(study_, out, run, 3.0 - 0.001 * len(started), seconds=100.0)

    monkeypatch.setattr(staged, "execute", fake_execute)
    lines = []
    # minutes_per_run 3: nothing fits in 2 minutes
    assert staged.run_staged(study, tmp_path, budget_minutes=2, echo=lines.append) == []
    assert any("left for a later invocation: tune/moe-lr0.001 seed 1: about 3.0 min" in l for l in lines)
    # every run fits once estimates come from done runs (100 s each): the filters choose
    staged.run_staged(study, tmp_path, arms=("moe",), seeds=(1,), budget_minutes=60, echo=lines.append)
    assert started == [("tune", "moe-lr0.001", 1), ("tune", "moe-lr0.002", 1),
                       ("tune", "moe-lr0.004", 1), ("tune", "moe-lr0.008", 1)]
    plan = planning.make_plan(study, tmp_path)
    run = _runs(plan, "tune")[("moe-lr0.002", 2)]
    assert planning.estimate_seconds(study, tmp_path, plan, run) == pytest.approx(100.0)
    results = staged.collect_staged(study, tmp_path)
    assert set(results["stages"]["tune"]["runs"]) == {"moe-lr0.001", "moe-lr0.002", "moe-lr0.004",
                                                      "moe-lr0.008"}
    missing = {(m["stage"], m["run_id"], m["seed"]): m["why"] for m in results["missing"]}
    assert missing[("tune", "moe-lr0.002", 2)] == "not run yet"
    assert missing[("compare", "aoe", 1)].startswith("waiting: aoe's best settings in stage tune")
    assert ("width", "best of aoe/aoe_matched at compare", 1) in missing
    assert results["stages"]["tune"]["tokens_per_step"] == 32 * 128


def test_jobs_train_runs_at_once_and_a_failure_starts_no_other(tmp_path, monkeypatch):
    """--jobs 2: two runs in flight at once (each waits at a barrier for the other), each told it
    shares the cores and given the index lock; when one fails, the other finishes, nothing else
    starts, and the failure is raised."""
    import threading

    study = _spec(SWEEP)
    started, together = [], threading.Barrier(2, timeout=30)

    def fake_execute(study_, out, run, *, echo=print, jobs=1, index_lock=None):
        started.append((run.key, jobs, index_lock is not None))
        if len(started) <= 2:
            together.wait()  # breaks (and fails the run) unless both are in flight at once
        _finish(study_, out, run, 3.0 - 0.001 * len(started), seconds=100.0)

    monkeypatch.setattr(staged, "execute", fake_execute)
    lines = []
    staged.run_staged(study, tmp_path / "ok", arms=("moe",), seeds=(1,), jobs=2, echo=lines.append)
    assert [k for k, _, _ in started[:2]] == [("tune", "moe-lr0.001", 1), ("tune", "moe-lr0.002", 1)]
    assert {(jobs, locked) for _, jobs, locked in started} == {(2, True)}
    plan = planning.make_plan(study, tmp_path / "ok")
    assert list(planning.select(plan, arms=("moe",), seeds=(1,))) == []  # nothing left to run
    assert len(started) == len([r for r in plan.runs if r.base == "moe" and r.seed == 1])

    started.clear()
    ended = []

    def failing(study_, out, run, *, echo=print, jobs=1, index_lock=None):
        started.append(run.key)
        if len(started) == 1:
            raise StudyError("the first run failed")
        time.sleep(0.5)  # still running when the failure is seen
        _finish(study_, out, run, 3.0)
        ended.append(run.key)

    monkeypatch.setattr(staged, "execute", failing)
    with pytest.raises(StudyError, match="the first run failed"):
        staged.run_staged(study, tmp_path / "fail", arms=("moe",), jobs=2, echo=lines.append)
    assert len(started) == 2 and ended == [started[1]]
    assert any("failed: no other run starts; waiting for the 1 running" in l for l in lines)


def test_each_of_several_jobs_gets_its_share_of_the_cores(tmp_path, monkeypatch):
    import os

    study = _spec(SWEEP)
    run = planning.make_plan(study, tmp_path).of("tune")[0]
    seen = {}
    monkeypatch.setattr(staged, "train_one", lambda *a, threads=None, index_lock=None, **k:
                        seen.update(train=threads, lock=index_lock))
    monkeypatch.setattr(staged, "evaluate_one", lambda *a, threads=None, **k: seen.update(eval=threads))
    staged.execute(study, tmp_path, run, echo=lambda line: None)
    assert seen == {"train": None, "lock": None, "eval": None}  # one job: the defaults
    lock = object()
    staged.execute(study, tmp_path, run, echo=lambda line: None, jobs=2, index_lock=lock)
    cores = os.cpu_count() or 1
    assert seen == {"train": max(1, cores // (2 * run.arm.world_size)), "lock": lock,
                    "eval": max(1, cores // 2)}


@pytest.mark.parametrize("change,phrase", [
    (lambda s: s[0].update(name="compare"), "unique name"),
    (lambda s: s[1]["groups"][0].update({"from": "width"}), "is not an earlier stage"),
    (lambda s: s[2]["groups"][0]["arms"][1].update(stage="width"), "best_of needs the stage"),
    (lambda s: s[0]["groups"][0]["arms"].append("ghost"), "unknown arm 'ghost'"),
    (lambda s: s[0]["groups"][1].update(sweep={"lr": [1e-3, 2e-3]}), "both set and swept"),
    (lambda s: s[0]["groups"][1].update(extend_at_edge=True), "extend_at_edge needs an lr sweep"),
    (lambda s: s[0]["groups"][0].update(sweep={"dropout": [0.1]}), "sweep names ['dropout']"),
    (lambda s: s[0].update(checkpoints="some"), "checkpoints is keep or delete"),
])
def test_bad_stages_name_the_problem(change, phrase):
    stages = copy.deepcopy(SWEEP)
    change(stages)
    with pytest.raises(SpecError, match=__import__("re").escape(phrase)):
        _spec(stages)


def test_the_v2_spec_is_the_issue_s_design():
    study = load_study("v2")
    models = {a.name: a.model for a in study.arms}
    assert models["aoe_matched"].aoe_config().gate_init == "unfactorized_std"
    assert models["config3"].aoe_config().rank_source == "router"
    assert models["random"].aoe_config().selection == "random" and models["random"].alpha_aux == 0
    assert models["sanity"].aoe_config().factorized == "none"
    assert models["moe_bias"].expert_bias and models["moe_bias"].router.score_function == "sigmoid"
    plan = planning.make_plan(study, Path("/nonexistent"))
    tune = plan.of("tune")
    assert len({r.run_id for r in tune if r.base == "moe"}) == 3
    assert {r.seed for r in tune if r.base == "sanity"} == {1, 2, 3} == \
        {r.seed for r in tune if r.run_id == "moe-lr0.002"}
    assert len([r for r in tune if r.base == "aoe_bias"]) == 6  # 3 rates x 2 bias rates
    arm = tune[0].arm
    assert arm.model.vocab_size == 2048 and arm.preset["train"]["train_iters"] == 250
    assert {w["arm"] for w in plan.waiting if w["stage"] == "compare"} == {
        "moe", "aoe", "aoe_matched", "config3", "random", "aoe_bias", "moe_bias"}


@pytest.mark.slow
def test_quick_v2_trains_evaluates_every_checkpoint_and_reports(study_data, tmp_path):
    """Through ``aoe-study v2 --quick``: a 2-rate sweep, the rates carried to compare, every
    checkpoint held out, tune's checkpoints deleted (compare's kept here), Table 1 on compare's
    MoE, the report; then ``--plan`` says everything is done, and a second invocation resumes the
    one run made to look interrupted (its checkpoint there, its record not finished) and trains
    nothing else."""
    raw = copy.deepcopy(V2)
    raw["quick"].update(data=str(study_data))
    raw["quick"]["table1"]["text"] = str(study_data.parent / "valid.jsonl")
    compare = next(s for s in raw["quick"]["stages"] if s["name"] == "compare")
    compare["checkpoints"] = "keep"
    spec = tmp_path / "v2.yaml"
    spec.write_text(yaml.safe_dump(raw))
    out = tmp_path / "v2"
    cmd = [sys.executable, "-m", "aoe_megatron.cli.study", str(spec), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = load_study(str(spec), quick=True)
    plan = planning.make_plan(study, out)
    assert {r.status for r in plan.runs} == {planning.DONE} and len(plan.runs) == 2 + 2
    best = plan.best["tune"]
    for r in plan.runs:
        paths = run_paths(out, r.arm, r.seed)
        evaluation = json.loads(paths.eval.read_text())
        assert sorted(evaluation["curve"], key=int) == ["2", "4"]  # save_interval 2, 4 steps
        assert evaluation["curve"]["4"] == evaluation["heldout"]
        assert evaluation["curve"]["2"]["loss"] != evaluation["curve"]["4"]["loss"]
        deleted = r.stage == "tune"  # deleted once evaluated; compare keeps them here
        assert paths.ckpt.exists() != deleted
        assert json.loads(paths.record.read_text()).get("checkpoints_deleted", False) is deleted
        if r.stage == "compare" and r.base == "moe":  # at its best rate of tune
            assert r.overrides == best[r.base]["overrides"]
            assert ("probe" in evaluation) == (r.base == "aoe_matched")
    losses = {r.run_id: json.loads(run_paths(out, r.arm, 1).eval.read_text())["heldout"]["loss"]
              for r in plan.of("tune") if r.base == "moe"}
    assert best["moe"]["loss"] == min(losses.values())
    table1 = json.loads((out / "table1" / "table1.json").read_text())
    assert table1["arm"] == best["moe"]["run_id"] and table1["results"]
    report = (out / "report.md").read_text()
    assert "partial" not in report.lower().split("##")[0] and "## Answers" in report
    assert "## Norm probe: `aoe_matched-lr0.004` at `compare`" in report  # the falsifier
    assert f"| router ({table1['results'][0]['label']}) | {table1['results'][0]['loss']:.4f}" in report
    again = subprocess.run(cmd + ["--plan"], capture_output=True, text=True, timeout=120)
    assert "stage compare: 2 runs planned (2 done)" in again.stdout, again.stdout
    # As if the study died after compare's MoE run saved its last checkpoint, before its record
    interrupted = next(r for r in plan.of("compare") if r.base == "moe")
    paths = run_paths(out, interrupted.arm, interrupted.seed)
    record = json.loads(paths.record.read_text())
    paths.record.write_text(json.dumps({**record, "finished": False}))
    before = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/seed*/eval.json")}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count(": resuming (") == 1 and "training (" not in again.stdout, again.stdout
    assert f"{interrupted.arm.name} seed 1: resuming" in again.stdout, again.stdout
    log = paths.log.read_text().split("$ ")[-1]
    assert "resumed from" in log and "step       1/" not in log
    after = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/seed*/eval.json")}
    assert after == before and len(before) == 4  # nothing re-evaluated: same step, same settings
