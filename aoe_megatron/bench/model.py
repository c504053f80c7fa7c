"""Model level: a GPTModel training step (forward, backward, AdamW) with AoE or stock MoE layers.

Reports tokens/s, peak memory and model FLOPs utilisation (MFU): the analytic model FLOPs of a
step (``flops.model_step_flops``) divided by the step time and by a peak, two of them, each named
where it is shown: ``mfu_matmul``, the best FLOP/s of a bare n x n x n matmul measured in the same
run at the same dtype (``measure.gemm_peak_flops``; n = 8192 on CUDA, 2048 on the CPU, 512 with
--quick), and ``mfu_datasheet``, the GPU's datasheet dense bf16 peak
(``measure.datasheet_peak_flops``; None on the CPU, for fp32, or for a GPU not in its table).

Archs (``ARCHS``): ``moe`` (megatron-core's MoE layers, the baseline every ratio is against),
``aoe`` (AoE defaults: expert_backend "auto"), ``aoe-loop`` / ``aoe-grouped_mm`` (AoE with that
expert backend, to see what "auto" chose against the other on a GPU).
"""

from __future__ import annotations

import torch

from aoe_megatron.bench import flops as fl
from aoe_megatron.bench.measure import (datasheet_peak_flops, gemm_peak_flops, peak_memory, ratio,
                                         summarize, timed)
from aoe_megatron.bench.names import (ARCHS, DEFAULT_ARCHS, GPU_ONLY_MODELS, MODELS,
                                       QUICK_MODELS)
from aoe_megatron.models.gpt import build_gpt_model, load_preset, transformer_config
from aoe_megatron.models.params import count_parameters
from aoe_megatron.moe import loss_tracker


def default_models(*, quick: bool, device: str) -> list[str]:
    """Every entry of the table (QUICK_MODELS with --quick), on CPU less GPU_ONLY_MODELS."""
    if quick:
        return list(QUICK_MODELS)
    return [n for n in MODELS if device != "cpu" or n not in GPU_ONLY_MODELS]


def _overrides(model: dict, arch: dict) -> dict:
    """The model entry's overrides with the arch's on top, nested sections ("aoe") merged."""
    out = dict(model)
    for key, value in arch.items():
        out[key] = {**out[key], **value} if isinstance(out.get(key), dict) else value
    return out


def build_model(preset: str, overrides: dict, arch: str, *, device: str, dtype: torch.dtype,
                use_te: bool):
    """(ModelConfig, GPTModel) of ``preset`` with ``overrides`` as ``arch`` (of ``ARCHS``), on
    ``device`` in ``dtype``, seeded (weights identical across calls)."""
    base_arch, arch_overrides = ARCHS[arch]
    cfg = load_preset(preset, arch=base_arch, **_overrides(overrides, arch_overrides))
    extra = {"use_cpu_initialization": device == "cpu", "params_dtype": dtype,
             "bf16": dtype == torch.bfloat16}
    if use_te and base_arch == "moe":
        extra["moe_grouped_gemm"] = True  # megatron-core's TE spec uses TEGroupedMLP
    tc = transformer_config(cfg, **extra)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, tc, use_te=use_te).to(device=device, dtype=dtype)
    return cfg, model


def _step_fn(model, opt, inputs, labels, position_ids):
    def step():
        # NOTE: gradients are freed between steps (torch's default, and DeepSpeed ZeRO frees each
        # .grad once reduced): a step's peak is what it adds above parameters and optimizer
        # state, the gradients it produces included.
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, position_ids, None, labels=labels).float().mean()
        loss.backward()
        opt.step()
        loss_tracker.clear()

    return step


def matmul_params(cfg) -> int:
    """Parameters a token multiplies by: every W_down for AoE (the cache covers all experts), the
    K selected experts, attention, router, output layer; the input embedding (a lookup) excluded."""
    count = count_parameters(cfg)
    return count.active_with_all_caches - count.embedding


