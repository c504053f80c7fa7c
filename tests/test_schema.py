"""One schema (issue #21): a preset's ``aoe:`` section is AoEConfig (AoE's own settings; the
layer's AoELayerConfig adds the shared ones), its ``router:`` section is RouterConfig's base, every preset loads, and the renamed ``weight_mode``
(now ``selection``) still loads wherever it was stored: preset YAML, recorded model configs,
exported Hugging Face config.json files and study specs, whose runs keep their fingerprints."""

from __future__ import annotations

import json
import warnings
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import pytest
import yaml

from aoe_megatron.models.gpt import PRESET_DIR, ModelConfig, RouterSettings, load_preset
from aoe_megatron.moe.config import MEGATRON_FIELD_MAP, AoEConfig, AoELayerConfig

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(PRESET_DIR.rglob("*.yaml"))


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def test_the_aoe_section_is_aoe_config_and_the_layer_adds_the_shared_fields():
    assert ModelConfig.__dataclass_fields__["aoe"].default_factory is AoEConfig
    own = {f.name: f for f in fields(AoEConfig)}
    layer = {f.name: f for f in fields(AoELayerConfig)}
    assert issubclass(AoELayerConfig, AoEConfig)
    assert set(layer) - set(own) == set(MEGATRON_FIELD_MAP) | {"expert_bias", "bias_update_rate"}
    for name, f in own.items():  # inherited: one declaration, the same type and default
        assert (f.type, _default(f)) == (layer[name].type, _default(layer[name])), name
    # and back: a default preset section fills a layer config to its own defaults
    shared = dict(num_experts=8, top_k=2, d_model=768, d_ffn=3072)
    assert AoELayerConfig(**shared, **asdict(AoEConfig())) == AoELayerConfig(**shared)
    assert AoELayerConfig(**shared).settings == AoEConfig()


def test_router_config_is_router_settings_plus_the_shared_fields():
    from aoe_megatron.models.moe_router import RouterConfig

    base = {f.name: f for f in fields(RouterSettings)}
    full = {f.name: f for f in fields(RouterConfig)}
    assert issubclass(RouterConfig, RouterSettings)
    assert set(full) - set(base) == {"num_experts", "top_k", "d_model", "vocab_size", "alpha_aux"}
    assert all(_default(full[n]) == _default(f) for n, f in base.items())


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(PRESET_DIR)))
def test_every_preset_file_loads_without_old_keys(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = load_preset(str(path))
    assert cfg.arch in ("aoe", "moe")
    if cfg.arch == "aoe":
        assert cfg.aoe_config().selection == cfg.aoe.selection


def test_one_way_from_a_model_config_to_aoe_config():
    """build_gpt_model's path (from the TransformerConfig it builds with) gives what the preset's
    ``aoe_config`` gives."""
    from aoe_megatron.models.gpt import transformer_config

    for name in ("tiny", "ablations/topp_aoe", "4b"):
        cfg = load_preset(name)
        tc = transformer_config(cfg, expert_parallel_size=2)
        assert cfg.aoe_config(tc=tc) == cfg.aoe_config(2), name


# ----------------------------------------------------------------------------- the old key


def _one_deprecation(record) -> str:
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)
                and "weight_mode" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    return messages[0]


def test_old_key_in_preset_yaml_and_overrides(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("base: tiny\nmodel:\n  aoe: {weight_mode: softmax_topk}\n")
    with pytest.warns(DeprecationWarning) as record:
        cfg = load_preset(str(old))
    assert "weight_mode is deprecated: use selection" in _one_deprecation(record) and cfg.aoe.selection == "softmax_topk"
    child = tmp_path / "child.yaml"  # a new key over a base with the old one: the child's wins
    child.write_text(f"base: {old}\nmodel:\n  aoe: {{selection: top_p, selection_options: {{p: 0.5}}}}\n")
    with pytest.warns(DeprecationWarning):
        assert load_preset(str(child)).aoe.selection == "top_p"
    moe = tmp_path / "moe.yaml"
    moe.write_text("base: tiny\nmodel:\n  arch: moe\n"
                   "  router: {weight_mode: top_p, selection_options: {p: 0.5}}\n")
    with pytest.warns(DeprecationWarning):
        assert load_preset(str(moe)).router.selection == "top_p"
    with pytest.warns(DeprecationWarning) as record:  # --set aoe.weight_mode=random
        assert load_preset("tiny", aoe={"weight_mode": "random"}).aoe.selection == "random"
    _one_deprecation(record)
    both = tmp_path / "both.yaml"
    both.write_text("base: tiny\nmodel:\n  aoe: {weight_mode: random, selection: random}\n")
    with pytest.raises(ValueError, match="both 'weight_mode' and 'selection'"):
        load_preset(str(both))


def test_old_key_in_a_recorded_model_config():
    """A checkpoint's state.json and a run's config.json hold ``asdict(ModelConfig)``."""
    raw = asdict(load_preset("tiny"))
    raw["aoe"]["weight_mode"] = raw["aoe"].pop("selection")
    with pytest.warns(DeprecationWarning) as record:
        assert ModelConfig.from_dict(raw) == load_preset("tiny")
    _one_deprecation(record)
    raw["aoe"]["selection"] = "topk_softmax"
    with pytest.raises(ValueError, match="both"):
        ModelConfig.from_dict(raw)


def test_old_key_in_an_exported_hugging_face_config(tmp_path):
    pytest.importorskip("transformers")
    from aoe_megatron.hf.configuration_aoe import AoEHFConfig as HFAoEConfig
    from aoe_megatron.hf.from_hf import hf_model_config as _hf_model_config

    new = HFAoEConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, num_experts=4,
                      d_low=16, d_wide=160, selection="softmax_topk")
    new.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["selection"] == "softmax_topk" and "weight_mode" not in raw
    raw["weight_mode"] = raw.pop("selection")  # as exported before the rename
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.warns(DeprecationWarning) as record:
        old = HFAoEConfig.from_pretrained(tmp_path)
    _one_deprecation(record)
    assert old.selection == "softmax_topk" and not hasattr(old, "weight_mode")
    with pytest.warns(DeprecationWarning):  # import_from_hf's reading of a bare config.json
        cfg = _hf_model_config(raw)
    assert cfg.aoe.selection == "softmax_topk"
    with pytest.raises(ValueError, match="both 'weight_mode' and 'selection'"):
        HFAoEConfig(weight_mode="topk_softmax", selection="topk_softmax")


