"""AoEConfig / AoELayerConfig validation, the one step from megatron's TransformerConfig, and
model presets."""

from __future__ import annotations

import typing
from dataclasses import fields, replace

import pytest

from aoe_megatron.moe.config import MEGATRON_FIELD_MAP, AoEConfig, AoELayerConfig
from aoe_megatron.models.gpt import ModelConfig, load_preset
from aoe_megatron.moe.ops import round_to_multiple
from tests.helpers import make_transformer_config

BASE = dict(num_experts=8, top_k=2, d_model=64, d_low=16, d_ffn=128)


@pytest.mark.parametrize(
    "changes,phrase",
    [
        ({"top_k": 9}, "exceeds num_experts"),
        ({"expert_parallel_size": 3}, "not divisible by expert parallel size"),
        ({"d_low": 64}, "must be smaller than d_model"),
        ({"d_low": 80}, "must be smaller than d_model"),
        ({"d_low": 0}, "positive integer"),
        ({"num_experts": -1}, "positive integer"),
        ({"top_k": 0}, "positive integer"),
        ({"d_model": 0}, "positive integer"),
        ({"d_wide": 0}, "positive integer or 'auto'"),
        ({"d_wide": "wide"}, "positive integer or 'auto'"),
        ({"d_wide_multiple": 0}, "d_wide_multiple must be a positive integer"),
        ({"expert_backend": "cuda"}, "unknown AoE expert_backend"),
        ({"lean_cache": "yes"}, "lean_cache must be true or false"),
        ({"d_ffn": None}, "needs a positive d_ffn"),
        ({"selection": "sinkhorn"}, "unknown AoE selection strategy"),
        ({"selection": "top_p", "selection_options": {"p": 1.5}}, "0 < p <= 1"),
        ({"selection_options": {"p": 0.5}}, "unexpected keyword"),
        ({"rank_source": "oracle"}, "unknown AoE rank_source"),
        ({"norm": "l3"}, "unknown AoE norm"),
        ({"cache_mode": "both"}, "unknown AoE cache_mode"),
        ({"dispatcher": "flex"}, "unknown AoE dispatcher"),
        ({"alpha_aux": -0.1}, "alpha_aux must be >= 0"),
    ],
)
def test_invalid_settings_raise_clear_errors(changes, phrase):
    with pytest.raises(ValueError, match=phrase):
        AoELayerConfig(**{**BASE, **changes})


def test_d_wide_auto_follows_eq5():
    assert AoELayerConfig(num_experts=8, top_k=2, d_model=768, d_ffn=3072, d_low=256).resolved_d_wide == 3840
    assert AoELayerConfig(num_experts=8, top_k=2, d_model=1280, d_ffn=5120, d_low=400).resolved_d_wide == 6470
    assert AoELayerConfig(**BASE, d_wide=100).resolved_d_wide == 100
    # rounded up for aligned GEMMs: 6469.2 -> 6528 (a multiple of 64); 3840 already is one
    assert AoELayerConfig(num_experts=8, top_k=2, d_model=1280, d_ffn=5120, d_low=400,
                     d_wide_multiple=64).resolved_d_wide == 6528
    assert AoELayerConfig(num_experts=8, top_k=2, d_model=768, d_ffn=3072, d_low=256,
                     d_wide_multiple=64).resolved_d_wide == 3840


def test_d_wide_rounds_to_the_nearest_multiple():
    """4B: Eq. 5's 6469.2 -> 6464 (101 x 64), expert parameters within 0.1% of the MoE expert's;
    the 732M's 3840 is a multiple of 64 already."""
    four_b = dict(num_experts=8, top_k=2, d_model=1280, d_ffn=5120, d_low=400, d_wide_multiple=64)
    cfg = AoELayerConfig(**four_b, d_wide_round="nearest")
    assert cfg.resolved_d_wide == 6464
    aoe_params = 1280 * 400 + 6464 * (400 + 2 * 1280)
    assert abs(aoe_params / (3 * 1280 * 5120) - 1) < 1e-3
    assert AoELayerConfig(num_experts=8, top_k=2, d_model=768, d_ffn=3072, d_low=256, d_wide_multiple=64,
                     d_wide_round="nearest").resolved_d_wide == 3840
    assert [round_to_multiple(w, multiple=64, mode="nearest") for w in (95, 96, 97, 10)] == [64, 128, 128, 64]
    with pytest.raises(ValueError, match="d_wide_round 'down'"):
        AoELayerConfig(**four_b, d_wide_round="down")


