"""The train command's flags (issue #23): Megatron-LM's names from one schema, help on every
flag, no abbreviations, old spellings until the release runtime/deprecations.py names, --save/--load as in Megatron-LM."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aoe_megatron.runtime.deprecations import renamed
from aoe_megatron.train import flags
from aoe_megatron.train.loop import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "flags.md"

#: The train command's flags, frozen: a flag added, renamed or removed must change this list, the
#: docs table (python -m aoe_megatron.train.flags) and, for a rename, keep the old spelling.
FLAGS = [
    "--preset", "--arch", "--set",
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--moe-ffn-hidden-size",
    "--num-attention-heads", "--seq-length", "--vocab-size", "--num-experts", "--moe-router-topk",
    "--moe-aux-loss-coeff", "--moe-token-dispatcher-type", "--moe-router-score-function",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    "--untie-embeddings-and-output-weights",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--expert-model-parallel-size", "--zero-stage", "--distributed-timeout-minutes",
    "--micro-batch-size", "--global-batch-size", "--train-iters", "--train-tokens",
    "--weight-decay", "--adam-beta1", "--adam-beta2", "--clip-grad", "--seed", "--precision",
    "--bf16", "--grad-accum-dtype", "--moe-layer-recompute",
    "--lr", "--min-lr", "--lr-warmup-iters", "--override-opt_param-scheduler",
    "--use-checkpoint-opt_param-scheduler",
    "--save", "--load", "--ckpt-dir", "--save-interval", "--keep-last", "--load-weights",
    "--no-verify",
    "--data-path", "--split", "--train-data-path", "--valid-data-path", "--test-data-path",
    "--no-manifest", "--mock-data", "--tokenizer-model", "--data-cache-path",
    "--build-data-index-only", "--world-size", "--allow-data-change",
    "--log-interval", "--eval-interval", "--eval-iters", "--run-dir", "--tensorboard-dir",
    "--wandb-project", "--wandb-exp-name",
    "--skip-nonfinite", "--inject-nonfinite",
]
DEPRECATED = {"--expert-parallel-size": "--expert-model-parallel-size",
              "--train-steps": "--train-iters", "--warmup-steps": "--lr-warmup-iters",
              "--data": "--data-path", "--recompute": "--moe-layer-recompute"}
GROUPS = ["model", "parallelism", "training", "learning rate", "checkpointing", "data", "logging",
          "faults"]


def _visible(parser):
    return [a for a in parser._actions if a.help != "==SUPPRESS==" and a.option_strings
            not in (["-h", "--help"], ["--version"])]


def test_the_flag_list_is_frozen_and_every_flag_is_explained():
    parser = flags.parser()
    shown = [a.option_strings[0] for a in _visible(parser)]
    assert shown == FLAGS
    for action in _visible(parser):
        assert len(action.help) > 25, (action.option_strings, action.help)
    assert [g.title for g in parser._action_groups[2:]] == GROUPS
    text = parser.format_help()
    for spelling in FLAGS:
        assert spelling in text


def test_the_docs_table_is_the_parsers():
    text = DOCS.read_text()
    table = text.split("tests/test_flags.py checks it -->\n", 1)[1].split("<!-- end", 1)[0]
    assert table == flags.markdown_table(), "regenerate: python -m aoe_megatron.train.flags"
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[a-z0-9_-]+)` \| [^|]+ \| ([^|]+) \|",
                                                         table, re.M)}
    assert sorted(rows) == sorted(FLAGS)
    for spelling, megatron in rows.items():  # our spelling is Megatron-LM's where it has one
        assert megatron.strip() in ("none", f"`{spelling}`"), (spelling, megatron)
    for old, new in DEPRECATED.items():
        assert re.search(rf"^\| `{new}` .*`{old}` \|$", table, re.M), old


@pytest.mark.parametrize("argv", [
    ["--save-int", "3"],     # a prefix of --save-interval
    ["--load-w", "ck"],      # a prefix of --load-weights
    ["--expert-model", "2"],  # a prefix of --expert-model-parallel-size
])
def test_a_prefix_of_a_flag_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        flags.parser().parse_args(["--preset", "tiny", *argv])
    assert exit_.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_save_and_load_are_not_read_as_longer_flags():
    cfg = flags.parse_train_args(["--preset", "tiny", "--mock-data", "--train-iters", "1",
                                  "--save", "a", "--load", "b"])
    assert (cfg.save, cfg.load, cfg.save_dir(), cfg.load_dir()) == ("a", "b", "a", "b")
    assert cfg.load_weights is None and cfg.save_interval == 0


def test_the_old_spellings_are_the_registered_ones():
    assert DEPRECATED == renamed("flag")  # runtime/deprecations.py: each names its release


@pytest.mark.parametrize("old,new", sorted(DEPRECATED.items()))
def test_an_old_spelling_still_works_and_says_the_new_one(old, new, capsys):
    value = {"--recompute": [], "--data": ["run/data-shakespeare.yaml"]}.get(old, ["3"])
    was = flags.parse_train_args(["--preset", "tiny", "--train-iters", "2", old, *value])
    now = flags.parse_train_args(["--preset", "tiny", "--train-iters", "2", new, *value])
    assert was == now
    assert f"note: {old} is deprecated: use {new}" in capsys.readouterr().err


def test_bf16_is_short_for_precision_bf16():
    assert flags.parse_train_args(["--preset", "tiny", "--train-iters", "1", "--bf16"]).precision == "bf16"


def test_save_alone_into_a_folder_of_checkpoints_is_refused(tmp_path, capsys):
    """Only --save: a fresh run, so a folder that holds a checkpoint is refused (nothing written),
    saying how to resume; --ckpt-dir with --save/--load is ambiguous. (A launch spelled only with
    Megatron-LM's names that resumes with --load: tests/test_packaging.py, through the wheel.)"""
    common = ["--preset", "tiny", "--mock-data", "--train-iters", "3"]
    (tmp_path / "a" / "step_00000002").mkdir(parents=True)
    assert main([*common, "--save", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"--save {tmp_path / 'a'} already holds checkpoints (newest step_00000002)" in err
    assert f"add --load {tmp_path / 'a'} to resume from it, or choose an empty folder" in err
    assert main([*common, "--ckpt-dir", str(tmp_path / "a"), "--save", str(tmp_path / "b")]) == 2
    assert "give either --ckpt-dir or --save/--load" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    cfg = flags.parse_train_args([*common, "--ckpt-dir", "c"])
    assert (cfg.save_dir(), cfg.load_dir()) == ("c", "c")


def test_train_settings_are_validated_where_they_are_declared():
    """TrainConfig checks its values in __post_init__ (whoever builds it: the flags, a test, a
    study); a setting with fixed values is a Literal, and the help's metavar and the check read
    the same values."""
    from dataclasses import replace

    from aoe_megatron.train.config import CHOICES, TrainConfig

    ok = TrainConfig(preset="tiny", train_iters=2, mock_data=True, inject_nonfinite="5,3")
    assert ok.nonfinite_steps == (3, 5)
    assert CHOICES == {"arch": ("aoe", "moe"), "zero_stage": (1, 2, 3),
                       "precision": ("auto", "bf16", "fp32"), "grad_accum_dtype": ("fp32", "bf16")}
    for changes, phrase in [({"zero_stage": 4}, "--zero-stage must be one of 1, 2, 3, got 4"),
                            ({"precision": "fp16"}, "--precision must be one of auto, bf16, fp32"),
                            ({"arch": "dense"}, "--arch must be one of aoe, moe"),
                            ({"micro_batch_size": 0}, "--micro-batch-size must be positive"),
                            ({"train_tokens": 10}, "exactly one of --train-iters and --train-tokens"),
                            ({"save_interval": -1}, "--save-interval must be >= 0"),
                            ({"inject_nonfinite": "3,x"}, "expected step numbers from 1"),
                            ({"ckpt_dir": "c", "save": "s"}, "means both --save and --load"),
                            ({"data_path": ("d",)}, "--data-path and --mock-data exclude each other")]:
        with pytest.raises(ValueError, match=re.escape(phrase)):
            replace(ok, **changes)
    text = flags.parser().format_help()
    assert "--zero-stage {1,2,3}" in text and "--precision {auto,bf16,fp32}" in text


def test_a_presets_old_train_keys_load_with_a_warning(tmp_path):
    import yaml

    from aoe_megatron.models.gpt import preset_dict

    preset = preset_dict("tiny")
    preset["train"] = {"train_steps": 7, "warmup_steps": 2, "recompute": True,
                       "expert_parallel_size": 1, "data": "run/data-shakespeare.yaml"}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(preset))
    with pytest.warns(DeprecationWarning) as caught:
        cfg = flags.parse_train_args(["--preset", str(path)])
    assert (cfg.train_iters, cfg.lr_warmup_iters, cfg.moe_layer_recompute) == (7, 2, True)
    assert cfg.expert_model_parallel_size == 1 and cfg.data_path == ("run/data-shakespeare.yaml",)
    notices = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("train_steps is deprecated: use train_iters (it still loads)" in n for n in notices)
    assert len([n for n in notices if "is deprecated" in n]) == 5
    preset["train"]["train_iters"] = 7
    path.write_text(yaml.safe_dump(preset))
    with pytest.raises(ValueError, match="sets both 'train_steps' and 'train_iters'"):
        flags.parse_train_args(["--preset", str(path)])
    # a variant with the old key over a base that has the new one (tiny: lr_warmup_iters)
    path.write_text(yaml.safe_dump({"base": "tiny", "train": {"warmup_steps": 9, "train_steps": 3}}))
    with pytest.warns(DeprecationWarning):
        assert flags.parse_train_args(["--preset", str(path)]).lr_warmup_iters == 9
