"""The staged study's tables, as pure functions of the runner's ``results`` (no torch, no files):
the sweep, per-layer held-out load entropy, one row per run and seed, durations, the missing runs.
"""

from __future__ import annotations

from aoe_megatron.study.answers import arm_run, curve, finished, mean_loss


def stage_arms(stage: dict | None) -> list:
    """The arms with a run at the stage, in the order their first run appears."""
    return list(dict.fromkeys(r.get("arm") for r in ((stage or {}).get("runs") or {}).values()))


def sweep(stage: dict | None) -> dict:
    """{arm: {"rows": [{"run_id", "overrides", "n", "loss"}] (by lr, then the other settings),
    "best": run_id or None, "chosen": overrides, "edge": "low"/"high"/None, "decided": bool}};
    ``loss`` the mean final held-out loss over the run's finished seeds. The best is the runner's
    (``best``: decided, every run of the arm done), else the lowest mean loss so far."""
    out = {}
    for arm in stage_arms(stage):
        runs = {rid: r for rid, r in stage["runs"].items() if r.get("arm") == arm}
        rows = [{"run_id": rid, "overrides": r.get("overrides") or {}, "n": len(finished(r)),
                 "loss": mean_loss(r)} for rid, r in runs.items()]
        rows.sort(key=lambda row: (row["overrides"].get("lr", 0.0), sorted(row["overrides"].items())))
        given = (stage.get("best") or {}).get(arm)
        done = [row for row in rows if row["loss"] is not None]
        if given and given.get("run_id") in runs:
            best, edge = given["run_id"], given.get("edge")
        elif done:
            best, edge = min(done, key=lambda row: row["loss"])["run_id"], None
        else:
            best, edge = None, None
        for row in rows:
            row["best"] = row["run_id"] == best
        out[arm] = {"rows": rows, "best": best, "edge": edge,
                    "chosen": runs[best].get("overrides") or {} if best else None,
                    "decided": bool(given and given.get("run_id") in runs)}
    return out


def layer_entropy(stage: dict | None) -> dict:
    """{arm: {"run_id", "n", "ent_load": [per layer], "ent_conf": [per layer]}}: the held-out
    Ent_load / Ent_conf of each MoE layer, mean over the seeds of the arm's run at the stage."""
    out = {}
    for arm in stage_arms(stage):
        rid, run = arm_run(stage, arm)
        evals = [e["eval"]["heldout"] for e in finished(run).values() if e["eval"]["heldout"].get("layers")]
        if not evals:
            continue
        layers = sorted(evals[0]["layers"], key=int)
        out[arm] = {"run_id": rid, "n": len(evals), "layers": [int(k) for k in layers],
                    **{key: [sum(e["layers"][k][key] for e in evals) / len(evals) for k in layers]
                       for key in ("ent_load", "ent_conf")}}
    return out


def per_run(results: dict) -> list:
    """One row per evaluated (stage, run, seed): steps, final held-out loss, train and eval s."""
    rows = []
    for stage_name, stage in results.get("stages", {}).items():
        for rid, run in (stage.get("runs") or {}).items():
            for seed, e in sorted(finished(run).items()):
                rows.append({"stage": stage_name, "run_id": rid, "arm": run.get("arm"), "seed": seed,
                             "steps": (e.get("finished") or {}).get("steps", e["eval"].get("step")),
                             "heldout_loss": float(e["eval"]["heldout"]["loss"]),
                             "final_train_loss": (e.get("finished") or {}).get("final_loss"),
                             "train_seconds": float((e.get("record") or {}).get("train_seconds", 0.0)),
                             "eval_seconds": float(e["eval"].get("eval_seconds", 0.0))})
    return rows


def durations(rows: list, *, wall_seconds: float) -> dict:
    return {"train_seconds": sum(r["train_seconds"] for r in rows),
            "eval_seconds": sum(r["eval_seconds"] for r in rows),
            "this_invocation_wall_seconds": float(wall_seconds)}


def missing_groups(missing: list) -> list:
    """``results["missing"]`` grouped: [{"stage", "run_id", "why", "seeds": [...]}], in order."""
    groups = {}
    for m in missing:
        key = (m.get("stage"), m.get("run_id"), m.get("why", ""))
        groups.setdefault(key, []).append(m.get("seed"))
    return [{"stage": s, "run_id": rid, "why": why, "seeds": seeds} for (s, rid, why), seeds in groups.items()]


def loss_curves(stage: dict | None) -> dict:
    """{arm: {"label", "run_id", "curves": [{tokens: held-out loss} per seed]}} of each arm's run."""
    out = {}
    for arm in stage_arms(stage):
        rid, run = arm_run(stage, arm)
        seeds = finished(run)
        if seeds:
            out[arm] = {"label": run.get("label", arm), "run_id": rid,
                        "curves": [{k * stage["tokens_per_step"]: v for k, v in curve(e).items()}
                                   for _, e in sorted(seeds.items())]}
    return out

