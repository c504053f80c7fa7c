"""The TransformerEngine path, on a CPU without TE (issue #20, item 2): one checkpoint layout
whatever the spec, and the TE baseline's experts initialised per global expert like the local
baseline's (TE chosen only when it works: test_compat_te.py).

TE is not installed here, so megatron-core's TE layer spec is built by its own function
(``get_gpt_layer_with_transformer_engine_spec``: which slot holds which module, and its
``sharded_state_dict_keys_map``) over a backend whose TE classes are CPU stand-ins carrying TE's
parameter names. Those names come from megatron-core, not from us: the TE spec's own keys map saves
the op-fuser's norm ``mlp.0.weight`` as ``mlp.linear_fc1.layer_norm_weight``, so a TE norm's
parameter is ``weight`` and TE's fused norm-linear keeps it as ``layer_norm_weight``; and
``TEGroupedMLP.sharded_state_dict`` reads ``linear_fc1.weight{i}``, one weight per local expert.
Checkpoints are of the AoE model: its attention and norms are the stock spec's (``aoe_layer_spec``
swaps the MLP only), and its experts need no TE stand-in that would have to save like TE's.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict
from functools import partial

import pytest
import torch
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from aoe_megatron.models import spec as spec_mod
from aoe_megatron.runtime.versions import mcore_at_least

pytestmark = pytest.mark.legs  # the spec helpers over each release's TE spec


class CPUTESpecProvider(TESpecProvider):
    """megatron-core's TE backend with CPU stand-ins for its TE classes (same parameter names).

    Version checks that need an installed TE are answered as TE >= 1.9 would: the q/k norm is
    TENorm, grouped experts are TEGroupedMLP over GroupedLinear."""

    def column_parallel_linear(self):
        return ColumnParallelLinear  # TEColumnParallelLinear

    def row_parallel_linear(self):
        return RowParallelLinear  # TERowParallelLinear

    def column_parallel_layer_norm_linear(self):
        return NormLinear  # TELayerNormColumnParallelLinear

    def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):  # 0.19: residual fusion (off)
        return WrappedTorchNorm  # TENorm (te.pytorch.RMSNorm)

    def core_attention(self):
        return DotProductAttention  # TEDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm=False):
        assert moe_use_grouped_gemm and not moe_use_legacy_grouped_gemm
        if not mcore_at_least("0.17"):  # 0.16.1: (module, submodules); later: a builder
            return TEGroupedMLP, MLPSubmodules(linear_fc1=GroupedLinear, linear_fc2=GroupedLinear)
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules

        return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=GroupedLinear, linear_fc2=GroupedLinear, activation_func=self.activation_func()))


def stock_te_spec(num_experts: int = 4):
    """megatron-core's own TE MoE layer spec, as Megatron-LM builds it (over the CPU backend)."""
    real = getattr(gpt_layer_specs, "TESpecProvider", None)
    gpt_layer_specs.TESpecProvider = CPUTESpecProvider
    try:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=True)
    finally:
        if real is None:
            del gpt_layer_specs.TESpecProvider
        else:
            gpt_layer_specs.TESpecProvider = real


@functools.cache
def te_norm_names() -> tuple:
    """(a TE norm's parameter, the norm's parameter inside TE's fused norm-linear), read from the
    entry megatron-core's TE spec map has for the op-fuser's norm."""
    te_map = stock_te_spec().submodules.sharded_state_dict_keys_map
    (op_key, fused_key), = [(k, v) for k, v in te_map.items() if v.endswith("layer_norm_weight")]
    return op_key.rsplit(".", 1)[1], fused_key.rsplit(".", 1)[1]


class NormLinear(ColumnParallelLinear):
    """Stand-in for TELayerNormColumnParallelLinear: the linear, its RMSNorm's weight beside it."""

    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.register_parameter(te_norm_names()[1], torch.nn.Parameter(torch.ones(input_size)))


class GroupedLinear(torch.nn.Module):
    """Stand-in for TE's GroupedLinear (TEColumn/RowParallelGroupedLinear): one [out, in] weight per
    local expert, ``weight0..weight{n-1}``, drawn by megatron-core's ``init_method``."""

    def __init__(self, num_gemms, input_size, output_size, *, init_method=None, **_):
        super().__init__()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.zeros(output_size, input_size))
            if init_method is not None:
                init_method(weight)
            self.register_parameter(f"weight{i}", weight)