def test_old_key_in_a_study_spec_keeps_the_fingerprints():
    from aoe_megatron.study.spec import SpecError, study_from_dict

    raw = yaml.safe_load((ROOT / "run/studies/default.yaml").read_text())
    new = study_from_dict(raw)
    raw["arms"][2]["model"]["aoe"] = {"weight_mode": raw["arms"][2]["model"]["aoe"].pop("selection")}
    with pytest.warns(DeprecationWarning) as record:
        old = study_from_dict(raw)
    _one_deprecation(record)
    assert old.arm("random").model.aoe.selection == "random"
    assert old.arm("random").preset == new.arm("random").preset  # normalised to the new key
    for arm in new.arms:
        assert old.arm(arm.name).fingerprint(1, new.data) == arm.fingerprint(1, new.data)
    raw["arms"][2]["model"]["aoe"]["selection"] = "random"
    with pytest.raises(SpecError, match="both"):
        study_from_dict(raw)


def test_old_train_keys_in_a_study_spec_keep_the_fingerprints():
    from aoe_megatron.study.spec import SpecError, study_from_dict

    raw = yaml.safe_load((ROOT / "run/studies/default.yaml").read_text())
    new = study_from_dict(raw)
    raw["train"]["train_steps"] = raw["train"].pop("train_iters")
    raw["train"]["warmup_steps"] = raw["train"].pop("lr_warmup_iters")
    with pytest.warns(DeprecationWarning, match="train_steps is deprecated: use train_iters"):
        old = study_from_dict(raw)
    for arm in new.arms:
        assert old.arm(arm.name).preset == arm.preset  # normalised to the new keys
        assert old.arm(arm.name).fingerprint(1, new.data) == arm.fingerprint(1, new.data)
    raw["train"]["train_iters"] = 5
    with pytest.raises(SpecError, match="both 'train_steps' and 'train_iters'"):
        study_from_dict(raw)


def test_committed_study_runs_keep_their_fingerprints():
    """The runs under studies/default were recorded while the key was ``weight_mode``, before
    revision 2 of the training math: the AoE arms' runs still match; the MoE arm's (its math
    changed) no longer do, and say why."""
    from aoe_megatron.study.spec import load_study

    study = load_study("default")
    checked = 0
    for arm in study.arms:
        for seed in study.seeds:
            record = ROOT / "studies/default/runs" / arm.name / f"seed{seed}" / "study-run.json"
            if record.is_file():
                recorded = json.loads(record.read_text())["fingerprint"]
                if arm.revision == 1:
                    assert recorded == arm.fingerprint(seed, study.data), arm.name
                else:
                    assert recorded == arm.fingerprint(seed, study.data, revision=1), arm.name
                    assert recorded != arm.fingerprint(seed, study.data)
                    assert "trained under revision 1 of the training math, now 2" in \
                        arm.mismatch(recorded, seed, study.data)
                checked += 1
    if not checked:
        pytest.skip("no recorded runs under studies/default")


def test_the_staged_studys_finished_runs_keep_their_fingerprints():
    """studies/v2's runs finished before the train keys were renamed (train_steps, warmup_steps)
    and after: the plan, built from today's spec (train_iters, lr_warmup_iters), still finds each
    of them done, not to be trained again."""
    from aoe_megatron.study.plan import make_plan
    from aoe_megatron.study.runner import run_paths
    from aoe_megatron.study.spec import load_study

    study, out = load_study("v2"), ROOT / "studies" / "v2"
    checked = 0
    for run in make_plan(study, out).runs:
        paths = run_paths(out, run.arm, run.seed)
        record = json.loads(paths.record.read_text()) if paths.record.is_file() else {}
        if record.get("finished"):
            assert record["fingerprint"] == run.arm.fingerprint(run.seed, study.data), run.key
            checked += 1
    if not checked:
        pytest.skip("no finished runs under studies/v2")
