"""The staged study's report: its numbers recomputed by hand on a synthetic ``results``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from aoe_megatron.study import answers
from aoe_megatron.study.flop_split import split_of_model
from aoe_megatron.study.report_staged import analyse, write_staged_report

T_975_2 = 4.302652729911275  # Student t quantile, 0.975, 2 degrees of freedom (table)
STEPS = [200, 400, 600, 800, 1000]
TPS = 4096


def model(arch: str, d: int = 128, heads: int = 4, ffn: int = 256, low: int = 42) -> dict:
    return {"arch": arch, "num_layers": 4, "hidden_size": d, "num_attention_heads": heads,
            "ffn_hidden_size": ffn, "num_experts": 8, "top_k": 2, "vocab_size": 2048,
            "seq_length": 128, "aoe": {"d_low": low, "d_wide": "auto"}}


def seed_entry(curve: list, steps: list = STEPS, ent: float = 2.0) -> dict:
    """A seed's files: held-out losses ``curve`` at ``steps``, the last one final."""
    layers = {str(k): {"load": [1 / 8] * 8, "ent_conf": 1.0, "ent_load": ent + 0.01 * k} for k in range(4)}
    points = {str(s): {"loss": v, "perplexity": math.exp(v), "tokens": 1024, "layers": layers}
              for s, v in zip(steps, curve)}
    return {"record": {"train_seconds": 100.0}, "finished": {"steps": steps[-1], "final_loss": curve[-1]},
            "eval": {"step": steps[-1], "heldout": dict(points[str(steps[-1])]), "curve": points,
                     "eval_seconds": 10.0}}


def run(arm: str, curves: dict, *, lr: float | None = None, arch: str | None = None,
        steps: list = STEPS) -> tuple:
    overrides = {} if lr is None else {"lr": lr}
    rid = arm + (f"-lr{lr:g}" if lr is not None else "")
    arch = arch or ("moe" if arm.startswith("moe") or arm == "sanity" else "aoe")
    return rid, {"arm": arm, "label": arm.upper(), "overrides": overrides,
                 "preset": {"model": model(arch), "train": {"lr": lr or 2e-3}},
                 "seeds": {s: seed_entry(c, steps) for s, c in curves.items()}}


def finals(values: list, drop: float = 1.0) -> dict:
    """Three seeds whose curves fall linearly by ``drop`` per checkpoint to ``values``."""
    return {s + 1: [v + drop * (len(STEPS) - 1 - i) / 4 for i in range(len(STEPS))]
            for s, v in enumerate(values)}


def compare_stage() -> dict:
    runs = dict([
        run("moe", {1: [5.0, 4.6, 4.3, 4.1, 4.0], 2: [5.0, 4.6, 4.3, 4.1, 4.0], 3: [5.0, 4.6, 4.3, 4.1, 4.0]}),
        run("aoe", {1: [4.9, 4.5, 4.2, 3.95, 3.9], 2: [4.9, 4.5, 4.2, 4.1, 4.05], 3: [4.8, 4.5, 4.2, 4.0, 3.9]}),
        run("aoe_matched", finals([4.10, 4.20, 4.15])),
        run("config3", finals([4.20, 4.25, 4.30])),
        run("random", finals([4.40, 4.52, 4.45])),
    ])
    return {"steps": 1000, "tokens_per_step": TPS, "runs": runs, "best": {}}