def test_the_layer_reads_its_shared_settings_from_the_transformer_config_in_one_step():
    tc = make_transformer_config(d_model=48, d_ffn=96, num_experts=6, top_k=3, ep=2,
                                 dispatcher="allgather", alpha_aux=0.02)
    own = AoEConfig(d_low=12, d_wide=200, norm="l1", selection="softmax_topk", cache_mode="recompute")
    aoe = AoELayerConfig.from_megatron(tc, own, expert_bias=True, bias_update_rate=0.01)
    assert (aoe.num_experts, aoe.top_k, aoe.d_model, aoe.d_ffn) == (6, 3, 48, 96)
    assert (aoe.alpha_aux, aoe.dispatcher, aoe.expert_parallel_size) == (0.02, "allgather", 2)
    assert (aoe.expert_bias, aoe.bias_update_rate) == (True, 0.01)
    assert aoe.settings == own
    # Every layer field is AoE's own, read from the TransformerConfig, or the model's expert bias:
    # none is forgotten, and none of AoE's own is one of the TransformerConfig's.
    layer = {f.name for f in fields(AoELayerConfig)}
    assert layer == {f.name for f in fields(AoEConfig)} | set(MEGATRON_FIELD_MAP) | {
        "expert_bias", "bias_update_rate"}
    assert not {f.name for f in fields(AoEConfig)} & set(MEGATRON_FIELD_MAP)
    for ours, theirs in MEGATRON_FIELD_MAP.items():
        assert getattr(aoe, ours) == getattr(tc, theirs), ours


def test_aoes_own_settings_are_typed_choices_checked_alone():
    """AoEConfig's choices are Literal types, and validation names the same choices."""
    hints = typing.get_type_hints(AoEConfig)
    assert typing.get_args(hints["norm"]) == ("l2", "l1", "linf")
    assert typing.get_args(hints["cache_mode"]) == ("send", "recompute")
    with pytest.raises(ValueError, match=r"unknown AoE norm 'l3'; choose one of \('l2', 'l1', 'linf'\)"):
        AoEConfig(norm="l3")
    with pytest.raises(ValueError, match="positive integer"):
        AoEConfig(d_low=0)
    with pytest.raises(TypeError, match="num_experts"):  # a shared setting is not AoE's own
        AoEConfig(num_experts=8)


def test_the_one_step_refuses_unknown_and_invalid():
    tc = make_transformer_config(num_experts=4, top_k=2, ep=1)
    with pytest.raises(ValueError, match=r"unknown shared AoE layer settings \['dlow'\]"):
        AoELayerConfig.from_megatron(tc, AoEConfig(d_low=4), dlow=4)
    with pytest.raises(ValueError, match="AoE's own go in the AoEConfig"):
        AoELayerConfig.from_megatron(tc, AoEConfig(d_low=4), norm="l1")
    with pytest.raises(ValueError, match="must be smaller than d_model"):
        AoELayerConfig.from_megatron(tc, AoEConfig(d_low=tc.hidden_size))


def test_overrides_are_validated():
    cfg = AoELayerConfig(**BASE)
    assert replace(cfg, norm="linf").norm == "linf"
    with pytest.raises(ValueError):
        replace(cfg, top_k=100)


def test_named_presets_are_variants_of_two_bases(tmp_path):
    from aoe_megatron.models.params import count_parameters

    for size in ("732m", "4b"):
        for arch in ("aoe", "moe"):
            named = load_preset(f"{arch}_{size}")
            assert named == load_preset(size, arch=arch)
    assert count_parameters(load_preset("moe_4b")).total == pytest.approx(4e9, rel=0.01)
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: tiny\nmodle: {}\n")
    with pytest.raises(ValueError, match="unknown preset sections"):
        load_preset(str(bad))
    loop = tmp_path / "loop.yaml"
    loop.write_text(f"base: {loop}\n")
    with pytest.raises(ValueError, match="inherits from itself"):
        load_preset(str(loop))
    child = tmp_path / "child.yaml"
    child.write_text("base: tiny\nmodel:\n  aoe: {d_low: 8}\n")
    cfg = load_preset(str(child))
    assert cfg.aoe.d_low == 8 and cfg.aoe.d_wide == "auto" and cfg.hidden_size == 64


def test_presets_load_and_validate():
    for name in ("tiny", "732m", "4b"):
        for arch in ("aoe", "moe"):
            assert load_preset(name, arch=arch).arch == arch
    with pytest.raises(ValueError, match="no preset"):
        load_preset("13b")
    with pytest.raises(ValueError, match="unknown model settings"):
        ModelConfig.from_dict({"num_layer": 2})
    with pytest.raises(ValueError, match="must be smaller than d_model"):
        load_preset("tiny", aoe={"d_low": 64})
