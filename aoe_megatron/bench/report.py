"""The benchmark's outputs: ``results.json`` (every number) and ``README.md`` (the tables)."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path

import torch

from aoe_megatron.bench.layer import TIME_TARGETS

MIB = 2 ** 20


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: str) -> dict:
    info = {"cpu": cpu_model(), "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "megatron_core": _version("megatron-core"),
            "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
            "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _ms(summary: dict) -> str:
    return f'{summary["median"] * 1e3:.1f} ({summary["min"] * 1e3:.1f}-{summary["max"] * 1e3:.1f})'


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.3f}"


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f}"


def _layer_notes(layer: dict) -> list[str]:
    """The experts class each megatron-core arm ran, and the arms left out, each with why."""
    classes = sorted({(arm, a["experts_class"]) for res in layer.values()
                      for arm, a in res["arms"].items() if a.get("experts_class") and
                      not a["experts_class"].startswith("AoE")})
    out = []
    if classes:
        adapter = (" (GroupedMLP through a `torch._grouped_mm` adapter: "
                   "`aoe_megatron/bench/mcore_grouped.py`)" if ("moe-grouped", "GroupedMLP") in classes
                   else "")
        out += ["", "megatron-core's experts: " + ", ".join(f"`{arm}` {cls}" for arm, cls in classes)
                + adapter + "."]
    skipped = [f"{name} `{arm}`: {why}" for name, res in layer.items()
               for arm, why in res.get("skipped_arms", {}).items()]
    if skipped:
        out += ["", "Not measured: " + "; ".join(skipped) + "."]
    return out


def layer_tables(layer: dict) -> list[str]:
    out = ["## Layer level: one MoE block, forward + backward", "",
           "Time in ms: median (min-max) over the timed reps, arms alternating. Saved: bytes autograd "
           "keeps for backward (parameters excluded). Peak: memory the step adds above the "
           "parameters, the gradients it produces included (they start as None, as DeepSpeed ZeRO "
           "frees them once reduced). GFLOP: model (hardware, with recompute) for fwd + bwd. "
           "d_wide: the AoE arm's expert width (Eq. 5, or rounded to a multiple as the arm says; "
           "`moe`: its d_ffn). Params/expert: D R + R d_wide + 2 D d_wide for AoE (W_down, W_up, "
           "W_p, W_o), 3 D d_ffn for `moe`; vs moe: their ratio.", "",
           "| shape | arm | wall ms | CPU ms | saved MiB | peak MiB | GFLOP model (hw) | d_wide | "
           "params/expert | vs moe |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in layer.items():
        for arm, a in res["arms"].items():
            model, hw = res["flops"]["model"][arm], res["flops"]["hardware"][arm]
            e = res["experts"][arm]
            width = e["d_wide"] if e["d_wide"] is not None else f'(d_ffn {e["d_ffn"]})'
            out.append(f'| {name} | {arm} | {_ms(a["time_s"])} | {_ms(a["cpu_s"])} | '
                       f'{_mib(a["saved_bytes"])} | {_mib(a["peak_bytes"])} | '
                       f'{model / 1e9:.1f} ({hw / 1e9:.1f}) | {width} | {e["params"]:,} | '
                       f'{e["params_vs_moe"]:.4f} |')
    out += _layer_notes(layer)
    out += ["", "Ratios against `moe` (medians) and the issue #11 targets: time <= FLOP ratio + 0.02 "
            "(the arm's model FLOPs), saved bytes <= 1.03 under the same recompute policy.", "",
            "| shape | arm | FLOP ratio model (hw) | time | CPU time | saved | peak | target time | target saved |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, res in layer.items():
        r = res["ratios"]
        t = r["targets"]
        targets = {arm: (t.get(key, ""), t["saved_bytes_none"] if arm == "aoe" else "")
                   for arm, key in TIME_TARGETS.items()}
        for arm in res["arms"]:
            if arm == "moe":
                continue
            t_time, t_saved = targets.get(arm, ("", ""))
            out.append(f'| {name} | {arm} | {r[arm]["flops"]:.3f} ({r[arm]["hardware_flops"]:.3f}) | '
                       f'{_x(r[arm]["time"])} | {_x(r[arm]["cpu"])} | {_x(r[arm]["saved_bytes"])} | '
                       f'{_x(r[arm]["peak"])} | {t_time} | {t_saved} |')
    out += ["", "Recompute policies (one untimed step each): `moe` = megatron recompute_modules "
            "[\"moe\"] for both; `low_rank` = AoE recompute_low_rank (ratio against `moe` without "
            "recompute); `moe_act` (CUDA + TE only).", "",
            "| shape | policy | arch | saved MiB | peak MiB | extra hw GFLOP |", "|---|---|---|---|---|---|"]
    for name, res in layer.items():
        f = res["flops"]
        for row in res["recompute"]:
            key = {"moe": "moe_layer"}.get(row["policy"], row["policy"])
            table = f["recompute_extra_aoe"] if row["arch"] == "aoe" else f["recompute_extra_moe"]
            extra = table.get(key, 0)
            out.append(f'| {name} | {row["policy"]} | {row["arch"]} | {_mib(row["saved_bytes"])} | '
                       f'{_mib(row["peak_bytes"])} | {extra / 1e9:.1f} |')
        r = res["ratios"]
        out.append(f'| {name} | ratio aoe/moe (policy moe) | | {_x(r["saved_bytes_recompute_moe"])} '
                   f'({r["targets"]["saved_bytes_recompute_moe"]}) | | |')
    return out


def _pct(r: float | None) -> str:
    return "n/a" if r is None else f"{r * 100:.1f}%"


def model_tables(model: dict) -> list[str]:
    n, sheet = model["matmul_n"], model["datasheet_peak_flops"]
    sheet_text = (f"{sheet / 1e12:.0f} TFLOP/s" if sheet else "none") + f' ({model["datasheet_note"]})'
    out = ["## Model level: GPTModel training step (fwd + bwd + AdamW)", "",
           "MFU = (6 N T + 12 L D S T) / step time / peak (N: parameters a token multiplies by), "
           f"against two peaks: MFU vs matmul, a {n}x{n}x{n} matmul measured in this run "
           f'({model["matmul_peak_flops"] / 1e9:.1f} GFLOP/s); MFU vs datasheet, the GPU\'s '
           f"dense bf16 datasheet peak: {sheet_text}. "
           "Peak memory: what a step adds above parameters and AdamW state, its gradients included.", "",
           "| model | arch | layers x seq x batch | wall ms | tokens/s | peak MiB | MFU vs matmul | "
           "MFU vs datasheet |",
           "|---|---|---|---|---|---|---|---|"]
    for name, res in model["models"].items():
        dims = f'{res["num_layers"]} x {res["seq_length"]} x {res["micro_batch"]}'
        for arch, a in res["archs"].items():
            out.append(f'| {name} | {arch} | {dims} | {_ms(a["time_s"])} | {a["tokens_per_s"]:.0f} | '
                       f'{_mib(a["peak_bytes"])} | {_pct(a["mfu_matmul"])} | '
                       f'{_pct(a["mfu_datasheet"])} |')
        for arch, r in res["ratios"].items():
            out.append(f'| {name} | {arch}/moe | | time {_x(r["time"])} | FLOPs {_x(r["flops"])} | '
                       f'peak {_x(r["peak"])} | | |')
    return out


def ep_tables(ep: dict) -> list[str]:
    out = ["## Expert parallel (EP=2)", ""]
    if "skipped" in ep:
        return out + [f'Skipped: {ep["skipped"]}.']
    s = ep["shape"]
    out += [f'{ep["world_size"]} ranks, T={s["tokens"]} tokens per rank, D={s["d_model"]}, '
            f'E={s["num_experts"]}, K={s["top_k"]}, R={s["d_low"]}. All-to-all KiB sent to the '
            "other rank per step (rank 0).", "",
            "| arm | wall ms | time ratio | fwd KiB | bwd KiB | dispatch row width (expected) |",
            "|---|---|---|---|---|---|"]
    for arm, a in ep["arms"].items():
        ratio = ep["ratios"].get(arm, {}).get("time", 1.0) if arm != "moe" else 1.0
        b = a["all_to_all_bytes"]
        out.append(f'| {arm} | {_ms(a["time_s"])} | {_x(ratio)} | {b["forward"] / 1024:.1f} | '
                   f'{b["backward"] / 1024:.1f} | {a["measured_dispatch_row_width"]:.0f} '
                   f'({a["expected_dispatch_row_width"]}) |')
    return out


def markdown(results: dict) -> str:
    meta = results["meta"]
    m = meta["machine"]
    lines = ["# AoE vs megatron-core MoE: benchmark", "",
             f'Command: `{meta["command"]}`', "",
             f'Date: {meta["date"]}; wall duration {meta["wall_s"]:.0f} s; {meta["reps"]} timed reps '
             f'per arm after one warm-up ({meta["model_reps"]} at the model level); device {m["device"]}, '
             f'dtype {meta["dtype"]}; CPU {m["cpu"]}, {m["cores"]} cores ({m["torch_threads"]} torch '
             f'threads); torch {m["torch"]}, megatron-core {m["megatron_core"]}, '
             f'TransformerEngine {m["transformer_engine"] or "absent"}' +
             (f'; GPU {m["gpu"]}' if "gpu" in m else "") + ".", ""]
    if meta.get("notes"):
        lines += [f"Note: {n}" for n in meta["notes"]] + [""]
    for key, render in (("layer", layer_tables), ("model", model_tables), ("ep", ep_tables)):
        if key in results:
            lines += render(results[key]) + [""]
    return "\n".join(lines)


def write(results: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "README.md"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path.write_text(markdown(results))
    return json_path, md_path
