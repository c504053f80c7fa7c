"""The review's falsifier: does an AoE expert's cache norm rank it by how well it does on a token?

For every MoE layer l and expert j, the model runs with layer l *forced* to send every token to
expert j alone (weight 1.0; the other layers select as usual) and the per-token next-token loss is
recorded. An unforced forward records layer l's cache norms ||x W_down^i|| [tokens, E]. A layer
"knows what it knows" when the experts with the larger norms are the ones with the lower forced
losses: per token, the Spearman correlation of norms with negated forced losses (chance 0), how
often the top-norm expert is the loss-best one (chance 1/E) and where the loss-best expert sits in
the norm ordering (chance (E + 1) / 2).

NOTE the intervention: expert j is forced on *all* tokens of layer l at once. Below the last layer
the later layers' attention then sees a context that was forced too, so a token's forced loss
measures expert j on the whole prefix, not on that token alone; only at the last layer is it
exactly per-token.

Shape suffixes: N tokens, E experts, B sequences, S positions, D d_model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from aoe_megatron.checkpoint.layout import state_path
from aoe_megatron.checkpoint.model import load_model
from aoe_megatron.models.gpt import ModelConfig
from aoe_megatron.moe import ops
from aoe_megatron.study.checkpoints import (  # noqa: F401 (the probe's public helpers)
    StudyInputError as ProbeError,
    heldout_windows,
    megatron_world,
    open_checkpoint,
)

INTERVENTION = (
    "layer l forced to expert j (weight 1.0) on every token at once, other layers unchanged; "
    "below the last layer later attention sees the forced context, so only the last layer's "
    "forced losses are exactly per-token")


# ----------------------------------------------------------------------------- math

def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..E along the last axis, ties sharing their average rank (scipy's rankdata)."""
    x = np.asarray(x, dtype=np.float64)
    rows = x.reshape(-1, x.shape[-1])
    n, e = rows.shape
    order = np.argsort(rows, axis=1, kind="stable")
    sorted_ = np.take_along_axis(rows, order, axis=1)
    new_group = np.concatenate([np.ones((n, 1), bool), sorted_[:, 1:] != sorted_[:, :-1]], axis=1)
    group = np.cumsum(new_group, axis=1) - 1 + (np.arange(n) * e)[:, None]  # unique over rows
    pos = np.broadcast_to(np.arange(e, dtype=np.float64), (n, e))
    first = np.full(n * e, np.inf)
    last = np.full(n * e, -np.inf)
    np.minimum.at(first, group.ravel(), pos.ravel())
    np.maximum.at(last, group.ravel(), pos.ravel())
    ranks = np.empty_like(rows)
    np.put_along_axis(ranks, order, (first[group] + last[group]) / 2 + 1, axis=1)
    return ranks.reshape(x.shape)


