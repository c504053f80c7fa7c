"""The staged study's answers, as pure functions of the runner's ``results`` (no torch, no files).

A stage is ``results["stages"][name]``: {"steps", "tokens_per_step", "runs": {run_id: run},
"best": {arm: {"run_id", "overrides", "loss", "edge"}}}; a run is {"arm", "label", "overrides",
"preset", "seeds": {seed: {"record", "finished", "eval"}}}. A seed counts once its evaluation
holds a held-out loss. An arm is a catalog name or {"best_of": [names]}: the one of those with
the lowest mean final held-out loss at the stage.

- contrast: the paired difference arm - reference of the final held-out loss, seed by seed
  (stats.paired: mean, Student-t 95% interval, paired t-test);
- sanity: MoE through the AoE code path against MoE; passes iff the 95% interval of the
  difference contains 0 and |mean| < max_mean;
- reach: the training tokens the arm's held-out curve needs to reach the reference's final
  held-out loss at the same seed (linear between checkpoints), over the reference's tokens;
- gap: the paired difference of the held-out curves at every checkpoint step both have.
"""

from __future__ import annotations

import math

from aoe_megatron.study import stats


def seed_key(seed):
    """Seeds are ints in the runner's structure and strings once through JSON: one key for both."""
    return int(seed) if isinstance(seed, str) and seed.lstrip("-").isdigit() else seed


def finished(run: dict) -> dict:
    """{seed: seed entry} of the run's evaluated seeds."""
    return {seed_key(s): e for s, e in (run.get("seeds") or {}).items()
            if ((e or {}).get("eval") or {}).get("heldout", {}).get("loss") is not None}


def final_losses(run: dict | None) -> dict:
    return {s: float(e["eval"]["heldout"]["loss"]) for s, e in finished(run or {}).items()}


def curve(entry: dict) -> dict:
    """{step: held-out loss} of a seed: every kept checkpoint and the final evaluation."""
    ev = entry["eval"]
    out = {int(k): float(v["loss"]) for k, v in (ev.get("curve") or {}).items()}
    step = ev.get("step", (entry.get("finished") or {}).get("steps"))
    if step is not None:
        out.setdefault(int(step), float(ev["heldout"]["loss"]))
    return out


def mean_loss(run: dict | None) -> float | None:
    losses = final_losses(run)
    return sum(losses.values()) / len(losses) if losses else None


def arm_run(stage: dict | None, arm: str, *, like: dict | None = None):
    """(run_id, run) representing ``arm`` at a stage, or (None, None): its one run; else the run
    with the overrides ``like``; else the stage's best; else the run with the most seeds."""
    runs = {rid: r for rid, r in ((stage or {}).get("runs") or {}).items() if r.get("arm") == arm}
    if not runs:
        return None, None
    if len(runs) == 1:
        return next(iter(runs.items()))
    if like is not None:
        for rid, r in runs.items():
            if (r.get("overrides") or {}) == like and finished(r):
                return rid, r
    best = ((stage.get("best") or {}).get(arm) or {}).get("run_id")
    if best in runs:
        return best, runs[best]
    rid = max(runs, key=lambda k: (len(finished(runs[k])), -(mean_loss(runs[k]) or math.inf)))
    return rid, runs[rid]


def arm_name(spec) -> str:
    return spec if isinstance(spec, str) else "best of " + "/".join(spec["best_of"])


def resolve(stage: dict | None, spec) -> dict:
    """{"name", "run_id", "run", "spec", "candidates": {arm: mean loss or None}}; name None when
    no candidate has a finished seed at the stage."""
    names = [spec] if isinstance(spec, str) else list(spec["best_of"])
    picked = {a: arm_run(stage, a) for a in names}
    means = {a: mean_loss(run) for a, (_, run) in picked.items()}
    done = [a for a in names if means[a] is not None]
    name = min(done, key=lambda a: means[a]) if done else None
    rid, run = picked[name] if name else (None, None)
    return {"name": name, "run_id": rid, "run": run, "spec": arm_name(spec), "candidates": means}


