"""results.json, report.md and the figures of a staged study, from the runner's ``results``.

``write_staged_report`` is the entry point; the numbers come from answers (contrasts, sanity,
tokens-to-reach, the gap over tokens), staged_tables (sweep, entropy, per-run rows, missing) and
flop_split; the markdown from staged_markdown. results.json is strict JSON (NaN written as null,
seeds as strings) and equals the dict returned.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from aoe_megatron.study import answers, plots_staged, staged_probes, staged_tables
from aoe_megatron.study.flop_split import stage_splits
from aoe_megatron.study.report import machine
from aoe_megatron.study.staged_markdown import markdown


def _listed(spec_or_list) -> list:
    return list(spec_or_list or [])


def analyse(report: dict, results: dict) -> dict:
    """Every number of the report (pure: no machine, no files). ``report``: the spec's report
    settings (baseline, answers, stage, sanity, reach, gap, sweep); absent settings are skipped."""
    stages = results.get("stages") or {}
    missing = list(results.get("missing") or [])
    at = report.get("stage")
    out = {"answers": [], "sanity": None, "reach": [], "gap": [], "sweep": None}
    for a in _listed(report.get("answers")):
        st = a.get("stage", at)  # an answer may name its own stage (the width stage's gap)
        c = answers.contrast(stages.get(st), st, a["arm"], a["reference"], missing=missing)
        out["answers"].append({"key": a.get("key"), "question": a.get("question", a.get("key")), **c})
    if report.get("sanity"):
        s = report["sanity"]
        out["sanity"] = answers.sanity(stages.get(s["stage"]), s["stage"], arm=s["arm"],
                                       reference=s["reference"], max_mean=float(s["max_mean"]),
                                       missing=missing)
    if report.get("reach"):
        r = report["reach"]
        out["reach"] = [answers.reach(stages.get(r["stage"]), r["stage"], arm, r["reference"],
                                      missing=missing) for arm in _listed(r.get("arms"))]
    if report.get("gap"):
        g = report["gap"]
        out["gap"] = [answers.gap(stages.get(st), st, arm, g["reference"], missing=missing)
                      for st in _listed(g.get("stages")) for arm in _listed(g.get("arms"))]
    if report.get("sweep"):
        st = report["sweep"]["stage"]
        out["sweep"] = {"stage": st, "arms": staged_tables.sweep(stages.get(st))}
    out["flops"] = {}
    for name, stage in stages.items():
        try:
            out["flops"][name] = _flop_splits(stage, report.get("baseline", "moe"))
        except (ValueError, KeyError, TypeError) as exc:  # a preset the model cannot build
            out["flops"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    out["entropy"] = {name: staged_tables.layer_entropy(stage) for name, stage in stages.items()}
    out["curves"] = {name: staged_tables.loss_curves(stage) for name, stage in stages.items()}
    out["stages"] = {name: _stage_summary(stage) for name, stage in stages.items()}
    out["runs"] = staged_tables.per_run(results)
    out["missing"] = staged_tables.missing_groups(missing)
    out["partial"] = bool(missing)
    return out


def _flop_splits(stage: dict, baseline: str) -> dict:
    return stage_splits(stage, prefer={"moe": baseline, "aoe": "aoe"})


def _stage_summary(stage: dict) -> dict:
    runs = stage.get("runs") or {}
    return {"steps": stage.get("steps"), "tokens_per_step": stage.get("tokens_per_step"),
            "runs": len(runs), "seeds_finished": sum(len(answers.finished(r)) for r in runs.values()),
            "best": stage.get("best") or {},
            "labels": {r.get("arm"): r.get("label", r.get("arm")) for r in runs.values()}}


def jsonable(value):
    """Strict-JSON data: NaN and infinities become None, keys strings, tuples lists."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def figures(doc: dict, out: Path) -> list:
    """The plots the data allow; the file names written."""
    made = [plots_staged.loss_vs_tokens(
                {s: {a: {"label": doc["stages"][s]["labels"].get(a, a),
                         "curves": [{float(t): v for t, v in c.items()} for c in e["curves"]]}
                     for a, e in arms.items()} for s, arms in doc["curves"].items()},
                out / "heldout_loss.png")]
    if doc.get("sweep"):
        made.append(plots_staged.sweep(doc["sweep"]["arms"], out / "sweep.png", stage=doc["sweep"]["stage"]))
    made.append(plots_staged.gap_vs_tokens(doc["gap"], out / "gap.png"))
    made.append(plots_staged.load_entropy(doc["entropy"], out / "load_entropy.png"))
    return [p.name for p in made if p is not None]


def write_staged_report(study, out: Path, results: dict, *, wall_seconds: float, command: str) -> dict:
    """Writes ``out``/results.json, report.md and the figures; returns the results.json dict.
    ``study``: .name, .description, .data, .report (the spec's report settings), .quick."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(getattr(study, "report", None) or {})
    doc = {"study": study.name, "quick": bool(study.quick), "description": study.description or "",
           "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": command, "machine": machine(), "data": study.data, "report_settings": report,
           **analyse(report, results)}
    doc["durations"] = staged_tables.durations(doc["runs"], wall_seconds=wall_seconds)
    doc["probes"], doc["table1"] = staged_probes.collect(results), staged_probes.table1(out)
    doc = jsonable(doc)
    doc["figures"] = figures(doc, out)
    (out / "results.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    (out / "report.md").write_text(markdown(doc))
    return doc
