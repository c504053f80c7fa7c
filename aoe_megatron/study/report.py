"""results.json, report.md and the plots of a study, from its run folders (nothing retrained)."""

from __future__ import annotations

import json
import math
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from aoe_megatron.models.params import count_parameters
from aoe_megatron.study import plots, stats
from aoe_megatron.study.runner import run_paths
from aoe_megatron.study.spec import Study


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {"host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _layer_summary(evals: list) -> dict:
    """Held-out selection statistics over seeds: layer-mean Ent_load / Ent_conf, mean load."""
    ent_load = [sum(l["ent_load"] for l in e["heldout"]["layers"].values()) / len(e["heldout"]["layers"]) for e in evals]
    ent_conf = [sum(l["ent_conf"] for l in e["heldout"]["layers"].values()) / len(e["heldout"]["layers"]) for e in evals]
    layers = sorted(evals[0]["heldout"]["layers"], key=int)
    load = [[sum(e["heldout"]["layers"][k]["load"][i] for e in evals) / len(evals)
             for i in range(len(evals[0]["heldout"]["layers"][k]["load"]))] for k in layers]
    return {"ent_load": stats.summary(ent_load), "ent_conf": stats.summary(ent_conf), "load": load}


def probe_summary(probes: dict) -> list:
    """{seed: probe result} -> one row a layer: means and ranges over seeds."""
    seeds = sorted(probes)
    rows = []
    for i, first in enumerate(probes[seeds[0]]["layers"]):
        per = [probes[s]["layers"][i] for s in seeds]
        top = [p["top_norm_is_loss_best"] for p in per]
        sp = [p["spearman_mean"] for p in per]
        by_rank = [p["forced_loss_by_norm_rank"] for p in per]
        rows.append({"layer": first["layer"], "chance": first["chance_top"],
                     "top1_mean": sum(top) / len(top), "top1_min": min(top), "top1_max": max(top),
                     "spearman_mean": sum(sp) / len(sp), "spearman_min": min(sp), "spearman_max": max(sp),
                     "loss_best_norm_rank": sum(p["loss_best_norm_rank_mean"] for p in per) / len(per),
                     "chance_rank": first["chance_rank_mean"],
                     "forced_loss_top_norm": sum(r[0] for r in by_rank) / len(by_rank),
                     "forced_loss_bottom_norm": sum(r[-1] for r in by_rank) / len(by_rank),
                     "unforced_loss": sum(probes[s]["unforced_loss"] for s in seeds) / len(seeds),
                     "tokens": probes[seeds[0]]["tokens"]})
    return rows


def collect(study: Study, out: Path, results: dict, *, wall_seconds: float, command: str) -> dict:
    doc = {"study": study.name, "quick": study.quick, "description": study.description,
           "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": command, "machine": machine(), "data": study.data, "seeds": list(study.seeds),
           "baseline": study.baseline, "evaluation": study.evaluation, "arms": {}}
    base_loss = {s: r["eval"]["heldout"]["loss"] for s, r in results[study.baseline].items()}
    train_total = eval_total = 0.0
    for arm in study.arms:
        runs = results[arm.name]
        cfg = arm.model
        count = count_parameters(cfg)
        train = arm.preset["train"]
        per_seed = {}
        for seed, r in sorted(runs.items()):
            finished = json.loads(run_paths(out, arm, seed).finished.read_text())
            per_seed[str(seed)] = {"heldout_loss": r["eval"]["heldout"]["loss"],
                                   "perplexity": r["eval"]["heldout"]["perplexity"],
                                   "final_train_loss": finished["final_loss"], "steps": finished["steps"],
                                   "train_seconds": r["record"]["train_seconds"],
                                   "eval_seconds": r["eval"].get("eval_seconds", 0.0)}
            train_total += r["record"]["train_seconds"]
            eval_total += r["eval"].get("eval_seconds", 0.0)
        losses = {s: r["eval"]["heldout"]["loss"] for s, r in runs.items()}
        entry = {"label": arm.label, "world_size": arm.world_size,
                 "expert_parallel_size": arm.expert_parallel_size, "model": arm.preset["model"],
                 "train": train, "params": {"total": count.total, "active": count.active,
                            "active_without_embeddings": count.active - 2 * count.embedding},
                 "tokens_per_step": train["global_batch_size"] * cfg.seq_length,
                 "runs": per_seed, "heldout_loss": stats.summary(losses.values()),
                 "perplexity": stats.summary(math.exp(v) for v in losses.values()),
                 "selection": _layer_summary([r["eval"] for r in runs.values()])}
        if arm.name != study.baseline:
            entry["vs_baseline"] = stats.paired(losses, base_loss)
        probes = {s: r["eval"]["probe"] for s, r in runs.items() if r["eval"].get("probe")}
        if probes:
            entry["probe"] = {"per_seed": {str(s): p for s, p in probes.items()},
                              "layers": probe_summary(probes),
                              "intervention": next(iter(probes.values()))["intervention"]}
        doc["arms"][arm.name] = entry
    losses = {a.name: {s: r["eval"]["heldout"]["loss"] for s, r in results[a.name].items()} for a in study.arms}
    doc["contrasts"] = {ref: {name: stats.paired(losses[name], losses[ref])
                              for name in losses if name not in (ref, study.baseline)}
                        for ref in study.compare_to}
    table1 = out / "table1" / "table1.json"
    if study.table1 and table1.is_file():
        doc["table1"] = json.loads(table1.read_text())
        eval_total += doc["table1"].get("seconds", 0.0)
    doc["durations"] = {"train_seconds": train_total, "eval_seconds": eval_total,
                        "this_invocation_wall_seconds": wall_seconds}
    return doc


def figures(study: Study, out: Path, doc: dict) -> list:
    labels = {a: e["label"] for a, e in doc["arms"].items()}
    curves, records = {}, {}
    for arm in study.arms:
        metrics = [stats.read_metrics(run_paths(out, arm, s).root / "metrics.jsonl") for s in study.seeds]
        curves[arm.name] = {"valid": [m["valid"] for m in metrics if m["valid"]],
                            "train": [{k: r["loss"] for k, r in m["train"].items()} for m in metrics]}
        records[arm.name] = [m["train"] for m in metrics]
    made = [plots.loss_curves(curves, labels, {a: e["tokens_per_step"] for a, e in doc["arms"].items()},
                              out / "loss.png"),
            plots.entropy_curves(records, labels, out / "entropy.png"),
            plots.expert_load({a: e["selection"]["load"] for a, e in doc["arms"].items()}, labels,
                              out / "expert_load.png")]
    probed = {e["label"]: e["probe"]["layers"] for e in doc["arms"].values() if "probe" in e}
    if probed:
        made.append(plots.probe_bars(probed, out / "probe.png"))
    return made


def _pm(s: dict, digits: int = 4) -> str:
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}" if s["n"] > 1 else f"{s['mean']:.{digits}f}"


