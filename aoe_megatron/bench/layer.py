"""Layer level: the AoE MoE layer against megatron-core's stock MoE layer at the paper's shapes.

Arms: ``moe`` (megatron-core's MoELayer, SequentialMLP on CPU, TE grouped GEMM on CUDA with TE),
``moe-grouped`` (the same layer, weights and routing with megatron-core's grouped-GEMM experts:
the legacy GroupedMLP through a ``torch._grouped_mm`` adapter on megatron-core 0.16.1,
TEGroupedMLP where that is gone and TE is in use; ``mcore_grouped.py``), ``aoe`` (AoE
defaults), ``aoe-full-cache`` (lean_cache off: the [T, E * R] cache kept for the
norms' backward instead of recomputed), ``aoe-padded`` / ``aoe-grouped_mm`` (the other expert
backends, where they apply: what "auto" chooses from), ``aoe-d_wide64`` and
``aoe-d_wide64-nearest`` (d_wide rounded up / to the nearest multiple of 64, where Eq. 5's is not
one) and ``aoe-naive`` (lean_cache off, the plain per-expert autograd experts: the implementation
before issue #11); see ``arms.py``. Each step is forward +
backward of ``(out * g).sum()`` for a fixed random g (the aux loss reaches the router through
MoEAuxLossAutoScaler). The arms alternate rep by rep after one warm-up each.

Shapes: the paper's blocks (``732m``, ``4b``, ``fine64``) and, only when named, ``732m-ep8`` and
``4b-ep8``: the block as one rank of an EP=8 job computes it (one local expert fed the T K = 8192
rows balanced routing sends it; the all-to-all and the routing over all 8 experts left out, which
flatters AoE by up to 7.7% of its FLOPs: ``arms.per_rank``).

Two phases, so that memory probing never slows the timings: ``phase="time"`` times every shape
with the allocator as it is; ``phase="memory"`` (run after ``measure.enable_cpu_peak_tracking``)
takes saved-for-backward bytes and peak memory from one untimed step per arm and recompute
policy (on CPU in a fresh process: ``fresh.py``). ``merge`` joins the two and adds each arm's
d_wide and parameters per expert, so a rounded d_wide's time is read beside what it costs.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict

import torch

from aoe_megatron.bench import mcore_grouped
from aoe_megatron.bench.arms import (ARM_FIELDS, NAMED_ONLY_SHAPES, QUICK_SHAPES, SHAPES, LayerShape,
                                     arm_d_wide, arm_skips, arms_for, build_aoe, build_moe,
                                     expert_params, shape_flops, forward_backward, layer_transformer_config)
from aoe_megatron.bench.measure import SavedTensorBytes, peak_memory, ratio, summarize, timed

# NOTE: the default run's time budget (< 20 min on 2 CPU cores): the 4b shape, ~3x the FLOPs of
# 732m, gets 3 timed reps unless --reps is given.
DEFAULT_REPS = {"4b": 3}
SAVED_BYTES_LIMIT = 1.03  # issue #11: AoE/MoE saved bytes under the same recompute policy
TIME_SLACK = 0.02  # issue #11: AoE/MoE time <= FLOP ratio + 0.02
#: arm -> its time target's key in ``ratios["targets"]``
TIME_TARGETS = {"aoe": "time", "aoe-full-cache": "time_full_cache",
                "aoe-d_wide64": "time_d_wide64", "aoe-d_wide64-nearest": "time_d_wide64_nearest"}


def measure_memory(layer, x, g, device: str) -> dict:
    """Saved-for-backward bytes (parameters excluded) and peak memory of one step.

    NOTE: gradients start as None, as under DeepSpeed ZeRO-1/2 (this project's engine), which
    frees each ``.grad`` once reduced: the peak is what the step adds above the parameters,
    the gradients it produces included (about the same for both architectures at parameter
    parity).
    """
    counter = SavedTensorBytes(exclude=list(layer.parameters()))
    for t in (*layer.parameters(), x):
        t.grad = None

    def run():
        with counter:
            out, _ = layer(x)
        (out * g).sum().backward()

    peak = peak_memory(run, device)
    for t in (*layer.parameters(), x):  # free the gradients before the next layer is measured
        t.grad = None
    return {"saved_bytes": counter.nbytes, "peak_bytes": peak}


def verdict(value: float | None, limit: float) -> str:
    if value is None:
        return "n/a"
    return "met" if value <= limit else f"missed by {value - limit:.3f}"


def _build_arms(shape: LayerShape, arms: list[str], *, device, dtype, use_te):
    tc = layer_transformer_config(shape, dtype=dtype, device=device, use_te=use_te)
    torch.manual_seed(0)
    layers = {"moe": build_moe(tc, device=device, use_te=use_te)}
    if "moe-grouped" in arms:  # the moe arm's router and experts, in grouped-GEMM experts
        layers["moe-grouped"] = mcore_grouped.build_grouped_moe(tc, device=device, use_te=use_te)
        mcore_grouped.copy_from_sequential(layers["moe-grouped"], layers["moe"])
    first_at = {}  # d_wide -> the first arm built at it: later arms of that width take its weights
    for arm in arms:
        if ARM_FIELDS[arm] is None:
            continue
        layers[arm] = build_aoe(tc, shape, device=device, **ARM_FIELDS[arm])
        _check_width(layers[arm], shape, arm)
        width = arm_d_wide(shape, arm)
        if width in first_at:  # same weights, same routing
            layers[arm].load_state_dict(layers[first_at[width]].state_dict())
        first_at.setdefault(width, arm)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.tokens, 1, shape.d_model, generator=gen).to(device, dtype)
    x.requires_grad_(True)
    g = torch.randn(shape.tokens, 1, shape.d_model, generator=gen).to(device, dtype)
    return layers, x, g


def _check_width(layer, shape: LayerShape, arm: str) -> None:
    """The report's d_wide and parameters per expert come from ``arm_d_wide`` /
    ``expert_params``: refuse to measure a layer that was built otherwise."""
    want = (arm_d_wide(shape, arm), shape.num_experts * expert_params(shape, arm))
    got = (layer.aoe.resolved_d_wide, sum(p.numel() for p in layer.parameters()))
    if got != want:
        raise RuntimeError(f"arm {arm}: built with (d_wide, parameters) {got}, the report "
                           f"would say {want}")


def bench_shape(name: str, shape: LayerShape, *, device: str, dtype: torch.dtype, use_te: bool,
                reps: int, phase: str = "time", arms: list[str] | None = None, log=print) -> dict:
    """One phase ("time" or "memory") of ``arms`` (default all; ``moe`` always) at one shape."""
    wanted = None if arms is None else ["moe", *arms]
    skipped = {arm: why for arm, why in arm_skips(shape, device=device, dtype=dtype,
                                                  use_te=use_te).items()
               if wanted is None or arm in wanted}
    for arm, why in skipped.items():
        log(f"[layer {name}] {phase}: dropping {arm}: {why}")
    arms = arms_for(shape, device=device, dtype=dtype, wanted=wanted, use_te=use_te)
    log(f"[layer {name}] {phase}: building T={shape.tokens} D={shape.d_model} E={shape.num_experts} "
        f"K={shape.top_k} F={shape.d_ffn} R={shape.d_low} W={shape.d_wide}; arms {', '.join(arms)}")
    # the grouped-GEMM adapter is installed for this shape's build and steps only
    with mcore_grouped.installed() if "moe-grouped" in arms else contextlib.nullcontext():
        res = _bench_arms(name, shape, arms, device=device, dtype=dtype, use_te=use_te,
                          reps=reps, phase=phase, log=log)
    return {**res, "skipped_arms": skipped} if phase == "time" else res


def _bench_arms(name, shape, arms, *, device, dtype, use_te, reps, phase, log) -> dict:
    layers, x, g = _build_arms(shape, arms, device=device, dtype=dtype, use_te=use_te)
    for arm in arms:
        if ARM_FIELDS[arm] is None:
            log(f"[layer {name}] {arm}: megatron-core {type(layers[arm].experts).__name__} experts")
    if phase == "memory":
        out = {}
        for arm in arms:
            log(f"[layer {name}] {arm} saved bytes + peak memory")
            out[arm] = measure_memory(layers[arm], x, g, device)
        recompute = _recompute_rows(name, shape, layers, x, g, device=device, dtype=dtype,
                                    use_te=use_te, log=log)
        return {"arms": out, "recompute": recompute}
    for arm in arms:
        log(f"[layer {name}] {arm} warm-up")
        forward_backward(layers[arm], x, g)
    wall = {arm: [] for arm in arms}
    cpu = {arm: [] for arm in arms}
    for i in range(reps):
        for arm in arms:  # alternate the arms rep by rep
            w, c = timed(lambda: forward_backward(layers[arm], x, g), device)
            wall[arm].append(w)
            cpu[arm].append(c)
            log(f"[layer {name}] {arm} rep {i + 1}/{reps}: {w:.3f} s wall, {c:.3f} s CPU")
    return {"shape": {**asdict(shape), "d_wide": shape.d_wide},
            "arms": {arm: {"time_s": summarize(wall[arm]), "cpu_s": summarize(cpu[arm]),
                           "experts_class": type(layers[arm].experts).__name__}
                     for arm in arms}}


def merge(timed_part: dict, memory_part: dict | None) -> dict:
    """Join the phases of every shape and compute the ratios against megatron-core's MoE."""
    out = {}
    for name, res in timed_part.items():
        mem = (memory_part or {}).get(name, {"arms": {}, "recompute": []})
        arms = {arm: {**a, **mem["arms"].get(arm, {"saved_bytes": None, "peak_bytes": None})}
                for arm, a in res["arms"].items()}
        shape = LayerShape(**{k: v for k, v in res["shape"].items() if k != "d_wide"})
        flops = shape_flops(shape, list(arms))
        out[name] = {"shape": res["shape"], "flops": flops,
                     "skipped_arms": res.get("skipped_arms", {}),
                     "experts": expert_sizes(shape, list(arms)), "arms": arms,
                     "recompute": mem["recompute"], "ratios": _ratios(arms, mem["recompute"], flops)}
    return out


def expert_sizes(shape: LayerShape, arms: list[str]) -> dict:
    """Each arm's expert width (AoE: d_wide; MoE: d_ffn) and parameters per expert, also as a
    ratio to MoE's."""
    moe = expert_params(shape, "moe")
    out = {}
    for arm in arms:
        is_moe = ARM_FIELDS[arm] is None
        n = expert_params(shape, arm)
        out[arm] = {"d_wide": None if is_moe else arm_d_wide(shape, arm),
                    "d_ffn": shape.d_ffn if is_moe else None, "params": n, "params_vs_moe": n / moe}
    return out


def _recompute_rows(name, shape, base, x, g, *, device, dtype, use_te, log) -> list[dict]:
    """Saved bytes and peak memory under recompute policies (one untimed step each, cold), AoE
    with the weights of the first arm measured at Eq. 5's d_wide (``aoe``, unless --arms left it
    out)."""
    moe_policy = ["moe"]
    tc_moe = layer_transformer_config(shape, dtype=dtype, device=device, use_te=use_te,
                                recompute_modules=moe_policy)
    tc = layer_transformer_config(shape, dtype=dtype, device=device, use_te=use_te)
    ref = next((a for a in base if ARM_FIELDS[a] is not None
                and arm_d_wide(shape, a) == shape.d_wide), None)
    builds = [("moe", "moe", lambda: build_moe(tc_moe, device=device, use_te=use_te), "moe"),
              ("moe", "aoe", lambda: build_aoe(tc_moe, shape, device=device), ref),
              ("low_rank", "aoe", lambda: build_aoe(tc, shape, device=device,
                                                    recompute_low_rank=True), ref)]
    if use_te:  # megatron-core's moe_act recompute needs the grouped GEMM (CUDA + TE)
        tc_act = layer_transformer_config(shape, dtype=dtype, device=device, use_te=True,
                                    recompute_modules=["moe_act"])
        builds.append(("moe_act", "moe", lambda: build_moe(tc_act, device=device, use_te=True), "moe"))
    rows = []
    for policy, arch, build, weights_from in builds:
        log(f"[layer {name}] recompute {policy}: {arch} saved bytes + peak memory")
        layer = build()
        if weights_from is not None:
            layer.load_state_dict(base[weights_from].state_dict())
        rows.append({"policy": policy, "arch": arch, **measure_memory(layer, x, g, device)})
        del layer
    return rows


def _ratios(arms: dict, recompute: list[dict], flops: dict) -> dict:
    def against_moe(arm, key, sub=None):
        a, m = arms[arm][key], arms["moe"][key]
        if a is None or m is None:
            return None
        return ratio(a[sub], m[sub]) if sub else ratio(a, m)

    out = {"flops": flops["ratio"]}
    for arm in arms:
        if arm != "moe":
            out[arm] = {"time": against_moe(arm, "time_s", "median"),
                        "cpu": against_moe(arm, "cpu_s", "median"),
                        "saved_bytes": against_moe(arm, "saved_bytes"),
                        "peak": against_moe(arm, "peak_bytes"),
                        "flops": flops["model"][arm] / flops["model"]["moe"],
                        "hardware_flops": flops["hardware"][arm] / flops["hardware"]["moe"]}
    by = {(r["policy"], r["arch"]): r["saved_bytes"] for r in recompute}
    rc = ratio(by[("moe", "aoe")], by[("moe", "moe")]) if by else None
    out["saved_bytes_recompute_moe"] = rc
    if by and arms["moe"]["saved_bytes"]:
        out["saved_bytes_low_rank_vs_moe_none"] = ratio(by[("low_rank", "aoe")],
                                                        arms["moe"]["saved_bytes"])
    if ("moe_act", "moe") in by:
        out["saved_bytes_low_rank_vs_moe_act"] = ratio(by[("low_rank", "aoe")], by[("moe_act", "moe")])
    out["targets"] = {
        **{key: verdict(out[arm]["time"], out[arm]["flops"] + TIME_SLACK)
           for arm, key in TIME_TARGETS.items() if arm in out},
        "saved_bytes_none": verdict(out["aoe"]["saved_bytes"] if "aoe" in out else None,
                                    SAVED_BYTES_LIMIT),
        "saved_bytes_recompute_moe": verdict(rc, SAVED_BYTES_LIMIT),
    }
    return out


def reps_for(name: str, reps: int, *, explicit: bool) -> int:
    """Timed reps at a shape: ``reps``, or the shape's lower default when reps were not given."""
    return reps if explicit else min(reps, DEFAULT_REPS.get(name, reps))


def run(*, quick: bool, shapes: list[str] | None, device: str, dtype: torch.dtype, use_te: bool,
        reps: int, reps_explicit: bool = True, phase: str = "time", arms: list[str] | None = None,
        log=print) -> dict:
    table = QUICK_SHAPES if quick else SHAPES
    names = shapes or [n for n in table if n not in NAMED_ONLY_SHAPES]
    return {name: bench_shape(name, table[name], device=device, dtype=dtype, use_te=use_te,
                              reps=reps_for(name, reps, explicit=reps_explicit), phase=phase,
                              arms=arms, log=log)
            for name in names}
