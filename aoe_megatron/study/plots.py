"""The study's figures (matplotlib, PNG, no display): validation loss with a band over seeds,
Ent_load and Ent_conf over training (the paper's Figures 3-4), per-expert held-out load."""

from __future__ import annotations

from pathlib import Path

from aoe_megatron.study.stats import band, layer_mean, smooth


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_band(ax, b: dict, *, label: str, color, scale: float = 1.0) -> None:
    x = [s * scale for s in b["steps"]]
    ax.plot(x, b["mean"], label=label, color=color, lw=1.6)
    ax.fill_between(x, b["min"], b["max"], color=color, alpha=0.18, lw=0)


def _finish(plt, fig, axes, out: Path, *, titles, fontsize: int, xlabel: str, ylabel: str) -> Path:
    """Two panels of curves over training: titles, labels, grid, legend; saved and closed."""
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=fontsize)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def loss_curves(curves: dict, labels: dict, tokens_per_step: dict, out: Path) -> Path:
    """``curves``: {arm: {"valid": [{step: loss} per seed], "train": [...]}}."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, c) in enumerate(curves.items()):
        color = colors[i % len(colors)]
        scale = tokens_per_step[arm] / 1e6
        if c["valid"]:
            draw_band(axes[0], band(c["valid"]), label=labels[arm], color=color, scale=scale)
        if c["train"]:
            draw_band(axes[1], band([smooth(s, 10) for s in c["train"]]), label=labels[arm],
                       color=color, scale=scale)
    titles = [t + "; mean of seeds, band min..max" for t in
              ("held-out validation loss", "training loss (10-step moving mean)")]
    return _finish(plt, fig, axes, out, titles=titles, fontsize=10,
                   xlabel="training tokens (millions)", ylabel="loss (nats/token)")


def entropy_curves(train_records: dict, labels: dict, out: Path) -> Path:
    """``train_records``: {arm: [{step: train record} per seed]}; layer-mean Ent_load, Ent_conf."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, seeds) in enumerate(train_records.items()):
        for ax, key in zip(axes, ("ent_load", "ent_conf")):
            series = [smooth({k: layer_mean(r, key) for k, r in s.items() if r.get("layers")}, 10)
                      for s in seeds]  # statistics are gathered on logging steps only
            if series and series[0]:
                draw_band(ax, band(series), label=labels[arm], color=colors[i % len(colors)])
    titles = ("Ent_load: entropy of the expert load (higher = more balanced)",
              "Ent_conf: mean entropy of a token's expert distribution (Eq. 8)")
    return _finish(plt, fig, axes, out, titles=titles, fontsize=9, xlabel="step",
                   ylabel="nats (mean over MoE layers)")


def expert_load(loads: dict, labels: dict, out: Path) -> Path:
    """``loads``: {arm: [[f_i per expert] per layer]} (held-out, mean over seeds): one heatmap an
    arm, colour = fraction of the layer's selections that go to the expert."""
    plt = pyplot()
    arms = list(loads)
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms) + 1, 3.2), squeeze=False)
    vmax = max(max(max(row) for row in m) for m in loads.values())
    image = None
    for ax, arm in zip(axes[0], arms):
        image = ax.imshow(loads[arm], vmin=0.0, vmax=vmax, cmap="viridis", aspect="auto")
        ax.set_title(labels[arm], fontsize=8)
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_yticks(range(len(loads[arm])), [str(i + 1) for i in range(len(loads[arm]))])
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="load fraction")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def probe_bars(rows_by_arm: dict, out: Path) -> Path:
    """``rows_by_arm``: {label: [{"layer", "top1_mean", "top1_min", "top1_max", "chance",
    "spearman_mean", "spearman_min", "spearman_max"}]}: grouped bars a layer, one colour an arm."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / len(rows_by_arm)
    for a, (label, rows) in enumerate(rows_by_arm.items()):
        x = [i + (a - (len(rows_by_arm) - 1) / 2) * width for i in range(len(rows))]
        for ax, key in zip(axes, ("top1", "spearman")):
            mean = [r[f"{key}_mean"] for r in rows]
            err = [[m - r[f"{key}_min"] for m, r in zip(mean, rows)],
                   [r[f"{key}_max"] - m for m, r in zip(mean, rows)]]
            ax.bar(x, mean, width=width, yerr=err, capsize=3, color=colors[a % len(colors)], label=label)
    rows = next(iter(rows_by_arm.values()))
    axes[0].axhline(rows[0]["chance"], color="k", lw=1, ls="--", label="chance (1/E)")
    axes[1].axhline(0.0, color="k", lw=1, ls="--")
    axes[0].set_ylabel("top-norm expert is the loss-best")
    axes[1].set_ylabel("Spearman(norm, -forced loss)")
    for ax in axes:
        ax.set_xticks(range(len(rows)), [str(r["layer"]) for r in rows])
        ax.set_xlabel("MoE layer")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7, loc="lower right", framealpha=0.9)
    fig.suptitle("Norm probe: does an expert's norm predict which expert helps the token? "
                 "(mean over seeds, bars = min..max)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