def tune_stage(sanity_values: list) -> dict:
    tune_steps = [50, 100, 150, 200, 250]
    runs = dict([
        run("moe", {1: [5, 4.8, 4.6, 4.5, 4.40]}, lr=1e-3, steps=tune_steps),
        run("moe", {s: [5, 4.8, 4.6, 4.4, v] for s, v in zip((1, 2, 3), (4.30, 4.32, 4.31))}, lr=2e-3,
            steps=tune_steps),
        run("moe", {1: [5, 4.8, 4.6, 4.4, 4.25]}, lr=4e-3, steps=tune_steps),
        run("sanity", {s: [5, 4.8, 4.6, 4.4, v] for s, v in zip((1, 2, 3), sanity_values)}, lr=2e-3,
            steps=tune_steps),
        run("aoe", {1: [5, 4.8, 4.6, 4.5, 4.35]}, lr=2e-3, steps=tune_steps),
        run("aoe", {1: [5, 4.8, 4.6, 4.5, 4.45]}, lr=4e-3, steps=tune_steps),
    ])
    for lr, rate, loss in ((2e-3, 1e-3, 4.33), (4e-3, 1e-3, 4.36), (2e-3, 1e-2, 4.38)):  # a bias-rate grid
        rid, r = run("aoe_bias", {1: [5, 4.8, 4.6, 4.5, loss]}, lr=lr, steps=tune_steps)
        r["overrides"]["bias_update_rate"] = rate
        runs[f"aoe_bias-bias{rate:g}-lr{lr:g}"] = r
    best = {"moe": {"run_id": "moe-lr0.004", "overrides": {"lr": 4e-3}, "loss": 4.25, "edge": "high"},
            "aoe": {"run_id": "aoe-lr0.002", "overrides": {"lr": 2e-3}, "loss": 4.35, "edge": "low"}}
    return {"steps": 250, "tokens_per_step": TPS, "runs": runs, "best": best}


REPORT = {
    "baseline": "moe", "stage": "compare",
    "answers": [
        {"key": "self_selection", "question": "Self-selection vs router?", "arm": "aoe_matched",
         "reference": "config3"},
        {"key": "norms_informative", "question": "Norms vs random?", "arm": "aoe_matched", "reference": "random"},
        {"key": "aoe_vs_moe", "question": "AoE vs MoE", "arm": {"best_of": ["aoe", "aoe_matched"]},
         "reference": "moe"},
        {"key": "bias_moe", "question": "Bias balancing, MoE", "arm": "moe_bias", "reference": "moe"},
    ],
    "sanity": {"arm": "sanity", "reference": "moe", "stage": "tune", "max_mean": 0.02},
    "reach": {"arms": ["aoe", "aoe_matched"], "reference": "moe", "stage": "compare"},
    "gap": {"arms": [{"best_of": ["aoe", "aoe_matched"]}], "reference": "moe", "stages": ["compare", "width"]},
    "sweep": {"stage": "tune"},
}


def results(sanity_values=(4.301, 4.318, 4.312)) -> dict:
    missing = [{"stage": "compare", "run_id": "moe_bias-lr0.002", "seed": s, "why": "not run yet"} for s in (1, 2, 3)]
    missing += [{"stage": "width", "run_id": "moe-lr0.001", "seed": s, "why": "not run yet"} for s in (1, 2)]
    return {"stages": {"tune": tune_stage(list(sanity_values)), "compare": compare_stage()}, "missing": missing}


def test_paired_contrast_by_hand():
    doc = analyse(REPORT, results())
    a = doc["answers"][0]
    # diffs -0.10, -0.05, -0.15: mean -0.10, std 0.05
    half = T_975_2 * 0.05 / math.sqrt(3)
    assert a["n"] == 3 and a["mean"] == pytest.approx(-0.10)
    assert a["ci_low"] == pytest.approx(-0.10 - half) and a["ci_high"] == pytest.approx(-0.10 + half)
    assert "includes 0" in a["sentence"]
    b = doc["answers"][1]  # diffs -0.30, -0.32, -0.30: the whole interval below 0
    assert b["mean"] == pytest.approx(-0.92 / 3) and b["ci_high"] < 0
    assert "lower held-out loss" in b["sentence"]