def bench_model(name: str, preset: str, overrides: dict, micro_batch: int, *, device: str,
                dtype: torch.dtype, use_te: bool, reps: int, archs=DEFAULT_ARCHS,
                phase: str = "time", log=print) -> dict:
    """One phase of a model for each of ``archs``: "time" (alternating timed steps) or "memory"
    (one untimed step's peak, run after ``measure.enable_cpu_peak_tracking``)."""
    runs, cfgs = {}, {}
    for arch in archs:
        log(f"[model {name}] {phase}: building {arch}")
        cfg, model = build_model(preset, overrides, arch, device=device, dtype=dtype,
                                 use_te=use_te)
        seq = cfg.seq_length
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=gen).to(device)
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch, -1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        runs[arch] = _step_fn(model, opt, tokens[:, :-1], tokens[:, 1:], position_ids)
        cfgs[arch] = cfg
        if phase == "memory":  # one model at a time: the other's memory stays out of the probe
            log(f"[model {name}] {arch} warm-up (allocates the AdamW state), then peak memory")
            runs[arch]()
            runs[arch] = peak_memory(runs[arch], device)
    if phase == "memory":
        return {"archs": {arch: {"peak_bytes": runs[arch]} for arch in archs}}
    for arch in archs:
        log(f"[model {name}] {arch} warm-up (allocates the AdamW state)")
        runs[arch]()
    wall = {arch: [] for arch in archs}
    cpu = {arch: [] for arch in archs}
    for i in range(reps):
        for arch in archs:
            w, c = timed(runs[arch], device)
            wall[arch].append(w)
            cpu[arch].append(c)
            log(f"[model {name}] {arch} rep {i + 1}/{reps}: {w:.3f} s wall, {c:.3f} s CPU")
    out = {}
    for arch in archs:
        cfg = cfgs[arch]
        tokens = micro_batch * cfg.seq_length
        n = matmul_params(cfg)
        step_flops = fl.model_step_flops(tokens=tokens, matmul_params=n, num_layers=cfg.num_layers,
                                         d_model=cfg.hidden_size, seq_length=cfg.seq_length)
        out[arch] = {"time_s": summarize(wall[arch]), "cpu_s": summarize(cpu[arch]),
                     "tokens_per_step": tokens, "matmul_params": n,
                     "model_flops_per_step": step_flops, "arch_overrides": ARCHS[arch][1]}
    return {"preset": preset, "overrides": overrides, "micro_batch": micro_batch,
            "seq_length": cfgs["moe"].seq_length, "num_layers": cfgs["moe"].num_layers,
            "archs": out}


def merge(timed_part: dict, memory_part: dict | None) -> dict:
    """Join the phases: tokens/s, MFU against each peak (``mfu_matmul``, ``mfu_datasheet``),
    ratios to moe."""
    peak, sheet = timed_part["matmul_peak_flops"], timed_part["datasheet_peak_flops"]
    models = {}
    for name, res in timed_part["models"].items():
        mem = (memory_part or {}).get(name, {"archs": {}})
        archs = {}
        for arch, a in res["archs"].items():
            median = a["time_s"]["median"]
            archs[arch] = {**a, "peak_bytes": mem["archs"].get(arch, {}).get("peak_bytes"),
                           "tokens_per_s": a["tokens_per_step"] / median,
                           "mfu_matmul": a["model_flops_per_step"] / median / peak,
                           "mfu_datasheet": (a["model_flops_per_step"] / median / sheet
                                             if sheet else None)}
        moe = archs["moe"]
        models[name] = {**res, "archs": archs, "ratios": {arch: {
            "time": ratio(a["time_s"]["median"], moe["time_s"]["median"]),
            "peak": ratio(a["peak_bytes"], moe["peak_bytes"]) if moe["peak_bytes"] else None,
            "flops": ratio(a["model_flops_per_step"], moe["model_flops_per_step"])}
            for arch, a in archs.items() if arch != "moe"}}
    return {**{k: v for k, v in timed_part.items() if k != "models"}, "models": models}


def run(*, quick: bool, device: str, dtype: torch.dtype, use_te: bool, reps: int,
        models: list[str] | None = None, archs=DEFAULT_ARCHS, phase: str = "time",
        log=print) -> dict:
    """``models`` (default: ``default_models``) of the table (QUICK_MODELS with --quick), each
    with ``archs`` (``moe`` among them: the ratios' baseline)."""
    if "moe" not in archs:
        raise ValueError(f"the model level needs arch 'moe' (every ratio's baseline), got {archs}")
    table = QUICK_MODELS if quick else MODELS
    names = models or default_models(quick=quick, device=device)
    results = {name: bench_model(name, *table[name], device=device, dtype=dtype, use_te=use_te,
                                 reps=reps, archs=archs, phase=phase, log=log)
               for name in names}
    if phase == "memory":
        return results
    n = 512 if quick else (8192 if device == "cuda" else 2048)
    log(f"[model] measuring the matmul peak ({n}^3, {dtype})")
    peak = gemm_peak_flops(device, dtype, n=n)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    sheet, note = datasheet_peak_flops(name, dtype)
    log(f"[model] matmul peak {peak / 1e9:.1f} GFLOP/s; datasheet: {note}")
    return {"matmul_peak_flops": peak, "matmul_n": n, "datasheet_peak_flops": sheet,
            "datasheet_note": note, "models": results}
