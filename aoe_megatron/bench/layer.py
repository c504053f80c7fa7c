"""Layer level: the AoE MoE layer against megatron-core's stock MoE layer at the paper's shapes.

Arms: ``moe`` (megatron-core's MoELayer, SequentialMLP on CPU, TE grouped GEMM on CUDA with TE),
``aoe`` (AoE defaults), ``aoe-full-cache`` (lean_cache off: the [T, E * R] cache kept for the
norms' backward instead of recomputed), ``aoe-padded`` / ``aoe-grouped_mm`` (the other expert
backends, where they apply: what "auto" chooses from) and ``aoe-naive`` (lean_cache off, the plain
per-expert autograd experts: the implementation before issue #11). Each step is forward +
backward of ``(out * g).sum()`` for a fixed random g (the aux loss reaches the router through
MoEAuxLossAutoScaler). The arms alternate rep by rep after one warm-up each.

Two phases, so that memory probing never slows the timings: ``phase="time"`` times every shape
with the allocator as it is; ``phase="memory"`` (run after ``measure.enable_cpu_peak_tracking``)
takes saved-for-backward bytes and peak memory from one untimed step per arm and recompute
policy. ``merge`` joins the two.

Shape suffixes: T tokens, D d_model, E experts, K top-k, R d_low, W d_wide, F d_ffn.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from aoe_megatron.bench import flops as fl
from aoe_megatron.bench.measure import SavedTensorBytes, peak_memory, ratio, summarize, timed


@dataclass(frozen=True)
class LayerShape:
    d_model: int
    num_experts: int
    top_k: int
    d_ffn: int
    d_low: int
    tokens: int = 4096

    @property
    def d_wide(self) -> int:
        from aoe_megatron.ops import d_wide_for_parity

        return d_wide_for_parity(d_model=self.d_model, d_ffn=self.d_ffn, d_low=self.d_low)


SHAPES = {
    "732m": LayerShape(d_model=768, num_experts=8, top_k=2, d_ffn=3072, d_low=256),
    "4b": LayerShape(d_model=1280, num_experts=8, top_k=2, d_ffn=5120, d_low=400),
    # d_ffn 1/8 of the dense 3072; d_low 64 is the smallest the paper trains (at 64 experts the
    # cache E * R would otherwise dominate the FLOPs).
    "fine64": LayerShape(d_model=768, num_experts=64, top_k=8, d_ffn=384, d_low=64),
}
QUICK_SHAPES = {
    "tiny8": LayerShape(d_model=64, num_experts=8, top_k=2, d_ffn=128, d_low=16, tokens=256),
    "tiny64": LayerShape(d_model=64, num_experts=64, top_k=8, d_ffn=32, d_low=8, tokens=256),
}
# NOTE: the default run's time budget (< 20 min on 2 CPU cores): the 4b shape, ~3x the FLOPs of
# 732m, gets 3 timed reps unless --reps is given.
DEFAULT_REPS = {"4b": 3}
NAIVE_FIELDS = {"lean_cache": False, "expert_backend": "autograd"}
#: arm -> AoE settings (None: megatron-core's MoE)
ARM_FIELDS = {"moe": None, "aoe": {}, "aoe-full-cache": {"lean_cache": False},
              "aoe-padded": {"expert_backend": "padded"},
              "aoe-grouped_mm": {"expert_backend": "grouped_mm"},
              "aoe-d_wide64": {"d_wide_multiple": 64}, "aoe-naive": NAIVE_FIELDS}
SAVED_BYTES_LIMIT = 1.03  # issue #11: AoE/MoE saved bytes under the same recompute policy
TIME_SLACK = 0.02  # issue #11: AoE/MoE time <= FLOP ratio + 0.02


def transformer_config(shape: LayerShape, *, dtype: torch.dtype, device: str, use_te: bool,
                       recompute_modules: list[str] | None = None, ep: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if recompute_modules:
        extra = {"recompute_granularity": "selective", "recompute_modules": list(recompute_modules)}
    return TransformerConfig(
        num_layers=2, hidden_size=shape.d_model, num_attention_heads=8,
        ffn_hidden_size=shape.d_ffn, moe_ffn_hidden_size=shape.d_ffn,
        num_moe_experts=shape.num_experts, moe_router_topk=shape.top_k,
        expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.01, use_cpu_initialization=device == "cpu", params_dtype=dtype,
        bf16=dtype == torch.bfloat16, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", moe_grouped_gemm=use_te, **extra,
    )


def build_moe(tc, *, device: str, use_te: bool):
    """megatron-core's own MoE layer, as its GPT layer spec builds it."""
    from megatron.core.transformer.spec_utils import build_module

    from aoe_megatron.spec import moe_layer_spec

    spec = moe_layer_spec(tc.num_moe_experts, use_te=use_te)
    return build_module(spec.submodules.mlp, config=tc, layer_number=1).to(device)