@pytest.fixture
def cpu_te(monkeypatch):
    """megatron-core's TE spec function builds over the CPU stand-ins (it needs TE's provider)."""
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", CPUTESpecProvider, raising=False)


def _tiny(arch: str):
    from aoe_megatron.models.gpt import load_preset, transformer_config

    cfg = load_preset("tiny", arch=arch)
    return cfg, transformer_config(cfg, use_cpu_initialization=True)


# ----------------------------------------------------------------------------- one layout


def _saved_names(model) -> dict:
    """{name each parameter is saved under: tensor}: layer parameters renamed by their layer's own
    ``sharded_state_dict_keys_map``, as ``TransformerLayer.sharded_state_dict`` does."""
    keys_map = model.decoder.layers[0].submodules_config.sharded_state_dict_keys_map
    out = {}
    for name, value in model.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        m = re.match(r"(decoder\.layers\.\d+\.)(.*)", name)
        old = next((o for o in keys_map if m and m[2].startswith(o)), None)
        out[name if old is None else m[1] + keys_map[old] + m[2][len(old):]] = value
    return out


def _te_model(arch: str, *, stock: bool, monkeypatch):
    """A tiny ``arch`` model built by our TE spec, its norms randomised. ``stock``: megatron-core's
    TE keys map left as is (what stock Megatron-LM saves; old code has no align_norm_keys and
    leaves it so anyway)."""
    from aoe_megatron.models.gpt import build_gpt_model

    if stock:
        monkeypatch.setattr(spec_mod, "align_norm_keys", lambda spec, reference: spec, raising=False)
    cfg, tc = _tiny(arch)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, tc, use_te=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_()
    return cfg, model


def _save(model, cfg, step, data) -> None:
    from megatron.core import dist_checkpointing

    (step / "model").mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(step / "model"))
    state = {"step": 1, "consumed_samples": 0, "layout": {"world_size": 1, "expert_parallel_size": 1},
             "config": {"model": asdict(cfg), "train": {"data": str(data)}}}
    (step / "state.json").write_text(json.dumps(state))


def test_norm_key_aliases_are_megatron_cores_two_layouts():
    """The readers' alias table is the local spec's keys map: its key <-> the norm module's own."""
    from aoe_megatron.hf.checkpoint_io import NORM_KEY_ALIASES

    local = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    param = te_norm_names()[0]
    want = {f"decoder.layers.{new}{param}": f"decoder.layers.{old}{param}"
            for old, new in local.submodules.sharded_state_dict_keys_map.items()}
    assert NORM_KEY_ALIASES == want
    from aoe_megatron.hf.checkpoint_io import ConversionError, _our_names

    ours, other = next(iter(want.items()))
    assert _our_names({other: None}, "ckpt") == {ours: other}
    with pytest.raises(ConversionError, match="holds both .* saved in two layouts"):
        _our_names({ours: None, other: None}, "ckpt")


def test_te_checkpoint_has_the_local_layout_and_loads_without_te(cpu_te, megatron_world, tmp_path,
                                                                 monkeypatch):
    """Our TE spec saves every norm under the local spec's key, so a model built without TE loads
    a TE-written checkpoint; megatron-core's TE spec as is would save pre_mlp_layernorm apart."""
    from aoe_megatron.models.gpt import build_gpt_model
    from aoe_megatron.checkpoint.model import load_weights

    cfg, te_model = _te_model("aoe", stock=False, monkeypatch=monkeypatch)
    _save(te_model, cfg, tmp_path / "step_00000001", tmp_path / "data.yaml")
    local = build_gpt_model(cfg, _tiny("aoe")[1], use_te=False)
    te_saved, local_saved = _saved_names(te_model), _saved_names(local)
    assert te_saved.keys() == local_saved.keys(), sorted(te_saved.keys() ^ local_saved.keys())
    load_weights(tmp_path / "step_00000001", local)
    for name, value in _saved_names(local).items():
        torch.testing.assert_close(value, te_saved[name], rtol=0, atol=0, msg=name)

    _, stock = _te_model("aoe", stock=True, monkeypatch=monkeypatch)  # the layout it replaces
    assert sorted(_saved_names(stock).keys() - local_saved.keys()) == [
        f"decoder.layers.{i}.pre_mlp_layernorm.{te_norm_names()[0]}" for i in range(cfg.num_layers)]


