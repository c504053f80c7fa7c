"""The probes of a staged study's report: the forced-expert norm probe (the falsifier) of each
probed arm, over its seeds, and the paper's Table 1 on the compared MoE (``table1/table1.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from aoe_megatron.study.report import probe_summary


def collect(results: dict) -> dict:
    """{stage: {run_id: {"arm", "seeds", "layers": probe_summary rows, "intervention"}}} for every
    run whose evaluations hold a probe."""
    out: dict = {}
    for stage, entry in results.get("stages", {}).items():
        for rid, run in entry.get("runs", {}).items():
            probes = {int(s): e["eval"]["probe"] for s, e in run.get("seeds", {}).items()
                      if (e.get("eval") or {}).get("probe")}
            if probes:
                out.setdefault(stage, {})[rid] = {
                    "arm": run.get("arm"), "seeds": sorted(probes), "layers": probe_summary(probes),
                    "intervention": next(iter(probes.values())).get("intervention", "")}
    return out


def table1(out: Path) -> dict | None:
    path = Path(out) / "table1" / "table1.json"
    return json.loads(path.read_text()) if path.is_file() else None


def section(doc: dict) -> list:
    lines = []
    for stage, runs in (doc.get("probes") or {}).items():
        for rid, p in runs.items():
            lines += [f"## Norm probe: `{rid}` at `{stage}` (seeds {p['seeds']})", "",
                      "Each expert forced in turn as every token's single expert in one layer: does "
                      "the norm ranking predict the loss ranking? Mean over seeds, range in brackets.",
                      "", p["intervention"], "",
                      "| layer | top-norm = loss-best | chance | Spearman(norm, −loss) | forced loss: "
                      "top-norm / bottom-norm expert | unforced loss |", "|---:|---:|---:|---:|---:|---:|"]
            lines += [f"| {r['layer']} | {r['top1_mean']:.3f} ({r['top1_min']:.3f}–{r['top1_max']:.3f}) | "
                      f"{r['chance']:.3f} | {r['spearman_mean']:+.3f} | {r['forced_loss_top_norm']:.4f} / "
                      f"{r['forced_loss_bottom_norm']:.4f} | {r['unforced_loss']:.4f} |" for r in p["layers"]]
            lines.append("")
    t = doc.get("table1")
    if t:
        lines += [f"## The paper's Table 1 probe (`{t['arm']}`, seed {t['seed']}, exported to Hugging Face)", "",
                  f"The routers of the trained MoE removed; each layer's experts chosen by the L2 norm of a "
                  f"node of their own computation ({t.get('weighting', '')}); {t.get('tokens')} held-out "
                  "tokens.", "", "| selection | loss | Δ loss | accuracy | Δ accuracy | same experts as the router |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['node']} ({r['label']}) | {r['loss']:.4f} | {r['delta_loss']:+.4f} | {r['accuracy']:.4f} | "
                  f"{r['delta_accuracy']:+.4f} | {r['agreement_same_set']:.3f} |" for r in t["results"]]
        lines.append("")
    return lines