def build_aoe(tc, shape: LayerShape, *, device: str, **aoe_fields):
    from megatron.core.transformer.spec_utils import build_module

    from aoe_megatron.config import from_transformer_config
    from aoe_megatron.spec import aoe_mlp_spec

    aoe = from_transformer_config(tc, d_low=shape.d_low, **aoe_fields)
    layer = build_module(aoe_mlp_spec(aoe), config=tc, layer_number=1)
    return layer.to(device=device, dtype=tc.params_dtype)


def train_step(layer, x, g) -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    for p in layer.parameters():
        p.grad = None
    x.grad = None
    out, _ = layer(x)
    (out * g).sum().backward()
    clear_aux_losses_tracker()


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


def arm_d_wide(shape: LayerShape, arm: str) -> int:
    """The arm's d_wide: Eq. 5, rounded up to the arm's d_wide_multiple."""
    multiple = (ARM_FIELDS[arm] or {}).get("d_wide_multiple", 1)
    return -(-shape.d_wide // multiple) * multiple


def arms_for(shape: LayerShape, *, device: str, dtype: torch.dtype) -> list[str]:
    """The arms measured at a shape: grouped_mm only where torch._grouped_mm can run it,
    d_wide64 only where Eq. 5's d_wide is not a multiple of 64 already."""
    from aoe_megatron.grouped import grouped_mm_supports

    widths = (shape.d_model, shape.d_low, shape.d_wide)
    keep = {"aoe-grouped_mm": grouped_mm_supports(dtype, widths, torch.device(device)),
            "aoe-d_wide64": arm_d_wide(shape, "aoe-d_wide64") != shape.d_wide}
    return [a for a in ARM_FIELDS if keep.get(a, True)]


def shape_flops(shape: LayerShape, arms: list[str]) -> dict:
    """Model and hardware FLOPs of one block's training step for each arm."""
    dims = dict(tokens=shape.tokens, d_model=shape.d_model, num_experts=shape.num_experts,
                top_k=shape.top_k)
    aoe_fwd = fl.aoe_block_forward_flops(**dims, d_low=shape.d_low, d_wide=shape.d_wide)
    moe_fwd = fl.moe_block_forward_flops(**dims, d_ffn=shape.d_ffn)
    extra = {opt: fl.recompute_extra_flops(opt, **dims, d_low=shape.d_low, d_wide=shape.d_wide,
                                           d_ffn=shape.d_ffn, arch="aoe")
             for opt in ("moe_layer", "lean_cache", "low_rank")}
    model, hardware = {}, {}
    for arm in arms:
        fields = ARM_FIELDS[arm]
        if fields is None:
            model[arm] = hardware[arm] = fl.training_flops(moe_fwd)
            continue
        model[arm] = fl.training_flops(fl.aoe_block_forward_flops(
            **dims, d_low=shape.d_low, d_wide=arm_d_wide(shape, arm)))
        hardware[arm] = model[arm] + (extra["lean_cache"] if fields.get("lean_cache", True) else 0)
    return {
        "moe_forward": moe_fwd, "aoe_forward": aoe_fwd, "ratio": aoe_fwd / moe_fwd,
        "model": model, "hardware": hardware,
        "recompute_extra_aoe": extra,
        "recompute_extra_moe": {"moe_layer": moe_fwd, "moe_act": 0},
    }


def verdict(value: float | None, limit: float) -> str:
    if value is None:
        return "n/a"
    return "met" if value <= limit else f"missed by {value - limit:.3f}"


def _build_arms(shape: LayerShape, arms: list[str], *, device, dtype, use_te):
    tc = transformer_config(shape, dtype=dtype, device=device, use_te=use_te)
    torch.manual_seed(0)
    layers = {"moe": build_moe(tc, device=device, use_te=use_te)}
    for arm in arms:
        if arm != "moe":
            layers[arm] = build_aoe(tc, shape, device=device, **ARM_FIELDS[arm])
            if arm not in ("aoe", "aoe-d_wide64"):  # same weights, same routing
                layers[arm].load_state_dict(layers["aoe"].state_dict())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.tokens, 1, shape.d_model, generator=gen).to(device, dtype)
    x.requires_grad_(True)
    g = torch.randn(shape.tokens, 1, shape.d_model, generator=gen).to(device, dtype)
    return layers, x, g