def _missing_note(stage_name: str, arms: list, missing: list) -> str:
    """Which of ``arms`` have no finished run at the stage, with the runs the runner lists missing."""
    parts = []
    for arm in arms:
        ids = sorted({m["run_id"] for m in missing if m.get("stage") == stage_name
                      and (m["run_id"] == arm or m["run_id"].startswith(arm + "-"))})
        parts.append(f"`{arm}` has no finished run at `{stage_name}`"
                     + (f" (missing: {', '.join(ids)})" if ids else ""))
    return "; ".join(parts)


def _not_run(stage_name: str, pairs: list, missing: list) -> str:
    """The "not yet run" note of (spec, resolved) pairs whose arm has no finished seed."""
    names = [n for spec, res in pairs if res["name"] is None
             for n in ([spec] if isinstance(spec, str) else spec["best_of"])]
    return _missing_note(stage_name, names, missing)


def direction(c: dict, arm: str, ref: str) -> str:
    """One plain sentence from the numbers of a paired contrast (arm - reference, lower is better)."""
    n = c.get("n", 0)
    if n < 2:
        return (f"One seed only: `{arm}` minus `{ref}` is {c['mean']:+.4f}, with no interval yet."
                if n == 1 else "No seed both arms finished.")
    lo, hi = c["ci_low"], c["ci_high"]
    if hi < 0:
        return f"`{arm}` reaches a lower held-out loss than `{ref}` (the whole interval is below 0)."
    if lo > 0:
        return f"`{arm}` reaches a higher held-out loss than `{ref}` (the whole interval is above 0)."
    return (f"The interval includes 0: no difference between `{arm}` and `{ref}` is resolved "
            f"at {n} seeds.")


def contrast(stage: dict | None, stage_name: str, arm, reference: str, *,
             missing: list = ()) -> dict:
    """The paired final held-out loss contrast arm - reference at one stage (see module doc)."""
    a, r = resolve(stage, arm), resolve(stage, reference)
    out = {"stage": stage_name, "arm": a["spec"], "reference": r["spec"], "arm_resolved": a["name"],
           "reference_resolved": r["name"], "candidates": a["candidates"],
           "arm_run": a["run_id"], "reference_run": r["run_id"]}
    if a["name"] is None or r["name"] is None:
        why = _not_run(stage_name, [(arm, a), (reference, r)], missing)
        return {**out, "status": "not yet run", "why": why}
    c = stats.paired(final_losses(a["run"]), final_losses(r["run"]))
    if c["n"] == 0:
        return {**out, "status": "not yet run", "why": f"`{a['name']}` and `{r['name']}` share no "
                f"finished seed at `{stage_name}` yet", **c}
    return {**out, "status": "ok", **c, "sentence": direction(c, a["name"], r["name"])}


def sanity(stage: dict | None, stage_name: str, *, arm: str, reference: str, max_mean: float,
           missing: list = ()) -> dict:
    """The sanity rule: pass iff the 95% interval of arm - reference contains 0 and
    |mean| < max_mean; "not decided" with fewer than two paired seeds."""
    rid, run = arm_run(stage, arm)
    like = (run or {}).get("overrides")
    rrid, ref = arm_run(stage, reference, like=like)
    out = {"stage": stage_name, "arm": arm, "reference": reference, "max_mean": max_mean,
           "arm_run": rid, "reference_run": rrid}
    if not final_losses(run) or not final_losses(ref):
        names = [n for n, x in ((arm, run), (reference, ref)) if not final_losses(x)]
        return {**out, "verdict": "not decided", "why": _missing_note(stage_name, names, missing)}
    c = stats.paired(final_losses(run), final_losses(ref))
    out.update(c)
    if c["n"] < 2:
        return {**out, "verdict": "not decided",
                "why": f"{c['n']} paired seed(s): an interval needs two or more"}
    contains = c["ci_low"] <= 0.0 <= c["ci_high"]
    small = abs(c["mean"]) < max_mean
    if contains and small:
        return {**out, "verdict": "pass", "why": f"the 95% interval contains 0 and |mean| < {max_mean:g}"}
    reasons = ([] if contains else ["the 95% interval excludes 0"]) + \
        ([] if small else [f"|mean| = {abs(c['mean']):.4f} is not below {max_mean:g}"])
    return {**out, "verdict": "fail", "why": " and ".join(reasons)}


