"""The v1 evidence study (aoe-study default): its report and statistics, recomputed by hand, from
the quick mode's real records (tests/data/study_v1_quick: the training and evaluation behind them
run in tests/test_study_staged.py's quick v2 study, through the same functions); finished runs
reused; a changed spec refused; spec errors."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from aoe_megatron.study import stats
from aoe_megatron.study.spec import SpecError, load_study, study_from_dict

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "tests/data/study_v1_quick"
T_975_ONE_DOF = 12.706204736174698  # Student t, 97.5% quantile, 1 degree of freedom (tables)


@pytest.fixture(scope="module")
def quick_spec(study_data, tmp_path_factory):
    raw = yaml.safe_load((ROOT / "run/studies/default.yaml").read_text())
    raw["quick"]["data"] = str(study_data)
    raw["quick"]["table1"]["text"] = str(study_data.parent / "valid.jsonl")
    path = tmp_path_factory.mktemp("spec") / "default.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _study(spec, out, *extra):
    return subprocess.run([sys.executable, "-m", "aoe_megatron.cli.study", str(spec), "--quick",
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=900)


def _records(spec, out: Path) -> None:
    """The quick mode's records under ``out``, keyed to this session's corpus (the fingerprint
    hashes the data path; Table 1's settings name the held-out text)."""
    study = load_study(str(spec), quick=True)
    shutil.copytree(RECORDS, out)
    for arm in study.arms:
        for seed in study.seeds:
            path = out / "runs" / arm.name / f"seed{seed}" / "study-run.json"
            record = json.loads(path.read_text())
            record["fingerprint"] = arm.fingerprint(seed, study.data)
            path.write_text(json.dumps(record, indent=2) + "\n")
    path = out / "table1" / "table1.json"
    table1 = json.loads(path.read_text())
    table1["study_settings"] = study.table1
    path.write_text(json.dumps(table1, indent=2) + "\n")


@pytest.fixture(scope="module")
def quick_study(quick_spec, tmp_path_factory):
    """The report the recorded quick study gives (``--report-only``)."""
    out = tmp_path_factory.mktemp("study") / "out"
    _records(quick_spec, out)
    proc = _study(quick_spec, out, "--report-only")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_quick_study_writes_report_plots_and_hand_checked_statistics(quick_study, quick_spec):
    out, proc = quick_study
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["arms"]) == {"moe", "aoe"} and doc["seeds"] == [1, 2]
    for name in ("report.md", "loss.png", "entropy.png", "expert_load.png", "probe.png"):
        assert (out / name).stat().st_size > 1000, name
    # The Table 1 probe ran on the exported MoE baseline: the router row is the model itself.
    table1 = doc["table1"]
    assert (table1["arm"], table1["seed"]) == ("moe", 1) and table1["results"][0]["node"] == "router"
    assert {r["node"] for r in table1["results"]} == {"router", "gate", "up", "act", "prod", "out", "random"}
    assert "Table 1 probe" in (out / "report.md").read_text()
    # The produced numbers, read back from each run's own eval.json ...
    loss = {arm: {seed: json.loads((out / "runs" / arm / f"seed{seed}" / "eval.json").read_text())
                  ["heldout"]["loss"] for seed in (1, 2)} for arm in ("moe", "aoe")}
    for arm in ("moe", "aoe"):
        a, b = loss[arm][1], loss[arm][2]
        mean, std = (a + b) / 2, abs(a - b) / math.sqrt(2)  # ddof=1 with two values
        assert doc["arms"][arm]["heldout_loss"]["mean"] == pytest.approx(mean, rel=1e-12)
        assert doc["arms"][arm]["heldout_loss"]["std"] == pytest.approx(std, rel=1e-9)
        ppl = [math.exp(loss[arm][s]) for s in (1, 2)]
        assert doc["arms"][arm]["perplexity"]["mean"] == pytest.approx(sum(ppl) / 2, rel=1e-12)
    # ... and the paired comparison against the baseline, by hand.
    d = [loss["aoe"][s] - loss["moe"][s] for s in (1, 2)]
    d_mean, d_std = (d[0] + d[1]) / 2, abs(d[0] - d[1]) / math.sqrt(2)
    half = T_975_ONE_DOF * d_std / math.sqrt(2)
    vs = doc["arms"]["aoe"]["vs_baseline"]
    assert vs["mean"] == pytest.approx(d_mean, rel=1e-9, abs=1e-12)
    assert vs["ci_low"] == pytest.approx(d_mean - half, rel=1e-9, abs=1e-12)
    assert vs["ci_high"] == pytest.approx(d_mean + half, rel=1e-9, abs=1e-12)
    assert "vs_baseline" not in doc["arms"]["moe"]
    assert doc["contrasts"] == {"aoe": {}}  # compare_to: aoe, with no third arm in quick mode
    # The AoE arm ran on two processes with EP=2 through torch.distributed.run, and was probed.
    record = json.loads((out / "runs/aoe/seed1/study-run.json").read_text())
    assert "torch.distributed.run" in record["command"] and "--expert-model-parallel-size" in record["command"]
    assert doc["arms"]["aoe"]["world_size"] == 2 and doc["arms"]["aoe"]["expert_parallel_size"] == 2
    assert doc["arms"]["aoe"]["probe"]["layers"] and "probe" not in doc["arms"]["moe"]
    # Curves came from the training runs' metrics.jsonl (validation every 2 steps, 4 steps).
    metrics = stats.read_metrics(out / "runs/moe/seed2/metrics.jsonl")
    assert sorted(metrics["valid"]) == [2, 4] and sorted(metrics["train"]) == [1, 2, 3, 4]
    assert all(0.0 <= r["layers"]["1"]["ent_load"] <= math.log(4) + 1e-6 for r in metrics["train"].values())
    report = (out / "report.md").read_text()
    assert f"{doc['arms']['aoe']['heldout_loss']['mean']:.4f}" in report and "![loss](loss.png)" in report


