"""Activation memory per transformer layer (issue #34): what a training forward leaves held for its
backward, for each architecture, at a preset's shape.

A GPTModel of the preset with L layers runs one forward at micro-batch b with labels (the loss, as
in training), in train mode. Two figures per depth:

  allocated  CUDA only: torch.cuda.memory_allocated after the forward minus before (the caching
             allocator's live bytes; None on the CPU, whose resident set does not see tensors
             under glibc's mmap threshold at tiny shapes);
  saved      the bytes autograd saves for backward (``measure.SavedTensorBytes``, parameters
             excluded; tensors a Function keeps as plain attributes are not seen).

Per layer: ``(M(L2) - M(L1)) / (L2 - L1)`` from two depths, which leaves out the embedding's, the
output layer's and the loss's share (the 32k-vocabulary logits alone are 0.25-0.5 GiB at 4B,
micro-batch 2), and ``M(L) / L`` at each depth (the plain quotient, that share included).

    python -m aoe_megatron.bench.activations --preset 4b --layers 2,4 --micro-batch 2 --out a.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch

from aoe_megatron.bench.measure import SavedTensorBytes
from aoe_megatron.bench.model import build_model
from aoe_megatron.moe import loss_tracker
from aoe_megatron.runtime.distributed import init_megatron, shutdown


def forward_bytes(preset: str, arch: str, *, num_layers: int, micro_batch: int, device: str,
                  dtype: torch.dtype) -> dict:
    """{"allocated", "saved"}: bytes one training forward of ``arch`` at ``num_layers`` holds."""
    cfg, model = build_model(preset, {"num_layers": num_layers}, arch, device=device, dtype=dtype,
                             use_te=False)
    seq = cfg.seq_length
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=gen).to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch, -1)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    cuda = torch.device(device).type == "cuda"
    counter = SavedTensorBytes(exclude=list(model.parameters()))
    model.train()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with counter:
        loss = model(inputs, position_ids, None, labels=labels)
    allocated = None
    if cuda:
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
    del loss, model, inputs, labels, tokens, position_ids
    loss_tracker.clear()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"allocated": allocated, "saved": counter.nbytes}


def per_layer(preset: str, archs, *, layers=(2, 4), micro_batch: int, device: str,
              dtype: torch.dtype, log=print) -> dict:
    """Each arch's forward bytes at each depth of ``layers`` (two or more), per layer both ways."""
    if len(layers) < 2 or sorted(set(layers)) != list(layers):
        raise ValueError(f"layers must be two or more increasing depths, got {layers}")
    out = {}
    for arch in archs:
        depths = {}
        # NOTE: deepest first: megatron-core's aux-loss tracker sizes its per-layer values at the
        # first model that records into it, and a deeper model after a shallower one overflows it
        for n in sorted(layers, reverse=True):
            depths[n] = forward_bytes(preset, arch, num_layers=n, micro_batch=micro_batch,
                                      device=device, dtype=dtype)
            log(f"[activations {preset}] {arch} {n} layers: {depths[n]}")
        lo, hi = layers[0], layers[-1]
        depths = {n: depths[n] for n in layers}
        out[arch] = {
            "by_depth": {str(n): d for n, d in depths.items()},
            **{f"{key}_per_layer": (None if depths[lo][key] is None else
                                    (depths[hi][key] - depths[lo][key]) / (hi - lo))
               for key in ("allocated", "saved")},
            **{f"{key}_over_layers": {str(n): (None if d[key] is None else d[key] / n)
                                      for n, d in depths.items()} for key in ("allocated", "saved")},
        }
    moe = out.get("moe")
    for arch, res in out.items():
        if moe is not None and arch != "moe":
            res["vs_moe"] = {k: (res[k] / moe[k] if res[k] is not None and moe[k] else None)
                             for k in ("allocated_per_layer", "saved_per_layer")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="4b")
    ap.add_argument("--archs", default="aoe,moe", help="comma-separated, of bench.model.ARCHS")
    ap.add_argument("--layers", default="2,4", help="two or more increasing depths")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    args = ap.parse_args(argv)
    if args.device == "cpu":  # before CUDA is first asked for: megatron's CPU patches need it hidden
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    init_megatron(expert_parallel_size=1)
    try:
        result = per_layer(args.preset, args.archs.split(","), micro_batch=args.micro_batch,
                           layers=tuple(int(n) for n in args.layers.split(",")),
                           device=args.device, dtype=dtype)
    finally:
        shutdown()
    args.out.write_text(json.dumps({"preset": args.preset, "micro_batch": args.micro_batch,
                                    "dtype": args.dtype, "device": args.device,
                                    "archs": result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())