def markdown(doc: dict, images: list) -> str:
    m, d = doc["machine"], doc["durations"]
    hours = (d["train_seconds"] + d["eval_seconds"]) / 60
    lines = [f"# Study `{doc['study']}`{' (quick mode)' if doc['quick'] else ''}", "",
             doc["description"].strip(), "",
             f"Generated {doc['generated']} by `{doc['command']}` on {m['cpu']} ({m['cpus']} CPUs"
             f"{', GPU ' + m['gpu'] if m['gpu'] else ''}), torch {m['torch']}. Training and evaluation "
             f"took {hours:.1f} min of wall time in all (training {d['train_seconds'] / 60:.1f} min, "
             f"evaluation and probe {d['eval_seconds'] / 60:.1f} min); the invocation that wrote this "
             f"report ran {d['this_invocation_wall_seconds'] / 60:.1f} min (finished runs are reused).",
             "", f"Data: `{doc['data']}`; seeds {doc['seeds']} (a seed fixes the initialisation and the "
             "data order, the same in every arm). Held-out loss: mean next-token loss over "
             f"{doc['evaluation'].get('sequences', 256)} fixed validation sequences.", "",
             "## Held-out loss", "",
             "| arm | params: total / active without embeddings | held-out loss | perplexity | Δ loss vs "
             f"`{doc['baseline']}` [95% CI] | paired p | Ent_load | Ent_conf |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in doc["arms"].items():
        v = e.get("vs_baseline")
        delta = (f"{v['mean']:+.4f} [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}]" if v and v["n"] > 1
                 else ("—" if not v else f"{v['mean']:+.4f}"))
        p = f"{v['p_value']:.3f}" if v and v["n"] > 1 else "—"
        lines.append(f"| {e['label']} (`{name}`, EP={e['expert_parallel_size']}) | "
                     f"{e['params']['total'] / 1e6:.2f}M / {e['params']['active_without_embeddings'] / 1e6:.2f}M | "
                     f"{_pm(e['heldout_loss'])} | {_pm(e['perplexity'], 2)} | {delta} | {p} | "
                     f"{_pm(e['selection']['ent_load'], 3)} | {_pm(e['selection']['ent_conf'], 3)} |")
    lines += ["", "Mean ± sample standard deviation over seeds. Δ: the arm's loss minus the baseline's "
              "at the same seed, mean and Student-t 95% interval over seeds; p: paired t-test. "
              "Ent_load / Ent_conf: held-out, mean over MoE layers (nats; the maximum is ln E)."]
    for ref, rows in doc.get("contrasts", {}).items():
        lines += ["", f"Against `{ref}` instead, seed by seed (the arm's loss minus `{ref}`'s):", "",
                  "| arm | Δ loss [95% CI] | paired p |", "|---|---:|---:|"]
        for name, v in rows.items():
            ci = f" [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}]" if v["n"] > 1 else ""
            p = f"{v['p_value']:.3f}" if v["n"] > 1 else "—"
            lines.append(f"| {doc['arms'][name]['label']} (`{name}`) | {v['mean']:+.4f}{ci} | {p} |")
    probe_arms = [(n, e) for n, e in doc["arms"].items() if "probe" in e]
    for name, e in probe_arms:
        lines += ["", f"## Norm probe (`{name}`)", "",
                  "Each expert forced in turn as every token's single expert in one layer; does the "
                  "norm ranking predict the loss ranking? (aoe-norm-probe; mean over seeds, "
                  "range in brackets)", "", e["probe"]["intervention"], "",
                  "| layer | top-norm = loss-best | chance | Spearman(norm, −loss) | norm rank of the "
                  "loss-best expert (chance) | forced loss: top-norm / bottom-norm expert | unforced loss "
                  "| tokens |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in e["probe"]["layers"]:
            lines.append(f"| {r['layer']} | {r['top1_mean']:.3f} ({r['top1_min']:.3f}–{r['top1_max']:.3f}) | "
                         f"{r['chance']:.3f} | {r['spearman_mean']:+.3f} ({r['spearman_min']:+.3f}–"
                         f"{r['spearman_max']:+.3f}) | {r['loss_best_norm_rank']:.2f} ({r['chance_rank']:.1f}) | "
                         f"{r['forced_loss_top_norm']:.4f} / {r['forced_loss_bottom_norm']:.4f} | "
                         f"{r['unforced_loss']:.4f} | {r['tokens']} |")
    if "table1" in doc:
        t = doc["table1"]
        lines += ["", f"## The paper's Table 1 probe (`{t['arm']}`, seed {t['seed']}, exported to Hugging Face)", "",
                  f"The routers of the trained MoE removed; each layer's top-{t['top_k']} experts chosen by "
                  f"the L2 norm of a node of their own computation, weighted by a softmax over those norms "
                  f"({t['weighting']}); {t['tokens']} tokens of {t['documents']} held-out documents "
                  "(aoe-norm-probe --hf).", "",
                  "| selection | loss | Δ loss | next-token accuracy | Δ accuracy | same experts as the router |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in t["results"]:
            lines.append(f"| {r['node']} ({r['label']}) | {r['loss']:.4f} | {r['delta_loss']:+.4f} | "
                         f"{r['accuracy']:.4f} | {r['delta_accuracy']:+.4f} | {r['agreement_same_set']:.3f} |")
    lines += ["", "## Per run", "", "| arm | seed | steps | held-out loss | final train loss | train s | eval s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in doc["arms"].items():
        for seed, r in e["runs"].items():
            lines.append(f"| `{name}` | {seed} | {r['steps']} | {r['heldout_loss']:.4f} | "
                         f"{r['final_train_loss']:.4f} | {r['train_seconds']:.0f} | {r['eval_seconds']:.0f} |")
    lines += ["", "## Figures", ""] + [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(lines) + "\n"


def write_report(study: Study, out: Path, results: dict, *, wall_seconds: float, command: str) -> dict:
    doc = collect(study, out, results, wall_seconds=wall_seconds, command=command)
    images = figures(study, out, doc)
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "report.md").write_text(markdown(doc, images))
    return doc