def test_a_rerun_reuses_every_finished_run_and_trains_nothing(quick_study, quick_spec):
    """The study command itself (not --report-only) over finished runs: each run, its evaluation
    and Table 1 reused, the report rewritten. (An interrupted run resuming: the quick v2 study.)"""
    out, _ = quick_study
    before = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed*/eval.json")}
    proc = _study(quick_spec, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("finished earlier, reused") == 4
    assert "Table 1 probe: done earlier, reused" in proc.stdout
    assert "training" not in proc.stdout and "resuming" not in proc.stdout
    after = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed*/eval.json")}
    assert after == before  # nothing re-evaluated: the checkpoint step and settings are the same
    assert (out / "report.md").stat().st_mtime_ns > max(before.values())


def test_a_changed_spec_is_refused_not_mixed(quick_study, quick_spec, tmp_path):
    out, _ = quick_study
    raw = yaml.safe_load(quick_spec.read_text())
    raw["train"]["lr"] = 1.0e-3
    changed = tmp_path / "default.yaml"
    changed.write_text(yaml.safe_dump(raw))
    proc = _study(changed, out)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "holds a run that is not this one: it was trained with another spec" in proc.stderr


def test_paired_statistics_against_scipy_and_by_hand():
    from scipy import stats as st

    arm = {1: 3.10, 2: 3.25, 3: 3.05, 4: 3.20}
    base = {1: 3.20, 2: 3.30, 3: 3.15, 4: 3.22, 5: 9.9}  # seed 5 has no pair: left out
    out = stats.paired(arm, base)
    d = [arm[s] - base[s] for s in (1, 2, 3, 4)]
    mean = sum(d) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    half = st.t.ppf(0.975, 3) * sd / 2
    assert out["seeds"] == [1, 2, 3, 4] and out["mean"] == pytest.approx(mean)
    assert (out["ci_low"], out["ci_high"]) == pytest.approx((mean - half, mean + half))
    assert out["p_value"] == pytest.approx(st.ttest_rel([arm[s] for s in (1, 2, 3, 4)],
                                                        [base[s] for s in (1, 2, 3, 4)]).pvalue)
    assert stats.summary([1.0, 2.0, 4.0])["std"] == pytest.approx(math.sqrt(7 / 3))


def test_metrics_of_a_resumed_run_keep_the_last_line_of_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "train", "step": 1, "loss": 5.0}, {"kind": "train", "step": 2, "loss": 4.0},
             {"kind": "valid", "step": 2, "loss": 4.5}, {"kind": "train", "step": 2, "loss": 3.9}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    m = stats.read_metrics(path)
    assert m["train"][2]["loss"] == 3.9 and m["valid"] == {2: 4.5}
    assert stats.band([{1: 1.0, 2: 2.0}, {1: 3.0, 2: 0.0, 3: 1.0}]) == {
        "steps": [1, 2], "mean": [2.0, 1.0], "min": [1.0, 0.0], "max": [3.0, 2.0]}


@pytest.mark.parametrize("change, phrase", [
    (lambda r: r.update(color="red"), "unknown keys ['color']"),
    (lambda r: r.update(baseline="nope"), "baseline 'nope' is not an arm"),
    (lambda r: r["quick"].update(arms=["moe", "ghost"]), "unknown arms ['ghost']"),
    (lambda r: r["arms"][1].update(world_size=3), "does not divide world_size 3"),
    (lambda r: r["arms"][0]["model"].update(top_k=9), "arm moe"),
    (lambda r: r["quick"].update(seeds=[1, 1]), "seeds repeat"),
])
def test_bad_specs_name_the_problem(change, phrase):
    raw = yaml.safe_load((ROOT / "run/studies/default.yaml").read_text())
    change(raw)
    with pytest.raises(SpecError, match=__import__("re").escape(phrase)):
        study_from_dict(raw, quick=True)


def test_the_default_study_is_the_issue_s_design():
    study = load_study("default")
    assert len(study.seeds) >= 3 and study.baseline == "moe"
    models = {a.name: a.model for a in study.arms}
    assert models["moe"].arch == "moe" and models["aoe"].aoe_config(2).rank_source == "cache"
    assert models["random"].aoe_config().selection == "random"
    assert models["frozen"].aoe_config().rank_source == "frozen_random"
    assert models["config3"].aoe_config().rank_source == "router"
    assert any(a.expert_parallel_size == 2 and a.world_size == 2 for a in study.arms)
    assert "aoe" in study.probe["arms"]
