"""``aoe-count-params``: total and active parameters of a model preset, computed without
building the model."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from aoe_megatron.runtime.command_line import CommandParser


def _fmt(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-count-params", allow_abbrev=False,
        description="Total and active parameters of a model preset (AoE and its MoE twin), "
                    "computed from the preset without allocating the model.")
    ap.add_argument("preset", help="preset name (tiny, 732m, 4b, ...) or a preset YAML file")
    ap.add_argument("--arch", choices=("aoe", "moe", "both"), default="both",
                    help="which architecture to count (default: %(default)s)")
    ap.add_argument("--d-low", type=int, metavar="N",
                    help="override the AoE cache width d_low (default: the preset's)")
    ap.add_argument("--json", action="store_true",
                    help="print JSON (counts per arch) instead of a table (default: a table)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    from aoe_megatron.models.gpt import load_preset  # deferred: torch loads after --help
    from aoe_megatron.models.params import count_parameters  # deferred: torch loads after --help

    archs = ("moe", "aoe") if args.arch == "both" else (args.arch,)
    rows, tied = {}, {}
    for arch in archs:
        overrides = {"arch": arch}
        if args.d_low is not None:
            overrides["aoe"] = {"d_low": args.d_low}
        try:
            cfg = load_preset(args.preset, **overrides)
            rows[arch] = count_parameters(cfg)
            tied[arch] = cfg.tie_embeddings
        except ValueError as err:
            ap.error(str(err))
    if args.json:
        print(json.dumps({a: asdict(c) for a, c in rows.items()}, indent=2))
        return 0
    print(f"{'arch':<6}{'total':>12}{'active':>12}{'active+all W_down':>20}")
    for arch, c in rows.items():
        print(f"{arch:<6}{_fmt(c.total):>12}{_fmt(c.active):>12}{_fmt(c.active_with_all_caches):>20}")
    if any(tied.values()):
        print(tied_note(next(c for a, c in rows.items() if tied[a]).embedding))
    return 0


def tied_note(embedding: int) -> str:
    """Why active can exceed total: the tied [vocab x hidden] matrix counts once in total, twice
    in active (``models/params.py``)."""
    return (f"note: the input embedding and the output layer are one tied [vocab x hidden] "
            f"matrix ({_fmt(embedding)}): counted once in total, twice in active (every token "
            f"multiplies by it both ways), so active can exceed total")


if __name__ == "__main__":
    raise SystemExit(main())
