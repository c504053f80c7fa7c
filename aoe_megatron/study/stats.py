"""The study's statistics, as pure functions of per-seed numbers (tests recompute them by hand).

- summary: mean and sample standard deviation (ddof 1) over seeds;
- paired: the difference arm - baseline seed by seed (same seed = same initialisation draw and the
  same data order), its mean, sample std, a two-sided 95% Student-t interval and the paired t-test
  p-value (scipy);
- curves: per-step mean, min and max over seeds of a metric read from metrics.jsonl.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def summary(values) -> dict:
    values = [float(v) for v in values]
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "std": std, "min": min(values), "max": max(values)}


def paired(arm: dict, baseline: dict, *, confidence: float = 0.95) -> dict:
    """``arm`` and ``baseline``: {seed: value}; uses the seeds both have."""
    from scipy import stats as st

    seeds = sorted(set(arm) & set(baseline))
    diffs = [float(arm[s]) - float(baseline[s]) for s in seeds]
    out = {"seeds": seeds, "differences": diffs, **(summary(diffs) if diffs else {"n": 0})}
    n = len(diffs)
    if n < 2:
        out.update(ci_low=float("nan"), ci_high=float("nan"), p_value=float("nan"), t_crit=float("nan"))
        return out
    t_crit = float(st.t.ppf(0.5 + confidence / 2, n - 1))
    half = t_crit * out["std"] / math.sqrt(n)
    if out["std"] > 0:
        p = float(st.ttest_rel([arm[s] for s in seeds], [baseline[s] for s in seeds]).pvalue)
    else:  # identical differences: no spread to test against
        p = 0.0 if out["mean"] != 0 else 1.0
    out.update(t_crit=t_crit, ci_low=out["mean"] - half, ci_high=out["mean"] + half, p_value=p)
    return out


def read_metrics(path) -> dict:
    """metrics.jsonl -> {"train": {step: record}, "valid": {step: loss}}; the last line of a step
    wins (a resumed run logs the steps after its checkpoint again)."""
    out = {"train": {}, "valid": {}}
    path = Path(path)
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") == "valid":
            out["valid"][int(rec["step"])] = float(rec["loss"])
        elif rec.get("kind") == "train":
            out["train"][int(rec["step"])] = rec
    return out


def layer_mean(record: dict, key: str) -> float:
    """A train record's ``key`` (ent_load, ent_conf) averaged over its MoE layers."""
    layers = record.get("layers") or {}
    return sum(v[key] for v in layers.values()) / len(layers) if layers else float("nan")


def band(series: list) -> dict:
    """``series``: one {step: value} per seed -> {"steps", "mean", "min", "max"} over the steps
    every seed has."""
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    mean = [sum(s[k] for s in series) / len(series) for k in steps]
    return {"steps": steps, "mean": mean, "min": [min(s[k] for s in series) for k in steps],
            "max": [max(s[k] for s in series) for k in steps]}


def smooth(series: dict, window: int) -> dict:
    """Trailing moving average of a {step: value} series."""
    steps = sorted(series)
    out, acc = {}, []
    for k in steps:
        acc.append(series[k])
        acc = acc[-window:]
        out[k] = sum(acc) / len(acc)
    return out