def test_best_of_picks_the_lower_arm_and_not_run_answers():
    doc = analyse(REPORT, results())
    a = doc["answers"][2]
    # aoe: (3.9 + 4.05 + 3.9) / 3 = 3.95, below aoe_matched's (4.10 + 4.20 + 4.15) / 3 = 4.15
    assert a["candidates"] == pytest.approx({"aoe": 3.95, "aoe_matched": 4.15})
    assert a["arm_resolved"] == "aoe" and a["arm_run"] == "aoe"
    assert a["mean"] == pytest.approx(-0.05)  # against moe's 4.0 at every seed
    missing = doc["answers"][3]
    assert missing["status"] == "not yet run" and "moe_bias-lr0.002" in missing["why"]


def test_sanity_pass_fail_and_undecided():
    ok = analyse(REPORT, results())["sanity"]
    assert ok["verdict"] == "pass" and ok["reference_run"] == "moe-lr0.002"  # same lr, not the best
    assert ok["mean"] == pytest.approx((0.001 - 0.002 + 0.002) / 3)
    bad = analyse(REPORT, results((4.35, 4.37, 4.36)))
    assert bad["sanity"]["verdict"] == "fail" and bad["sanity"]["mean"] == pytest.approx(0.05)
    from aoe_megatron.study.staged_markdown import sanity_section
    assert "the AoE code path costs loss" in "\n".join(sanity_section(bad))
    r = results()
    r["stages"]["tune"]["runs"]["sanity-lr0.002"]["seeds"] = {1: r["stages"]["tune"]["runs"]["sanity-lr0.002"]["seeds"][1]}
    one = analyse(REPORT, r)["sanity"]
    assert one["verdict"] == "not decided" and "two or more" in one["why"]


def test_tokens_to_reach_interpolates_and_reports_not_reached():
    assert answers.tokens_to_reach([(0, 5.0), (10, 4.0), (20, 3.0)], 3.5) == pytest.approx(15.0)
    assert answers.tokens_to_reach([(10, 4.0), (20, 3.0)], 4.5) == 10.0
    assert answers.tokens_to_reach([(10, 4.0), (20, 3.9)], 3.5) is None
    reach = analyse(REPORT, results())["reach"][0]
    # seed 1: target 4.0, between (600, 4.2) and (800, 3.95): 600 + 0.2 / 0.25 * 200 = 760 steps
    assert reach["seeds"][1]["tokens"] == pytest.approx(760 * TPS)
    assert reach["seeds"][1]["ratio"] == pytest.approx(0.76)
    assert reach["reached"] == 2 and reach["not_reached"] == [2] and "ratio" not in reach
    # seed 3: between (600, 4.2) and (800, 4.0): exactly 800 steps
    assert reach["seeds"][3]["ratio"] == pytest.approx(0.8)


def test_gap_rows_and_json_seeds():
    r = results()
    g = analyse(REPORT, r)["gap"]
    assert g[1]["status"] == "not yet run"  # width has not run
    row = g[0]["rows"][0]  # aoe - moe at step 200: -0.1, -0.1, -0.2
    assert row["tokens"] == 200 * TPS and row["mean"] == pytest.approx(-0.4 / 3)
    back = json.loads(json.dumps(r))  # seeds become strings
    assert analyse(REPORT, back)["answers"][0]["mean"] == pytest.approx(-0.10)


