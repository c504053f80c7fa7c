"""report.md of a staged study, from the results.json dict (report_staged.analyse + the header).

The answers lead; each sentence is written from the numbers (answers.direction), never fixed text.
"""

from __future__ import annotations

from pathlib import Path

from aoe_megatron.study import staged_probes


def _f(x, spec: str = ".4f") -> str:
    return "—" if x is None else format(x, spec)


def _p(p, *, sign: str = "") -> str:
    """A p-value: "< 0.001" below it; ``sign`` ("= ") before a printed value."""
    return "—" if p is None else ("< 0.001" if p < 0.001 else f"{sign}{p:.3f}")


def _ci(d: dict, spec: str = "+.4f") -> str:
    if d.get("ci_low") is None or d.get("ci_high") is None:
        return "no interval"
    return f"[{_f(d['ci_low'], spec)}, {_f(d['ci_high'], spec)}]"


def _settings(overrides: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(overrides.items())) or "preset"


def _chosen_note(a: dict) -> str:
    if not a["arm"].startswith("best of "):
        return ""
    ran = [k for k, v in a.get("candidates", {}).items() if v is not None]
    if len(ran) == 1:  # a later stage runs only the arm an earlier stage picked
        return f" The arm is {a['arm']}: `{ran[0]}` is the one of them run at `{a['stage']}`."
    means = ", ".join(f"`{k}` {_f(v)}" for k, v in a.get("candidates", {}).items())
    return (f" The arm is {a['arm']} at `{a['stage']}`: `{a['arm_resolved']}` (mean final held-out "
            f"loss {means}; picked on the same seeds it is compared on, which favours it slightly).")


def answers_section(doc: dict) -> list:
    rows = doc.get("answers") or []
    if not rows:
        return []
    lines = [f"## Answers (stage `{rows[0]['stage']}`)", "",
             "Each number is the arm's final held-out loss minus the reference's at the same seed, "
             "mean over the seeds both finished, with the Student-t 95% interval and the paired "
             "t-test p; below 0: the arm reaches the lower loss.", ""]
    for a in rows:
        at = "" if a["stage"] == rows[0]["stage"] else f", stage `{a['stage']}`"
        head = f"- **{a['question']}** (`{a['arm']}` − `{a['reference']}`{at})"
        if a["status"] != "ok":
            lines.append(f"{head}: {a['status']}: {a['why']}.")
            continue
        p = f", p {_p(a['p_value'], sign='= ')}" if a["n"] > 1 else ""
        lines.append(f"{head}: {a['mean']:+.4f} {_ci(a)}, n = {a['n']} seed{'s' * (a['n'] != 1)}"
                     f"{p}. {a['sentence']}{_chosen_note(a)}")
    return lines + [""]


def sanity_section(doc: dict) -> list:
    s = doc.get("sanity")
    if not s:
        return []
    lines = [f"## Sanity check: `{s['arm']}` against `{s['reference']}` (stage `{s['stage']}`)", "",
             f"MoE through the AoE code path should match MoE: the rule passes when the 95% interval "
             f"of the paired difference contains 0 and |mean| < {s['max_mean']:g}.", ""]
    if s["verdict"] == "not decided":
        return lines + [f"**Not decided**: {s['why']}.", ""]
    numbers = (f"{s['mean']:+.4f} {_ci(s)}, n = {s['n']} seeds, runs `{s['arm_run']}` / "
               f"`{s['reference_run']}`")
    if s["verdict"] == "pass":
        return lines + [f"**Pass**: {numbers}; {s['why']}.", ""]
    if s["mean"] > 0:
        sentence = "the AoE code path costs loss"
    else:
        sentence = ("the AoE code path gives a different (here lower) loss than MoE's own; the two "
                    "should agree, so this is a discrepancy to find, not a gain")
    return lines + [f"**Fail**: {numbers}; {s['why']}: {sentence}.", ""]


