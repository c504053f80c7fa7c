"""Smoke run: a small GPTModel with AoE (or stock MoE) layers learns a fixed batch on one process.

    python -m aoe_megatron.smoke --preset tiny --arch aoe --steps 30

Until the pretraining entry point lands this is `make demo`. Prints the loss at every step.
"""

from __future__ import annotations

import argparse
import time

import torch


def train_fixed_batch(cfg, *, steps: int = 30, lr: float = 3e-3, batch_size: int = 4,
                      seed: int = 0, log=print) -> list[float]:
    """Train ``cfg`` for ``steps`` Adam steps on one fixed random batch; returns the LM losses.

    Needs megatron's parallel state (``aoe_megatron.distributed.init_megatron``).
    """
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from aoe_megatron.model import build_gpt_model

    torch.manual_seed(seed)
    model = build_gpt_model(cfg)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_length + 1), generator=gen)
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(cfg.seq_length, device=device).unsqueeze(0).expand(batch_size, -1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, position_ids, None, labels=labels).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        clear_aux_losses_tracker()
        losses.append(loss.item())
        log(f"step {step + 1:3d}/{steps}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.2f}s)")
    return losses


def main(argv=None) -> int:
    from aoe_megatron.compat import quiet_cpu_fallback_warnings, runtime_summary

    quiet_cpu_fallback_warnings()
    from aoe_megatron.distributed import init_megatron, shutdown
    from aoe_megatron.model import load_preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="preset name or YAML file (default: tiny)")
    ap.add_argument("--arch", choices=("aoe", "moe"), default="aoe")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    if args.steps <= 0:
        ap.error("--steps must be positive")
    try:
        cfg = load_preset(args.preset, arch=args.arch)
    except ValueError as err:
        ap.error(str(err))
    init_megatron()
    try:
        print(runtime_summary())
        print(f"{args.arch.upper()} model from preset {args.preset!r}: {cfg}")
        losses = train_fixed_batch(cfg, steps=args.steps, lr=args.lr)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