def test_an_answer_at_its_own_stage(tmp_path: Path):
    """The width stage runs MoE and the arm compare picked: its answer is that pair at `width`."""
    r = results()
    width = dict([run("moe", {1: [4.0, 3.5], 2: [4.1, 3.6]}, lr=1e-3, steps=[500, 1000]),
                  run("aoe_matched", {1: [4.1, 3.58], 2: [4.2, 3.70]}, lr=1e-3, steps=[500, 1000])])
    r["stages"]["width"] = {"steps": 1000, "tokens_per_step": TPS, "runs": width, "best": {}}
    spec = {**REPORT, "answers": REPORT["answers"] + [
        {"key": "aoe_vs_moe_width", "question": "AoE vs MoE, wider", "stage": "width",
         "arm": {"best_of": ["aoe", "aoe_matched"]}, "reference": "moe"}]}
    doc = analyse(spec, r)
    w = doc["answers"][-1]
    # diffs 0.08, 0.10: mean 0.09, std sqrt(2) * 0.01, t_{0.975, 1} = 12.706
    assert w["stage"] == "width" and w["arm_resolved"] == "aoe_matched" and w["n"] == 2
    assert w["mean"] == pytest.approx(0.09)
    assert w["ci_high"] - w["mean"] == pytest.approx(12.706205 * 0.01, rel=1e-5)
    assert doc["answers"][2]["stage"] == "compare" and doc["answers"][2]["arm_resolved"] == "aoe"
    study = SimpleNamespace(name="v2", description="", data="d", report=spec, quick=False)
    write_staged_report(study, tmp_path, r, wall_seconds=1.0, command="c")
    line = next(x for x in (tmp_path / "report.md").read_text().splitlines() if "wider" in x)
    assert ", stage `width`)" in line and "`aoe_matched` is the one of them run at `width`" in line


def test_an_answer_at_an_unknown_stage_is_refused():
    import yaml

    from aoe_megatron.study.spec import SpecError, load_study, spec_path, study_from_dict

    raw = yaml.safe_load(spec_path("v2").read_text())
    raw["report"]["answers"][0]["stage"] = "widht"
    with pytest.raises(SpecError, match="widht"):
        study_from_dict(raw)
    assert [a.get("stage") for a in load_study("v2").report["answers"]].count("width") == 1


@pytest.mark.parametrize("shape,params,fractions", [
    (dict(d=128, heads=4, ffn=256, low=42), 3.67e6, {"moe_blocks": 0.55, "output_layer": 0.18, "attention": 0.27}),
    (dict(d=256, heads=8, ffn=512, low=85), 14.2e6, {"moe_blocks": 0.63}),
])
def test_flop_split_near_the_issue(shape, params, fractions):
    moe = split_of_model(model("moe", **shape))
    assert moe["params"]["total"] == pytest.approx(params, rel=0.01)
    for part, value in fractions.items():
        assert moe["fractions"][part] == pytest.approx(value, abs=0.01)
    aoe = split_of_model(model("aoe", **shape))
    assert aoe["params"]["total"] == pytest.approx(params, rel=0.01) and aoe["shape"]["d_wide"] > 0


def test_writer_on_partial_results(tmp_path: Path):
    study = SimpleNamespace(name="v2", description="synthetic", data="run/data.yaml", report=REPORT, quick=False)
    doc = write_staged_report(study, tmp_path, results(), wall_seconds=12.0, command="make study")
    text = (tmp_path / "report.md").read_text()
    assert "partial report" in text
    for rid in ("moe_bias-lr0.002", "moe-lr0.001"):
        assert rid in text.split("## Missing")[1]
    assert text.index("## Answers") < text.index("## Sanity") < text.index("## Per run")
    assert doc["figures"] and all((tmp_path / name).is_file() for name in doc["figures"])
    for name in doc["figures"]:
        assert f"]({name})" in text
    assert json.loads((tmp_path / "results.json").read_text()) == doc
    assert doc["durations"]["train_seconds"] == pytest.approx(100.0 * sum(1 for _ in doc["runs"]))


def test_writer_before_any_run(tmp_path: Path):
    study = SimpleNamespace(name="v2", description="", data="d", report=REPORT, quick=True)
    empty = {"stages": {"tune": {"steps": 250, "tokens_per_step": TPS, "runs": {}, "best": {}}},
             "missing": [{"stage": "tune", "run_id": "moe-lr0.002", "seed": 1, "why": "not run yet"}]}
    doc = write_staged_report(study, tmp_path, empty, wall_seconds=0.0, command="c")
    assert doc["figures"] == [] and not list(tmp_path.glob("*.png"))
    text = (tmp_path / "report.md").read_text()
    assert text.count("not yet run") >= len(REPORT["answers"]) and "**Not decided**" in text
