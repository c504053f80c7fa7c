"""Expert parallel (EP=2): AoE in cache mode "send" and "recompute" against stock MoE.

Two processes (gloo on CPU, NCCL on two GPUs) each hold half of the experts and their own tokens.
Reported: forward + backward time (arms alternating, rank 0's median; every rank's medians kept)
and the bytes the expert-parallel all-to-alls move to *other* ranks per step, forward and
backward, counted by wrapping the ``all_to_all`` that megatron-core's token dispatcher calls
(only inside the benchmark's worker processes).

Analytic expectation: a dispatched row is d_model + d_low wide in cache mode "send" (x and C_i),
d_model in "recompute" and for MoE; the combine returns d_model-wide rows in every arm.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, replace

import torch

from aoe_megatron.bench.arms import (QUICK_SHAPES, SHAPES, LayerShape, build_aoe, build_moe,
                                     forward_backward, layer_transformer_config)
from aoe_megatron.bench.measure import ratio, summarize, timed
from aoe_megatron.runtime.compat import quiet_cpu_fallback_warnings
from aoe_megatron.runtime.distributed import init_megatron, shutdown
from aoe_megatron.runtime.spawn import spawn

WORLD_SIZE = 2
ARMS = ("moe", "aoe-send", "aoe-recompute")


class AllToAllBytes:
    """Counts the bytes each all-to-all sends to other ranks; wraps a ``all_to_all`` function."""

    def __init__(self):
        self.calls: list[dict] = []
        self._token_calls = 0

    def reset(self) -> None:
        self.calls = []
        self._token_calls = 0

    def _label(self, input_: torch.Tensor) -> str:
        """NOTE: a layer's forward calls all-to-all for the dispatched rows, their probs, then the
        combined rows, in that order: token calls alternate dispatch / combine."""
        if input_.dim() == 1:
            return "probs"
        self._token_calls += 1
        return "dispatch" if self._token_calls % 2 else "combine"

    @staticmethod
    def _row_bytes(t: torch.Tensor) -> int:
        return t.element_size() * math.prod(t.shape[1:])

    @staticmethod
    def _sizes(splits, rows: int, world: int) -> list[int]:
        return [rows // world] * world if splits is None else [int(s) for s in splits]

    def wrap(self, all_to_all):
        def counted(group, input_, output_split_sizes_=None, input_split_sizes=None):
            out = all_to_all(group, input_, output_split_sizes_, input_split_sizes)
            rank, world = group.rank(), group.size()
            sent = self._sizes(input_split_sizes, input_.shape[0], world)
            recv = self._sizes(output_split_sizes_, out.shape[0], world)
            rows = sum(sent) - sent[rank]
            kind = self._label(input_)
            self.calls.append({"pass": "forward", "kind": kind, "rows": rows,
                               "bytes": rows * self._row_bytes(input_)})
            if out.requires_grad:  # the backward sends the received rows' gradients back
                back = sum(recv) - recv[rank]

                def hook(grad):
                    self.calls.append({"pass": "backward", "kind": kind, "rows": back,
                                       "bytes": back * self._row_bytes(grad)})

                out.register_hook(hook)
            return out

        return counted

    def totals(self) -> dict:
        out = {"forward": 0, "backward": 0, "by_kind": {}}
        for c in self.calls:
            out[c["pass"]] += c["bytes"]
            key = f'{c["pass"]} {c["kind"]}'
            entry = out["by_kind"].setdefault(key, {"bytes": 0, "rows": 0})
            entry["bytes"] += c["bytes"]
            entry["rows"] += c["rows"]
        return out


def _build_arms(shape: LayerShape, *, device: str, dtype: torch.dtype, use_te: bool) -> dict:
    tc = layer_transformer_config(shape, dtype=dtype, device=device, use_te=use_te, ep=WORLD_SIZE)
    torch.manual_seed(0)
    arms = {"moe": build_moe(tc, device=device, use_te=use_te),
            "aoe-send": build_aoe(tc, shape, device=device, cache_mode="send"),
            "aoe-recompute": build_aoe(tc, shape, device=device, cache_mode="recompute")}
    arms["aoe-recompute"].load_state_dict(arms["aoe-send"].state_dict())
    return arms


def _measure(rank: int, job: dict) -> dict:
    import torch.distributed as dist
    from megatron.core.transformer.moe import token_dispatcher

    device, dtype, reps = job["device"], getattr(torch, job["dtype"]), job["reps"]
    shape = LayerShape(**job["shape"])
    counter = AllToAllBytes()
    token_dispatcher.all_to_all = counter.wrap(token_dispatcher.all_to_all)
    arms = _build_arms(shape, device=device, dtype=dtype, use_te=job["use_te"])
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randn(shape.tokens, 1, shape.d_model, generator=gen).to(device, dtype)
    x.requires_grad_(True)
    g = torch.randn(shape.tokens, 1, shape.d_model, generator=gen).to(device, dtype)
    log = print if rank == 0 else (lambda *a, **k: None)

    comm = {}
    for arm, layer in arms.items():
        log(f"[ep {job['name']}] {arm} warm-up + all-to-all bytes", flush=True)
        counter.reset()
        forward_backward(layer, x, g)
        comm[arm] = counter.totals()
    wall = {arm: [] for arm in arms}
    for i in range(reps):
        for arm, layer in arms.items():
            dist.barrier()
            w, _ = timed(lambda: forward_backward(layer, x, g), device)
            wall[arm].append(w)
            log(f"[ep {job['name']}] {arm} rep {i + 1}/{reps}: {w:.3f} s (rank 0)", flush=True)
    return {arm: {"time_s": summarize(wall[arm]), "all_to_all_bytes": comm[arm]} for arm in arms}


def _rank(rank: int, job: dict) -> dict:
    """One rank of the benchmark (runtime.spawn sets its rendezvous)."""
    if job["device"] == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD_SIZE))
    quiet_cpu_fallback_warnings()
    try:
        init_megatron(rank=rank, world_size=WORLD_SIZE, expert_parallel_size=WORLD_SIZE)
        return _measure(rank, job)
    finally:
        shutdown()


def run(*, quick: bool, device: str, dtype: torch.dtype, use_te: bool, reps: int,
        log=print) -> dict:
    if device == "cuda" and torch.cuda.device_count() < WORLD_SIZE:
        reason = (f"EP={WORLD_SIZE} needs {WORLD_SIZE} CUDA devices, this machine has "
                  f"{torch.cuda.device_count()}")
        log(f"[ep] skipped: {reason}")
        return {"skipped": reason}
    name, base = ("tiny8", QUICK_SHAPES["tiny8"]) if quick else ("732m", SHAPES["732m"])
    shape = replace(base, tokens=base.tokens // WORLD_SIZE)  # the layer benchmark's T over 2 ranks
    job = {"name": name, "shape": asdict(shape), "device": device, "reps": reps,
           "dtype": str(dtype).removeprefix("torch."), "use_te": use_te}
    log(f"[ep {name}] spawning {WORLD_SIZE} ranks, T={shape.tokens} tokens per rank")
    ranks = spawn(_rank, WORLD_SIZE, job, timeout=300 if quick else 1800, what="EP benchmark ranks")
    elem = torch.tensor([], dtype=dtype).element_size()
    expected_width = {"moe": shape.d_model, "aoe-send": shape.d_model + shape.d_low,
                      "aoe-recompute": shape.d_model}
    arms = {}
    for arm in ARMS:
        r0 = ranks[0][arm]
        dispatch = r0["all_to_all_bytes"]["by_kind"]["forward dispatch"]
        arms[arm] = {**r0, "rank_medians_s": [r[arm]["time_s"]["median"] for r in ranks],
                     "expected_dispatch_row_width": expected_width[arm],
                     "measured_dispatch_row_width": dispatch["bytes"] / max(dispatch["rows"], 1) / elem,
                     "expected_dispatch_bytes": dispatch["rows"] * expected_width[arm] * elem,
                     "measured_dispatch_bytes": dispatch["bytes"]}
    moe_t = arms["moe"]["time_s"]["median"]
    moe_b = arms["moe"]["all_to_all_bytes"]
    ratios = {arm: {"time": ratio(arms[arm]["time_s"]["median"], moe_t),
                    "bytes_forward": ratio(arms[arm]["all_to_all_bytes"]["forward"], moe_b["forward"]),
                    "bytes_backward": ratio(arms[arm]["all_to_all_bytes"]["backward"], moe_b["backward"])}
              for arm in ARMS[1:]}
    return {"shape": {**asdict(shape), "d_wide": shape.d_wide}, "world_size": WORLD_SIZE,
            "arms": arms, "ratios": ratios}
