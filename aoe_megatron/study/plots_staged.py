"""The staged study's figures (matplotlib Agg, PNG): held-out loss over training tokens per stage,
the learning-rate sweep, the loss gap over tokens, per-layer load entropy. Each takes the report's
own numbers and returns the file it wrote, or None when it has nothing to draw."""

from __future__ import annotations

import math
from pathlib import Path

from aoe_megatron.study.plots import draw_band, pyplot
from aoe_megatron.study.stats import band


def _colors(plt) -> list:
    return plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _save(plt, fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def _panels(plt, n: int, *, width: float = 5.5, height: float = 4.0):
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, axes[0]


def loss_vs_tokens(curves: dict, out: Path) -> Path | None:
    """``curves``: {stage: {arm: {"label", "curves": [{tokens: loss} per seed]}}}: one panel a
    stage, mean over seeds with a min..max band."""
    curves = {s: arms for s, arms in curves.items() if arms}
    if not curves:
        return None
    plt = pyplot()
    fig, axes = _panels(plt, len(curves))
    arms = list(dict.fromkeys(a for stage in curves.values() for a in stage))
    colors = _colors(plt)
    for ax, (stage, by_arm) in zip(axes, curves.items()):
        for arm, c in by_arm.items():
            draw_band(ax, band(c["curves"]), label=f"{c['label']} ({len(c['curves'])} seeds)",
                       color=colors[arms.index(arm) % len(colors)], scale=1e-6)
        ax.set_title(f"{stage}: held-out loss (mean of seeds, band min..max)", fontsize=9)
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, out)


def sweep(rows_by_arm: dict, out: Path, *, stage: str = "") -> Path | None:
    """``rows_by_arm``: {arm: {"rows": [{"overrides", "loss", "best"}]}}: final held-out loss
    against lr (log x), one line an arm and setting besides lr (bias rates: their own line style)."""
    lines = {}
    for arm, entry in rows_by_arm.items():
        for row in entry["rows"]:
            lr = row["overrides"].get("lr")
            if lr is None or row["loss"] is None:
                continue
            rest = tuple(sorted((k, v) for k, v in row["overrides"].items() if k != "lr"))
            lines.setdefault((arm, rest), []).append((lr, row["loss"], row["best"]))
    if not lines:
        return None
    plt = pyplot()
    fig, axes = _panels(plt, 1, width=7.0)
    ax, colors, styles = axes[0], _colors(plt), ["-", "--", ":", "-."]
    arms = list(dict.fromkeys(arm for arm, _ in lines))
    rests = list(dict.fromkeys(rest for _, rest in lines))
    for (arm, rest), points in lines.items():
        points.sort()
        color = colors[arms.index(arm) % len(colors)]
        label = arm + "".join(f", {k} {v:g}" for k, v in rest)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color,
                ls=styles[rests.index(rest) % len(styles)], label=label)
        for lr, loss, best in points:
            if best:
                ax.plot([lr], [loss], marker="*", ms=14, color=color, mec="k")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final held-out loss (mean of seeds)")
    ax.set_title(f"{stage} sweep (star: the rate chosen)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(plt, fig, out)


def gap_vs_tokens(gaps: list, out: Path) -> Path | None:
    """``gaps``: [{"stage", "arm", "arm_resolved", "reference", "rows": [{"tokens", "mean",
    "ci_low", "ci_high"}]}]: one panel a stage, the mean gap with its 95% band (where n > 1)."""
    by_stage = {}
    for g in gaps:
        if g.get("rows"):
            by_stage.setdefault(g["stage"], []).append(g)
    if not by_stage:
        return None
    plt = pyplot()
    fig, axes = _panels(plt, len(by_stage))
    colors = _colors(plt)
    for ax, (stage, series) in zip(axes, by_stage.items()):
        for i, g in enumerate(series):
            x = [r["tokens"] / 1e6 for r in g["rows"]]
            color = colors[i % len(colors)]
            ax.plot(x, [r["mean"] for r in g["rows"]], marker="o", color=color,
                    label=f"{g['arm_resolved']} - {g['reference']}")
            band_rows = [(xi, r) for xi, r in zip(x, g["rows"]) if _finite(r["ci_low"], r["ci_high"])]
            if band_rows:
                ax.fill_between([b[0] for b in band_rows], [b[1]["ci_low"] for b in band_rows],
                                [b[1]["ci_high"] for b in band_rows], color=color, alpha=0.18, lw=0)
        ax.axhline(0.0, color="k", lw=1, ls="--")
        ax.set_title(f"{stage}: held-out loss gap (mean of seeds, 95% band)", fontsize=9)
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("Δ held-out loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, out)


def _finite(*values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def load_entropy(entropy: dict, out: Path) -> Path | None:
    """``entropy``: {stage: {arm: {"layers", "ent_load"}}}: one panel a stage, bars a layer, one
    colour an arm."""
    entropy = {s: arms for s, arms in entropy.items() if arms}
    if not entropy:
        return None
    plt = pyplot()
    fig, axes = _panels(plt, len(entropy), width=6.0)
    arms = list(dict.fromkeys(a for stage in entropy.values() for a in stage))
    colors = _colors(plt)
    for ax, (stage, by_arm) in zip(axes, entropy.items()):
        width = 0.8 / len(by_arm)
        for j, (arm, e) in enumerate(by_arm.items()):
            x = [i + (j - (len(by_arm) - 1) / 2) * width for i in range(len(e["layers"]))]
            ax.bar(x, e["ent_load"], width=width, color=colors[arms.index(arm) % len(colors)], label=arm)
        layers = next(iter(by_arm.values()))["layers"]
        values = [v for e in by_arm.values() for v in e["ent_load"]]
        low, high = min(values), max(values)
        # NOTE: entropies sit near ln E, so the axis starts near the smallest bar, not at 0.
        ax.set_ylim(max(0.0, low - 0.25 * max(high - low, 0.02)), high + 0.1 * max(high - low, 0.02))
        ax.set_xticks(range(len(layers)), [str(k) for k in layers])
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("held-out Ent_load (nats; max ln E)")
        ax.set_title(f"{stage}: load entropy per layer (mean of seeds; axis not from 0)", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(plt, fig, out)
