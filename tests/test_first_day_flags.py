"""A Megatron-LM user's first day, the flags (issue #36, item 1): Megatron-LM's model-shape flags
as spellings of --set, --tensorboard-dir, aoe-preprocess --tokenizer-type, --version on every
command, and a sentence for an unknown flag instead of the usage's fifty flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aoe_megatron.train import flags
from tests.helpers import each_console_script

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--mock-data", "--train-iters", "2"]


def _model(argv):
    from aoe_megatron.train.run import parse_run

    return parse_run([*TINY, *argv]).model


@pytest.mark.legs
def test_megatron_lm_model_flags_set_the_presets_model_keys():
    """Every alias is --set of its key: same model, and each key as given."""
    from aoe_megatron.train.model_flags import MODEL_FLAGS

    aoe = {"--num-layers": "3", "--hidden-size": "96", "--ffn-hidden-size": "192",
           "--moe-ffn-hidden-size": "192", "--num-attention-heads": "6", "--seq-length": "32",
           "--vocab-size": "1000", "--num-experts": "6", "--moe-router-topk": "3",
           "--moe-aux-loss-coeff": "0.02", "--moe-token-dispatcher-type": "allgather",
           "--moe-router-bias-update-rate": "0.002", "--moe-router-enable-expert-bias": None,
           "--untie-embeddings-and-output-weights": None}
    moe = {"--moe-router-score-function": "sigmoid", "--moe-router-enable-expert-bias": None}
    assert set(aoe) | set(moe) == set(MODEL_FLAGS), "a model flag without a test"
    argv = [x for flag, value in aoe.items() for x in (flag, value) if x is not None]
    model = _model(argv)
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (3, 96, 192)
    assert (model.num_attention_heads, model.seq_length, model.vocab_size) == (6, 32, 1000)
    assert (model.num_experts, model.top_k, model.alpha_aux) == (6, 3, 0.02)
    assert (model.dispatcher, model.bias_update_rate) == ("allgather", 0.002)
    assert model.expert_bias is True and model.tie_embeddings is False
    by_set = [x for flag, value in aoe.items() if flag != "--moe-ffn-hidden-size"
              for x in ("--set", f"{MODEL_FLAGS[flag].key}={MODEL_FLAGS[flag].switch or value}")]
    assert _model(by_set) == model
    stock = _model(["--arch", "moe", "--moe-router-score-function", "sigmoid",
                    "--moe-router-enable-expert-bias"])
    assert stock.router.score_function == "sigmoid" and stock.expert_bias is True
    with pytest.raises(ValueError, match="model num_layers must be a positive integer, got 'x'"):
        _model(["--num-layers", "x"])  # checked by the model's schema, as --set's values are


@pytest.mark.legs
def test_an_alias_and_set_of_the_same_key_are_refused():
    with pytest.raises(ValueError, match=r"--num-layers 4 and --set num_layers=\.\.\. both set the "
                                         r"model's num_layers: give one of them"):
        _model(["--num-layers", "4", "--set", "num_layers=8"])
    with pytest.raises(ValueError, match=r"--moe-router-score-function sigmoid and --set "
                                         r"router.score_function=\.\.\. both set"):
        _model(["--arch", "moe", "--set", "router.score_function=softmax",
                "--moe-router-score-function", "sigmoid"])
    with pytest.raises(ValueError, match="--ffn-hidden-size 192 and --moe-ffn-hidden-size 256 "
                                         "both set the model's ffn_hidden_size, differently"):
        _model(["--ffn-hidden-size", "192", "--moe-ffn-hidden-size", "256"])
    # the same width twice (Megatron-LM's MoE scripts give both) and other keys with --set: fine
    model = _model(["--ffn-hidden-size", "192", "--moe-ffn-hidden-size", "192",
                    "--set", "aoe.d_low=8"])
    assert model.ffn_hidden_size == 192 and model.aoe.d_low == 8


@pytest.mark.legs
@pytest.mark.parametrize("argv,says", [
    (["--lr-decay-iters", "100"], "--lr-decay-iters is a Megatron-LM flag aoe-train does not "
                                  "support: the cosine decay runs to the end of the run"),
    (["--max-position-embeddings", "4096"], "RoPE has no position table"),
    (["--hidden_size", "64"], "--hidden_size: did you mean --hidden-size?"),
    (["--d_low", "8"], "--d_low: did you mean --set aoe.d_low=VALUE"),
    (["--aoe.selection=top_p"], "did you mean --set aoe.selection=VALUE"),
    (["--warmup_steps", "3"], "--warmup_steps: did you mean --lr-warmup-iters (the preset's "
                              "train key lr_warmup_iters, formerly warmup_steps)?"),
    (["--lr_warmup_iters", "3"], "--lr_warmup_iters: did you mean --lr-warmup-iters (the "
                                 "preset's train key lr_warmup_iters)?"),
    (["--save-intervall", "3"], "--save-intervall: did you mean --save-interval?"),
])
def test_an_unknown_flag_gets_a_sentence_not_the_usage(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        flags.parser().parse_args(["--preset", "tiny", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {' '.join(argv)}" in err and says in err, err
    assert "usage:" not in err and "--set KEY=VALUE" in err, err


def test_tensorboard_dir_takes_the_event_files_out_of_the_run_directory(tmp_path):
    from aoe_megatron.train.metrics import Reporter

    cfg = flags.parse_train_args([*TINY, "--tensorboard-dir", str(tmp_path / "tb")])
    assert cfg.tensorboard_dir == str(tmp_path / "tb")
    assert flags.parse_train_args(TINY).tensorboard_dir is None  # default: the run directory
    for run_dir, tb in [(tmp_path / "run", tmp_path / "tb"), (tmp_path / "plain", None)]:
        run_dir.mkdir()
        reporter = Reporter(run_dir, total_steps=1, tokens_per_step=8, enabled=True,
                            tensorboard_dir=tb)
        reporter.step(1, loss=1.0, lr=1e-3, grad_norm=None, stats={}, aux_loss=None,
                      console=False)
        reporter.close()
        events = sorted(p.parent for p in tmp_path.rglob("events.out.tfevents.*"))
        assert (tb or run_dir) in events
        assert (run_dir / "metrics.jsonl").is_file()  # the run's own records stay in it
    assert sorted(p.parent.name for p in tmp_path.rglob("events.out.tfevents.*")) == ["plain", "tb"]


def test_the_flags_table_has_the_model_flags_and_tensorboard_dir():
    from aoe_megatron.train.model_flags import MODEL_FLAGS

    table = (ROOT / "docs" / "flags.md").read_text()
    for spelling, m in MODEL_FLAGS.items():
        assert f"| `{spelling}` | model | `{spelling}` | `model.{m.key}" in table, spelling
    assert "| `--tensorboard-dir` | logging | `--tensorboard-dir` | `tensorboard_dir` |" in table


@pytest.fixture
def jsonl(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("one doc", "another doc")))
    return src


def _preprocess(jsonl, name, *extra):
    from aoe_megatron.cli.preprocess import main

    prefix = jsonl.parent / name
    assert main(["--input", str(jsonl), "--output-prefix", str(prefix), "--workers", "0",
                 "--append-eod", *extra]) == 0
    return json.loads(Path(f"{prefix}_text_document.manifest.json").read_text())


@pytest.mark.legs
def test_preprocess_takes_megatron_lms_sentencepiece_tokenizer_types(jsonl, capsys):
    from aoe_megatron.cli.preprocess import main

    plain = _preprocess(jsonl, "plain")
    gpt = _preprocess(jsonl, "gpt", "--tokenizer-type", "GPTSentencePieceTokenizer")
    llama = _preprocess(jsonl, "llama", "--tokenizer-type", "Llama2Tokenizer")
    assert gpt["policy"] == plain["policy"] == {"prepend_bos": False, "append_eod": True}
    assert llama["policy"] == {"prepend_bos": True, "append_eod": True}  # as Megatron-LM's
    assert gpt["tokens"] == plain["tokens"] and llama["tokens"] == plain["tokens"] + 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--input", str(jsonl), "--output-prefix", str(jsonl.parent / "hf"),
              "--tokenizer-type", "HuggingFaceTokenizer"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert ("--tokenizer-type HuggingFaceTokenizer is not supported: aoe-preprocess tokenizes "
            "with a sentencepiece model (--tokenizer-model); the types it takes are "
            "GPTSentencePieceTokenizer, SentencePieceTokenizer, Llama2Tokenizer") in err, err
    assert not list(jsonl.parent.glob("hf*"))


@pytest.mark.legs
def test_every_command_has_version_from_metadata_without_torch():
    """--version on every console script: ours, megatron-core's and torch's versions, read from
    the package metadata (torch is not imported to print it)."""
    from importlib.metadata import version

    results = each_console_script("--version", root=ROOT)
    import aoe_megatron

    expected = (f"{aoe_megatron.__version__} (megatron-core {version('megatron-core')}, torch "
                f"{version('torch')}, Python ")
    for name, (code, text, torch_loaded) in results.items():
        assert code in (0, None) and text.startswith(f"{name} {expected}"), (name, code, text)
        assert not torch_loaded, f"{name} --version imported torch"