def reach_section(doc: dict) -> list:
    rows = doc.get("reach") or []
    if not rows:
        return []
    lines = [f"## Tokens to reach `{rows[0]['reference']}`'s final held-out loss (stage `{rows[0]['stage']}`)",
             "", "Per seed: the training tokens at which the arm's held-out curve first reaches the "
             "reference's final held-out loss at that seed (linear between checkpoints), as a ratio "
             "of the reference's tokens; below 1: the arm gets there sooner.", "",
             "| arm | seeds reached | ratio, mean [95% CI] | per seed: tokens (ratio) |", "|---|---:|---:|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| `{r['arm']}` | — | {r['status']} | {r.get('why', '')} |")
            continue
        ratio = (f"{r['ratio']['mean']:.3f} {_ci(r['ratio'], '.3f')}" if r.get("ratio")
                 else f"not reached by {len(r['not_reached'])} of {r['n']}")
        per = "; ".join(f"seed {s}: " + ("not reached" if v["tokens"] is None
                                         else f"{v['tokens'] / 1e6:.2f}M ({v['ratio']:.3f})")
                        for s, v in r["seeds"].items())
        arm = r["arm"] + (f" → `{r['arm_resolved']}`" if r["arm"] != r["arm_resolved"] else "")
        lines.append(f"| `{arm}` | {r['reached']} of {r['n']} | {ratio} | {per} |")
    return lines + [""]


def gap_section(doc: dict) -> list:
    rows = doc.get("gap") or []
    if not rows:
        return []
    lines = ["## Held-out loss gap over training tokens", "",
             "At each checkpoint both runs kept: the arm's held-out loss minus the reference's, "
             "paired over seeds (mean, 95% interval).", ""]
    for g in rows:
        title = f"### `{g['stage']}`: `{g['arm']}`" + (
            f" (`{g['arm_resolved']}`)" if g.get("arm_resolved") and g["arm_resolved"] != g["arm"] else "")
        lines += [f"{title} − `{g['reference']}`", ""]
        if g["status"] != "ok":
            lines += [f"{g['status']}: {g.get('why', 'no common checkpoint yet')}.", ""]
            continue
        lines += ["| step | tokens | seeds | Δ loss | 95% CI | p |", "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['step']} | {r['tokens'] / 1e6:.2f}M | {r['n']} | {_f(r['mean'], '+.4f')} | "
                  f"{_ci(r)} | {_p(r['p_value'])} |" for r in g["rows"]]
        lines.append("")
    return lines


def sweep_section(doc: dict) -> list:
    sw = doc.get("sweep")
    if not sw or not sw["arms"]:
        return []
    lines = [f"## Sweep (stage `{sw['stage']}`)", "",
             "Final held-out loss, mean over the run's finished seeds; ★ the setting carried on.", "",
             "| arm | setting | seeds | held-out loss | |", "|---|---|---:|---:|---|"]
    chosen = []
    for arm, e in sw["arms"].items():
        for r in e["rows"]:
            lines.append(f"| `{arm}` | {_settings(r['overrides'])} | {r['n']} | {_f(r['loss'])} | "
                         f"{'★' if r['best'] else ''} |")
        if e["chosen"] is not None:
            edge = {"low": " — at the low edge of the rates tried (a lower rate might be better)",
                    "high": " — at the high edge of the rates tried (a higher rate might be better)"}
            pending = "" if e.get("decided", True) else " (so far: the arm's other runs are not done)"
            chosen.append(f"- `{arm}`: {_settings(e['chosen'])}{edge.get(e['edge'], '')}{pending}")
    return lines + ["", "Chosen per arm:", ""] + chosen + [""]