def spearman_rows(a_NE: np.ndarray, b_NE: np.ndarray) -> np.ndarray:
    """Spearman's rho per row: Pearson's r of the average ranks; NaN for a constant row."""
    ra, rb = average_ranks(a_NE), average_ranks(b_NE)
    ra = ra - ra.mean(-1, keepdims=True)
    rb = rb - rb.mean(-1, keepdims=True)
    den = np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(-1) / np.where(den > 0, den, 1), np.nan)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho of two flattened arrays."""
    return float(spearman_rows(np.ravel(a)[None], np.ravel(b)[None])[0])


def _num(x) -> Optional[float]:
    x = float(x)
    return None if math.isnan(x) else x


def layer_metrics(norms_NE: np.ndarray, losses_NE: np.ndarray) -> dict:
    """Norm ranking against forced losses, for one layer (see the module docstring).

    ``spearman_pooled`` is one rho over every (token, expert) pair after removing each token's
    mean norm and mean loss (token difficulty would otherwise dominate)."""
    norms_NE = np.asarray(norms_NE, np.float64)
    losses_NE = np.asarray(losses_NE, np.float64)
    n, e = norms_NE.shape
    rho_N = spearman_rows(norms_NE, -losses_NE)
    ok = ~np.isnan(rho_N)
    best_N = losses_NE.argmin(-1)
    rank_desc_NE = e + 1 - average_ranks(norms_NE)  # 1 = the largest norm
    order_NE = np.argsort(-norms_NE, axis=-1, kind="stable")
    return {
        "spearman_mean": _num(rho_N[ok].mean()) if ok.any() else None,
        "spearman_sem": _num(rho_N[ok].std(ddof=1) / math.sqrt(ok.sum())) if ok.sum() > 1 else None,
        "spearman_undefined_tokens": int((~ok).sum()),
        "spearman_pooled": _num(spearman(norms_NE - norms_NE.mean(-1, keepdims=True),
                                         -(losses_NE - losses_NE.mean(-1, keepdims=True)))),
        "top_norm_is_loss_best": float((norms_NE.argmax(-1) == best_N).mean()),
        "chance_top": 1.0 / e,
        "loss_best_norm_rank_mean": float(rank_desc_NE[np.arange(n), best_N].mean()),
        "chance_rank_mean": (e + 1) / 2,
        "forced_loss_by_norm_rank": np.take_along_axis(losses_NE, order_NE, -1).mean(0).tolist(),
        "forced_loss_by_expert": losses_NE.mean(0).tolist(),
        "forced_loss_mean": float(losses_NE.mean()),
        "oracle_loss": float(losses_NE.min(-1).mean()),
    }


# ----------------------------------------------------------------------------- the intervention

class ExpertForcing:
    """Wraps each AoE layer's ``route``: records the cache norms when ``record`` is set, and when
    ``force == (l, j)`` replaces layer l's selection by expert j with weight 1 for every token.
    The original route always runs first, so random selections draw the same numbers either way."""

    def __init__(self, layers):
        self.layers, self.force, self.record, self.norms = list(layers), None, False, {}

    def __enter__(self):
        self.counted = [layer.token_dispatcher.variable_count for layer in self.layers]
        for i, layer in enumerate(self.layers):
            layer.route = self._wrap(i, layer, layer.route)
            layer.token_dispatcher.variable_count = True  # a forced layer has 1 expert per token
        return self

    def __exit__(self, *exc):
        for layer, counted in zip(self.layers, self.counted):
            del layer.route  # back to the class's method
            layer.token_dispatcher.variable_count = counted

    def _wrap(self, index: int, layer, original):
        def route(hidden_states, padding_mask=None):
            probs_TE, map_TE = original(hidden_states, padding_mask)
            if self.record:
                s, b, d = hidden_states.shape
                cache_TER = ops.low_rank_cache(hidden_states.reshape(-1, d), w_down_DER=layer.router.weight,
                                               num_experts=layer.aoe.num_experts)
                norms_TE = ops.expert_norms(cache_TER, order=layer.aoe.norm).float()
                self.norms[index] = norms_TE.view(s, b, -1).transpose(0, 1).reshape(b * s, -1).cpu()
            if self.force is not None and self.force[0] == index:
                map_TE = torch.zeros_like(map_TE)
                map_TE[:, self.force[1]] = True
                probs_TE = map_TE.to(probs_TE.dtype)
            return probs_TE, map_TE

        return route


def aoe_layers(model) -> list:
    from aoe_megatron.moe.layer import AoEMoELayer  # deferred: megatron-core loads at build

    layers = [layer.mlp for layer in model.decoder.layers]
    if not all(isinstance(m, AoEMoELayer) for m in layers):
        raise ProbeError("the forced-expert probe needs a model whose every MLP is an AoE layer")
    return layers


def token_losses(model, windows: torch.Tensor, *, seed: int) -> torch.Tensor:
    """Per-token next-token losses [B * S] of windows [B, S + 1] (row-major), as in training;
    torch's generator is seeded (and restored) so random selections repeat across forwards."""
    device = next(model.parameters()).device
    inputs, labels = windows[:, :-1].to(device), windows[:, 1:].to(device)
    positions = torch.arange(inputs.shape[1], device=device).expand_as(inputs)
    cuda = [torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        torch.manual_seed(seed)
        return model(inputs, positions, None, labels=labels).float().reshape(-1).cpu()


def probe_model(model, windows: torch.Tensor, *, batch_size: int = 8, seed: int = 0,
                log: Optional[Callable[[str], None]] = None) -> dict:
    """The probe on a built AoE GPTModel (eval mode) and held-out windows [N, S + 1]."""
    layers = aoe_layers(model)
    num_layers, num_experts = len(layers), layers[0].aoe.num_experts
    unforced, norms = [], [[] for _ in layers]
    forced = [[[] for _ in range(num_experts)] for _ in layers]
    batches = list(range(0, windows.shape[0], batch_size))
    model.eval()
    with ExpertForcing(layers) as forcing:
        for b, start in enumerate(batches):
            batch = windows[start : start + batch_size]
            forcing.record, forcing.force = True, None
            unforced.append(token_losses(model, batch, seed=seed + b))
            for i in range(num_layers):
                norms[i].append(forcing.norms.pop(i))
            forcing.record = False
            for i in range(num_layers):
                for j in range(num_experts):
                    forcing.force = (i, j)
                    forced[i][j].append(token_losses(model, batch, seed=seed + b))
            if log:
                log(f"batch {b + 1}/{len(batches)}: {batch.shape[0]} sequences, "
                    f"{num_layers * num_experts + 1} forwards")
    out_layers = []
    for i in range(num_layers):
        losses_NE = torch.stack([torch.cat(f) for f in forced[i]], dim=-1).numpy()
        out_layers.append({"layer": i + 1, **layer_metrics(torch.cat(norms[i]).numpy(), losses_NE)})
    aoe = layers[0].aoe
    return {"num_layers": num_layers, "num_experts": num_experts, "top_k": aoe.top_k,
            "norm": aoe.norm, "selection": aoe.selection, "sequences": int(windows.shape[0]),
            "seq_length": int(windows.shape[1] - 1), "tokens": int(torch.cat(unforced).numel()),
            "unforced_loss": float(torch.cat(unforced).double().mean()),
            "intervention": INTERVENTION, "layers": out_layers}


def probe_config(raw: dict, where=""):
    """The ModelConfig to probe with; refuses models the norm ranking does not apply to. The
    evaluation-time selection is set to "norm" (what the model trained with): "fon" and the
    imitation router select otherwise at evaluation, but the cache norms are what is tested."""
    cfg = ModelConfig.from_dict(raw)
    if cfg.arch != "aoe":
        raise ProbeError(f"{where} is a traditional MoE (arch {cfg.arch!r}): it has no expert norms "
                         f"to probe; for routers, export it (aoe-convert-to-hf) and run "
                         f"aoe-norm-probe --hf")
    if cfg.aoe.rank_source != "cache":
        raise ProbeError(f"{where} ranks experts by rank_source={cfg.aoe.rank_source!r}, not by "
                         f"their cache norms: the norm probe does not apply")
    return cfg.with_overrides(aoe={"inference_selection": "norm"})


def probe_checkpoint(ckpt, windows: torch.Tensor, *, batch_size: int = 8, seed: int = 0,
                     device=None, dtype: str = "fp32", log=None, verify: bool = True) -> dict:
    """The forced-expert probe of an AoE checkpoint (or ckpt dir: its latest) on held-out windows
    [N, S + 1], verified first (``open_checkpoint``; ``verify=False`` skips it): ``probe_step``."""
    step_dir, state = open_checkpoint(ckpt, what="the norm probe", verify=verify)
    return probe_step(step_dir, state, windows, batch_size=batch_size, seed=seed, device=device,
                      dtype=dtype, log=log)


def probe_step(step_dir, state: dict, windows: torch.Tensor, *, batch_size: int = 8,
               seed: int = 0, device=None, dtype: str = "fp32", log=None) -> dict:
    """The probe of a checkpoint opened (and verified) by ``open_checkpoint``; JSON-serialisable,
    one entry per layer (see ``layer_metrics``)."""
    step_dir = Path(step_dir)
    if "model" not in (state.get("config") or {}):
        raise ProbeError(f"{state_path(step_dir)} records no model configuration")
    cfg = probe_config(state["config"]["model"], where=str(step_dir))
    windows = torch.as_tensor(windows).long()
    if windows.ndim != 2 or windows.shape[1] < 2 or windows.shape[1] - 1 > cfg.seq_length:
        raise ProbeError(f"windows must be [N, S + 1] with 1 <= S <= {cfg.seq_length}, got "
                         f"{tuple(windows.shape)}")
    if windows.min() < 0 or windows.max() >= cfg.vocab_size:
        raise ProbeError(f"token ids outside the model's vocabulary of {cfg.vocab_size}")
    with megatron_world(seed):
        model = load_model(step_dir, cfg, device=device, dtype=dtype)
        result = probe_model(model, windows, batch_size=batch_size, seed=seed, log=log)
    notes = []
    configured = state["config"]["model"].get("aoe", {}).get("inference_selection", "norm")
    if configured != "norm":
        notes.append(f"the model evaluates with inference_selection={configured!r}; the probe uses "
                     f"the norm selection it trained with")
    if cfg.aoe.selection == "random":
        notes.append("selection 'random' (the control): experts were drawn at random in training, "
                     "the norms only weighted them; unforced layers draw at random (the same draws "
                     "in every forward)")
    unique = int(torch.unique(windows, dim=0).shape[0])
    return {"checkpoint": str(step_dir), "step": state.get("step"), "arch": "aoe",
            "dtype": dtype, "unique_sequences": unique, "notes": notes, **result}


def markdown(result: dict) -> str:
    e = result["num_experts"]
    lines = [
        f"Forced-expert norm probe: {result['checkpoint']} (step {result['step']}), "
        f"{result['tokens']} held-out tokens ({result['sequences']} x {result['seq_length']}), "
        f"{e} experts, top-{result['top_k']}, {result['norm']} norm. Unforced loss "
        f"{result['unforced_loss']:.4f}.",
        "",
        f"Intervention: {result['intervention']}.",
        "",
        "| layer | Spearman rho (mean +- sem) | pooled rho | top-norm = loss-best | mean norm rank "
        "of loss-best | forced loss by norm rank (1..E) | mean forced | oracle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x, p=3: "n/a" if x is None else f"{x:.{p}f}"
    for m in result["layers"]:
        lines.append(
            f"| {m['layer']} | {fmt(m['spearman_mean'])} +- {fmt(m['spearman_sem'])} | "
            f"{fmt(m['spearman_pooled'])} | {m['top_norm_is_loss_best']:.3f} (chance "
            f"{m['chance_top']:.3f}) | {m['loss_best_norm_rank_mean']:.2f} (chance "
            f"{m['chance_rank_mean']:.2f}) | {' '.join(f'{x:.4f}' for x in m['forced_loss_by_norm_rank'])} "
            f"| {m['forced_loss_mean']:.4f} | {m['oracle_loss']:.4f} |")
    lines += ["", "Chance: rho 0, top-norm = loss-best 1/E, rank (E + 1) / 2 (rank 1 = largest norm)."]
    lines += [f"Note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines) + "\n"