@pytest.mark.parametrize("stock", [False, True], ids=["our_te_spec", "stock_megatron_te_spec"])
def test_te_checkpoint_exports_to_hf(stock, cpu_te, megatron_world, corpus, tmp_path, monkeypatch):
    """A checkpoint of either TE layout exports, each norm read from wherever it was saved."""
    from safetensors.torch import load_file

    from aoe_megatron.hf.convert import export_to_hf

    cfg, model = _te_model("aoe", stock=stock, monkeypatch=monkeypatch)
    _save(model, cfg, tmp_path / "ckpt" / "step_00000001", corpus["data"])
    out = export_to_hf(tmp_path / "ckpt" / "step_00000001", tmp_path / "hf", log=None)
    hf = load_file(out / "model.safetensors")
    for i, layer in enumerate(model.decoder.layers):
        qkv_norm = getattr(layer.self_attention.linear_qkv, te_norm_names()[1])
        torch.testing.assert_close(hf[f"model.layers.{i}.input_layernorm.weight"], qkv_norm,
                                   rtol=0, atol=0)
        torch.testing.assert_close(hf[f"model.layers.{i}.post_attention_layernorm.weight"],
                                   layer.pre_mlp_layernorm.weight, rtol=0, atol=0)


# ----------------------------------------------------------------------------- per-global-expert init


def _experts_view(num_local: int, tc):
    """Any module exposing per-expert weights as TE's GroupedLinear does."""
    view = torch.nn.Module()
    view.num_local_experts = num_local
    view.linear_fc1 = GroupedLinear(num_local, tc.hidden_size, 2 * tc.moe_ffn_hidden_size)
    view.linear_fc2 = GroupedLinear(num_local, tc.moe_ffn_hidden_size, tc.hidden_size)
    return view


def _weights(view, fc: str) -> list:
    return [getattr(getattr(view, fc), f"weight{i}").detach() for i in range(view.num_local_experts)]


def test_grouped_expert_init_is_per_global_expert():
    """Distinct experts, the same global expert identical at EP=1 and at EP=2, megatron-core's std."""
    _, tc = _tiny("moe")
    ep1 = _experts_view(4, tc)
    spec_mod.init_experts_per_global_expert_(ep1, module_seed=11, ep_rank=0, config=tc)
    ep2 = [_experts_view(2, tc) for _ in range(2)]
    for rank, view in enumerate(ep2):
        spec_mod.init_experts_per_global_expert_(view, module_seed=11, ep_rank=rank, config=tc)
    std = {"linear_fc1": tc.init_method_std, "linear_fc2": tc.init_method_std / (2 * tc.num_layers) ** 0.5}
    for fc in ("linear_fc1", "linear_fc2"):
        one = torch.stack(_weights(ep1, fc))
        torch.testing.assert_close(torch.stack(_weights(ep2[0], fc) + _weights(ep2[1], fc)), one,
                                   rtol=0, atol=0, msg=f"{fc}: EP=2 differs from EP=1")
        flat = one.flatten(1)
        assert all(not torch.equal(flat[a], flat[b]) for a in range(4) for b in range(a)), fc
        assert abs(one.std().item() / std[fc] - 1) < 0.02, (fc, one.std().item(), std[fc])


def test_te_baseline_experts_start_as_the_local_baseline(cpu_te, megatron_world):
    """moe_layer_spec's TE experts hold exactly the local experts' weights (so the local path's EP
    invariance and std carry over), and building them takes the same one seed from the RNG."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    cfg, tc = _tiny("moe")

    def experts(use_te: bool):
        torch.manual_seed(5)
        spec = spec_mod.moe_submodules(spec_mod.moe_layer_spec(cfg.num_experts, use_te=use_te)).experts
        built = spec_mod.build(spec, cfg.num_experts, tc, pg_collection=get_default_pg_collection())
        return built, torch.rand(4)

    (te, te_after), (local, local_after) = experts(True), experts(False)
    for i, expert in enumerate(local.local_experts):
        for fc in ("linear_fc1", "linear_fc2"):
            torch.testing.assert_close(getattr(getattr(te, fc), f"weight{i}"), getattr(expert, fc).weight,
                                       rtol=0, atol=0, msg=f"expert {i} {fc}")
    torch.testing.assert_close(te_after, local_after, rtol=0, atol=0, msg="RNG left differently")
    assert type(te).__bases__ == (TEGroupedMLP,), type(te)  # megatron-core's TE experts, subclassed
