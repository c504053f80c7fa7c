"""``aoe-ablation-table``: the README's ablation table: every packaged preset under
presets/ablations, with its parameters and per-token FLOPs relative to Table 2's Config 2
(traditional MoE + L_aux), computed without allocating any model.

    aoe-ablation-table > /tmp/table.md

FLOPs per token are counted as 2 x the weights a token multiplies by, as implemented
(attention-score FLOPs, equal in every row, left out): AoE layers compute every expert's cache
(all W_down slices), plus the frozen matrix of the frozen-ranking control and the linear router
of Config 3; top-P and expert choice use a varying number of experts per token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aoe_megatron.runtime import resources
from aoe_megatron.runtime.command_line import CommandParser

BASELINE = "ablations/c02_moe_aux"
VARYING = {"top_p": "varies per token (p = {p})",
           "expert_choice": "varies per token (capacity factor {capacity_factor})"}


def describe(path: Path) -> str:
    """The preset's first comment line."""
    return next(line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#"))


def flop_weights(cfg) -> int:
    """Weights one token multiplies by, as implemented (see the module docstring)."""
    from aoe_megatron.models.params import count_parameters  # deferred: torch loads after --help

    count = count_parameters(cfg)
    if cfg.arch == "moe":
        return count.active
    extra = 0
    if cfg.aoe.rank_source == "frozen_random":
        extra = cfg.num_layers * cfg.num_experts * cfg.hidden_size * cfg.aoe.d_low
    return count.active_with_all_caches + extra


def ep_sizes(cfg) -> str:
    """Where tests/test_ablations.py trains (and evaluates) the preset."""
    if cfg.arch == "aoe" and cfg.aoe.inference_selection == "fon":
        return "1, 2 (evaluation: 1, dense)"
    return "1, 2"


def parser() -> argparse.ArgumentParser:
    return CommandParser(
        prog="aoe-ablation-table", allow_abbrev=False,
        description="Print the ablation table (Markdown): every packaged ablation preset with its "
                    "total parameters and per-token FLOPs relative to Table 2's Config 2 (MoE + "
                    "L_aux), without allocating any model.")


def main(argv=None) -> int:
    parser().parse_args(argv)
    from aoe_megatron.models.gpt import load_preset  # deferred: torch loads after --help
    from aoe_megatron.models.params import count_parameters  # deferred: torch loads after --help

    base = count_parameters(load_preset(BASELINE))
    base_flops = flop_weights(load_preset(BASELINE))
    rows = ["| preset | configuration | total params | vs Config 2 | FLOPs/token vs Config 2 | EP |",
            "|---|---|---:|---:|---:|---|"]
    for path in sorted(resources.path("presets/ablations").glob("*.yaml")):
        name = f"ablations/{path.stem}"
        cfg = load_preset(name)
        count = count_parameters(cfg)
        mode = cfg.aoe.selection if cfg.arch == "aoe" else cfg.router.selection
        options = cfg.aoe.selection_options if cfg.arch == "aoe" else cfg.router.selection_options
        flops = (VARYING[mode].format(**options) if mode in VARYING
                 else f"{flop_weights(cfg) / base_flops - 1:+.1%}")
        rows.append(f"| `{name}` | {describe(path)} | {count.total / 1e6:.1f}M | "
                    f"{count.total / base.total - 1:+.1%} | {flops} | {ep_sizes(cfg)} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
