"""``aoe-norm-probe``: do experts know what they know? Two probes of the norm-competence claim.

AoE checkpoint, the review's falsifier (forced-expert losses against the cache-norm ranking, on the
validation split of a data config):

    aoe-norm-probe runs/aoe/checkpoints --data run/data-shakespeare.yaml \\
        --sequences 32 --batch-size 8 --output probe.json

Hugging Face MoE folder (Mixtral / OLMoE; e.g. a stock MoE exported by aoe-convert-to-hf),
the paper's Table 1 (routers removed, experts ranked by the norm at a node):

    aoe-norm-probe --hf hf/moe-tiny --text docs.jsonl --node all --output table1.json

Writes JSON to --output and a Markdown table next to it (.md); prints the table. Bad input exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aoe_megatron.data.blend import check_manifests
from aoe_megatron.data.config import DataConfig
from aoe_megatron.runtime.command_line import CommandParser
from aoe_megatron.runtime.compat import quiet_cpu_fallback_warnings
from aoe_megatron.study.probe_nodes import CHOICES, WEIGHTINGS


def stderr_log(message: str) -> None:
    print(f"[norm_probe] {message}", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-norm-probe", allow_abbrev=False,
        description="Probe whether experts know what they know: on an AoE checkpoint, forced-"
                    "expert losses against the cache-norm ranking; on a Hugging Face MoE folder "
                    "(--hf), the paper's Table 1 with routers replaced by norm rankings.")
    ap.add_argument("checkpoint", nargs="?",
                    help="AoE checkpoint to probe, or a checkpoint directory (its latest); give "
                         "this or --hf")
    ap.add_argument("--data",
                    help="checkpoint: data config YAML whose validation split is the held-out "
                         "set; required with a checkpoint")
    ap.add_argument("--sequences", type=int, default=16,
                    help="checkpoint: held-out sequences to probe on (default: %(default)s)")
    ap.add_argument("--seq-length", type=int,
                    help="checkpoint: tokens per held-out sequence (default: the model's "
                         "seq_length)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the validation sample order and the random draws "
                         "(default: %(default)s)")
    ap.add_argument("--no-verify", action="store_true",
                    help="checkpoint: read it without first checking its files against its "
                         "manifest; a damaged checkpoint is otherwise refused (default: off)")
    ap.add_argument("--hf", type=Path,
                    help="a Hugging Face Mixtral/OLMoE folder to probe instead of a checkpoint "
                         "(the paper's Table 1) (default: none)")
    ap.add_argument("--text", type=Path,
                    help="--hf: JSONL file of {\"text\": ...} documents to probe on; required "
                         "with --hf")
    ap.add_argument("--node", default="all",
                    help=f"--hf: the nodes whose norm ranks the experts: all, or comma-separated "
                         f"of {', '.join(CHOICES)}; the router always runs first "
                         f"(default: %(default)s)")
    ap.add_argument("--weighting", default="norm", choices=WEIGHTINGS,
                    help="--hf: weights of the chosen experts; norm: softmax over their norms, "
                         "router: the router's own top-K weights (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=512,
                    help="--hf: tokens per document, at most (default: %(default)s)")
    ap.add_argument("--max-docs", type=int, default=200,
                    help="--hf: documents to read from --text, at most (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=4,
                    help="sequences per forward pass (default: %(default)s)")
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default=None,
                    help="model dtype; checkpoint: fp32 or bf16 (default fp32); --hf: auto (the "
                         "folder's dtype, the default), fp32 or bf16")
    ap.add_argument("--device",
                    help="torch device, cpu or cuda (default: cuda when available, else cpu)")
    ap.add_argument("--output", type=Path,
                    help="JSON file to write, with the Markdown table beside it as .md "
                         "(default: print the table only)")
    return ap


def _check(ap, args) -> None:
    if (args.checkpoint is None) == (args.hf is None):
        ap.error("give either an AoE CHECKPOINT (with --data) or --hf FOLDER (with --text)")
    if args.hf is not None and args.text is None:
        ap.error("--hf needs --text FILE.jsonl (documents as {\"text\": ...} lines)")
    if args.checkpoint is not None and args.data is None:
        ap.error("an AoE checkpoint needs --data CONFIG.yaml (its validation split is the held-out set)")
    for name in ("sequences", "batch_size", "max_tokens", "max_docs", "seq_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.no_verify and args.checkpoint is None:
        ap.error("--no-verify applies to a CHECKPOINT only (a --hf folder has no manifest)")
    if args.checkpoint is not None and args.dtype == "auto":
        ap.error("--dtype auto applies to --hf only: use fp32 or bf16")


def _aoe(args) -> tuple:
    from aoe_megatron.study import probe  # deferred: torch loads after --help

    step_dir, state = probe.open_checkpoint(args.checkpoint, what="aoe-norm-probe",
                                            verify=not args.no_verify)
    cfg = probe.probe_config((state.get("config") or {}).get("model") or {}, where=str(step_dir))
    if not Path(args.data).is_file():
        raise probe.ProbeError(f"data config {args.data} does not exist")
    # the held-out tokens must come from the tokenizer the model trained with, when that is known
    trained_on, sha = state["config"].get("data"), None  # absolute prefixes (newer records)
    if not isinstance(trained_on, dict):
        train = state["config"].get("train") or {}
        trained_on = train.get("data_path", train.get("data"))  # "data": records before the rename
        trained_on = trained_on[0] if isinstance(trained_on, (list, tuple)) else trained_on
    try:
        sha = check_manifests(DataConfig.load(trained_on).prefixes)["tokenizer"]["sha256"]
    except (TypeError, ValueError, OSError):
        sha = None
    if sha is None:
        stderr_log(f"the training data config {trained_on!r} is not found here: the tokenizer "
                   f"of --data is not checked against the model's")
    seq_length = args.seq_length or cfg.seq_length
    windows = probe.heldout_windows(args.data, sequences=args.sequences, seq_length=seq_length,
                                    seed=args.seed, tokenizer_sha256=sha)
    stderr_log(f"{step_dir}: {cfg.num_layers} layers x {cfg.num_experts} experts, "
               f"{args.sequences} x {seq_length} held-out tokens")
    result = probe.probe_step(step_dir, state, windows, batch_size=args.batch_size, seed=args.seed,
                              device=args.device, dtype=args.dtype or "fp32", log=stderr_log)
    result["data"] = str(args.data)
    if result["unique_sequences"] < result["sequences"]:
        stderr_log(f"only {result['unique_sequences']} of {result['sequences']} sequences are "
                   f"distinct: the validation split is smaller than asked for")
    return result, probe.markdown(result)


def _hf(args) -> tuple:
    from aoe_megatron.study import hf_probe  # deferred: torch loads after --help

    nodes = tuple(hf_probe.CHOICES) if args.node == "all" else tuple(args.node.split(","))
    result = hf_probe.hf_probe(args.hf, args.text, nodes=nodes, weighting=args.weighting,
                               max_tokens=args.max_tokens, max_docs=args.max_docs,
                               batch_size=args.batch_size, dtype=args.dtype or "auto",
                               device=args.device, log=stderr_log)
    return result, hf_probe.markdown(result)


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _check(ap, args)

    quiet_cpu_fallback_warnings()
    try:
        result, table = _hf(args) if args.hf is not None else _aoe(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        args.output.with_suffix(".md").write_text(table)
        print(f"wrote {args.output} and {args.output.with_suffix('.md')}", file=sys.stderr)
    print(table, end="")
    return 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