def flops_section(doc: dict) -> list:
    if not any(doc.get("flops", {}).values()):
        return []
    lines = ["## Where a training step's FLOPs go", "",
             "Per token, forward + backward (aoe_megatron/bench/flops.py conventions): output layer "
             "6 V D; attention L (24 D² + 12 D S); the MoE blocks (router or cache, K experts).", "",
             "Parameters: total, and active without the (tied) embedding, which a token looks up "
             "in and multiplies by at the output.", "",
             "| stage | shape (arm) | params total / active without embedding | FLOPs per token | "
             "output layer | attention | "
             "MoE blocks |", "|---|---|---:|---:|---:|---:|---:|"]
    for stage, splits in doc["flops"].items():
        if "error" in splits:
            lines.append(f"| `{stage}` | {splits['error']} | | | | | |")
            continue
        for arch, s in splits.items():
            sh, fr = s["shape"], s["fractions"]
            wide = f", d_low {sh['d_low']}, d_wide {sh['d_wide']}" if "d_wide" in sh else f", d_ffn {sh['d_ffn']}"
            lines.append(f"| `{stage}` | {arch.upper()} d_model {sh['d_model']}{wide} (`{s['arm']}`) | "
                         f"{s['params']['total'] / 1e6:.2f}M / "
                         f"{(s['params']['active'] - 2 * s['params']['embedding']) / 1e6:.2f}M | "
                         f"{s['total_per_token'] / 1e6:.2f}M | {fr['output_layer']:.1%} | "
                         f"{fr['attention']:.1%} | {fr['moe_blocks']:.1%} |")
    return lines + [""]


def entropy_section(doc: dict) -> list:
    stages = {s: arms for s, arms in (doc.get("entropy") or {}).items() if arms}
    if not stages:
        return []
    lines = ["## Held-out load entropy per layer", "",
             "Ent_load of each MoE layer on the held-out set (nats; the maximum is ln E), mean over seeds.", ""]
    for stage, arms in stages.items():
        layers = next(iter(arms.values()))["layers"]
        lines += [f"`{stage}`:", "", "| arm | run | seeds | " + " | ".join(f"layer {k}" for k in layers) + " |",
                  "|---|---|---:|" + "---:|" * len(layers)]
        for arm, e in arms.items():
            values = " | ".join(f"{v:.3f}" for v in e["ent_load"])
            lines.append(f"| `{arm}` | {e['run_id']} | {e['n']} | {values} |")
        lines.append("")
    return lines


def missing_section(doc: dict) -> list:
    if not doc.get("missing"):
        return []
    lines = ["## Missing", "", "Runs the study lists but this report does not have:", ""]
    for m in doc["missing"]:
        seeds = ", ".join(str(s) for s in m["seeds"])
        lines.append(f"- `{m['stage']}` / `{m['run_id']}`: seed{'s' * (len(m['seeds']) != 1)} {seeds}"
                     f"{' — ' + m['why'] if m['why'] else ''}")
    return lines + [""]


def markdown(doc: dict) -> str:
    m, d = doc["machine"], doc["durations"]
    state = " — partial report" if doc.get("partial") else ""
    lines = [f"# Study `{doc['study']}`{state}{' (quick mode)' if doc['quick'] else ''}", "",
             doc["description"].strip(), "",
             f"Generated {doc['generated']} by `{doc['command']}` on {m['cpu']} ({m['cpus']} CPUs"
             f"{', GPU ' + m['gpu'] if m.get('gpu') else ''}), torch {m['torch']}. Data: `{doc['data']}`."]
    if doc.get("partial"):
        lines += ["", f"**Partial report**: {sum(len(x['seeds']) for x in doc['missing'])} run seeds are "
                  "missing (listed under Missing); the numbers below use what has finished."]
    lines.append("")
    for section in (answers_section, sanity_section, reach_section, gap_section, sweep_section,
                    flops_section, entropy_section, staged_probes.section):
        lines += section(doc)
    lines += ["## Per run", "", "| stage | run | seed | steps | final held-out loss | train s | eval s |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| `{r['stage']}` | {r['run_id']} | {r['seed']} | {r['steps']} | {r['heldout_loss']:.4f} | "
              f"{r['train_seconds']:.0f} | {r['eval_seconds']:.0f} |" for r in doc["runs"]]
    lines += ["", "## Durations", "",
              f"Training {d['train_seconds'] / 60:.1f} min and evaluation {d['eval_seconds'] / 60:.1f} min "
              f"summed over the runs above; the invocation that wrote this report ran "
              f"{d['this_invocation_wall_seconds'] / 60:.1f} min (finished runs are reused).", ""]
    lines += missing_section(doc)
    if doc.get("figures"):
        lines += ["## Figures", ""] + [f"![{Path(name).stem}]({name})" for name in doc["figures"]] + [""]
    return "\n".join(lines)