def bench_shape(name: str, shape: LayerShape, *, device: str, dtype: torch.dtype, use_te: bool,
                reps: int, phase: str = "time", log=print) -> dict:
    """One phase ("time" or "memory") of every arm at one shape."""
    arms = arms_for(shape, device=device, dtype=dtype)
    log(f"[layer {name}] {phase}: building T={shape.tokens} D={shape.d_model} E={shape.num_experts} "
        f"K={shape.top_k} F={shape.d_ffn} R={shape.d_low} W={shape.d_wide}; arms {', '.join(arms)}")
    layers, x, g = _build_arms(shape, arms, device=device, dtype=dtype, use_te=use_te)
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
        train_step(layers[arm], x, g)
    wall = {arm: [] for arm in arms}
    cpu = {arm: [] for arm in arms}
    for i in range(reps):
        for arm in arms:  # alternate the arms rep by rep
            w, c = timed(lambda: train_step(layers[arm], x, g), device)
            wall[arm].append(w)
            cpu[arm].append(c)
            log(f"[layer {name}] {arm} rep {i + 1}/{reps}: {w:.3f} s wall, {c:.3f} s CPU")
    return {"shape": {**asdict(shape), "d_wide": shape.d_wide},
            "arms": {arm: {"time_s": summarize(wall[arm]), "cpu_s": summarize(cpu[arm])}
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
        out[name] = {"shape": res["shape"], "flops": flops, "arms": arms,
                     "recompute": mem["recompute"], "ratios": _ratios(arms, mem["recompute"], flops)}
    return out


def _recompute_rows(name, shape, base, x, g, *, device, dtype, use_te, log) -> list[dict]:
    """Saved bytes and peak memory under recompute policies (one untimed step each, cold)."""
    moe_policy = ["moe"]
    tc_moe = transformer_config(shape, dtype=dtype, device=device, use_te=use_te,
                                recompute_modules=moe_policy)
    tc = transformer_config(shape, dtype=dtype, device=device, use_te=use_te)
    builds = [("moe", "moe", lambda: build_moe(tc_moe, device=device, use_te=use_te), "moe"),
              ("moe", "aoe", lambda: build_aoe(tc_moe, shape, device=device), "aoe"),
              ("low_rank", "aoe", lambda: build_aoe(tc, shape, device=device,
                                                    recompute_low_rank=True), "aoe")]
    if use_te:  # megatron-core's moe_act recompute needs the grouped GEMM (CUDA + TE)
        tc_act = transformer_config(shape, dtype=dtype, device=device, use_te=True,
                                    recompute_modules=["moe_act"])
        builds.append(("moe_act", "moe", lambda: build_moe(tc_act, device=device, use_te=True), "moe"))
    rows = []
    for policy, arch, build, weights_from in builds:
        log(f"[layer {name}] recompute {policy}: {arch} saved bytes + peak memory")
        layer = build()
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
           for key, arm in (("time", "aoe"), ("time_full_cache", "aoe-full-cache"),
                            ("time_d_wide64", "aoe-d_wide64")) if arm in out},
        "saved_bytes_none": verdict(out["aoe"]["saved_bytes"], SAVED_BYTES_LIMIT),
        "saved_bytes_recompute_moe": verdict(rc, SAVED_BYTES_LIMIT),
    }
    return out


def reps_for(name: str, reps: int, *, explicit: bool) -> int:
    """Timed reps at a shape: ``reps``, or the shape's lower default when reps were not given."""
    return reps if explicit else min(reps, DEFAULT_REPS.get(name, reps))


def run(*, quick: bool, shapes: list[str] | None, device: str, dtype: torch.dtype, use_te: bool,
        reps: int, reps_explicit: bool = True, phase: str = "time", log=print) -> dict:
    table = QUICK_SHAPES if quick else SHAPES
    names = shapes or list(table)
    return {name: bench_shape(name, table[name], device=device, dtype=dtype, use_te=use_te,
                              reps=reps_for(name, reps, explicit=reps_explicit), phase=phase,
                              log=log)
            for name in names}