def tokens_to_reach(points: list, target: float) -> float | None:
    """Tokens at which a held-out curve first reaches ``target``; ``points``: [(tokens, loss)].

    Between checkpoints (t0, l0) and (t1, l1) with l0 > target >= l1, linearly:
        t = t0 + (l0 - target) / (l0 - l1) (t1 - t0)
    At the first checkpoint already: its tokens. Never: None."""
    points = sorted(points)
    for i, (t1, l1) in enumerate(points):
        if l1 <= target:
            if i == 0:
                return float(t1)
            t0, l0 = points[i - 1]
            return t0 + (l0 - target) / (l0 - l1) * (t1 - t0)
    return None


def t_interval(values: list, *, confidence: float = 0.95) -> dict:
    """stats.summary plus the Student-t interval mean +- t_{(1+c)/2, n-1} std / sqrt(n)."""
    from scipy import stats as st

    s = stats.summary(values)
    if s["n"] < 2:
        return {**s, "ci_low": float("nan"), "ci_high": float("nan")}
    half = float(st.t.ppf(0.5 + confidence / 2, s["n"] - 1)) * s["std"] / math.sqrt(s["n"])
    return {**s, "ci_low": s["mean"] - half, "ci_high": s["mean"] + half}


def reach(stage: dict | None, stage_name: str, arm, reference: str, *, missing: list = ()) -> dict:
    """Per seed: the tokens the arm needs to reach the reference's final held-out loss, and their
    ratio to the reference's final tokens; summarised (t-interval) when every seed reached."""
    a, r = resolve(stage, arm), resolve(stage, reference)
    out = {"stage": stage_name, "arm": a["spec"], "arm_resolved": a["name"], "reference": reference}
    if a["name"] is None or r["name"] is None:
        why = _not_run(stage_name, [(arm, a), (reference, r)], missing)
        return {**out, "status": "not yet run", "why": why}
    per_tok = stage["tokens_per_step"]
    arm_seeds, ref_seeds = finished(a["run"]), finished(r["run"])
    seeds = {}
    for s in sorted(set(arm_seeds) & set(ref_seeds)):
        ref_curve = curve(ref_seeds[s])
        target, ref_tokens = ref_seeds[s]["eval"]["heldout"]["loss"], max(ref_curve) * per_tok
        t = tokens_to_reach([(k * per_tok, v) for k, v in curve(arm_seeds[s]).items()], target)
        seeds[s] = {"target": target, "reference_tokens": ref_tokens, "tokens": t,
                    "ratio": None if t is None else t / ref_tokens}
    reached = {s: v["ratio"] for s, v in seeds.items() if v["ratio"] is not None}
    out.update(status="ok" if seeds else "not yet run", seeds=seeds, n=len(seeds),
               reached=len(reached), not_reached=[s for s in seeds if s not in reached])
    if not seeds:
        out["why"] = f"`{a['name']}` and `{reference}` share no finished seed at `{stage_name}` yet"
    elif len(reached) == len(seeds):
        out["ratio"] = t_interval(list(reached.values()))
    return out


def gap(stage: dict | None, stage_name: str, arm, reference: str, *, missing: list = ()) -> dict:
    """The held-out loss gap arm - reference at each checkpoint step both have, paired over seeds."""
    a, r = resolve(stage, arm), resolve(stage, reference)
    out = {"stage": stage_name, "arm": a["spec"], "arm_resolved": a["name"], "reference": reference}
    if a["name"] is None or r["name"] is None:
        return {**out, "status": "not yet run", "rows": [],
                "why": _not_run(stage_name, [(arm, a), (reference, r)], missing)}
    ac = {s: curve(e) for s, e in finished(a["run"]).items()}
    rc = {s: curve(e) for s, e in finished(r["run"]).items()}
    steps = sorted({k for s in set(ac) & set(rc) for k in set(ac[s]) & set(rc[s])})
    rows = []
    for k in steps:
        c = stats.paired({s: v[k] for s, v in ac.items() if k in v},
                         {s: v[k] for s, v in rc.items() if k in v})
        rows.append({"step": k, "tokens": k * stage["tokens_per_step"], "n": c["n"],
                     "mean": c["mean"], "ci_low": c["ci_low"], "ci_high": c["ci_high"],
                     "p_value": c["p_value"]})
    return {**out, "status": "ok" if rows else "not yet run", "rows": rows}
