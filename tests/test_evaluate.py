"""aoe-evaluate (the paper's lm-eval protocol, offline) and aoe-mcnemar.

The evaluation runs end to end on made-up examples in each task's real dataset schema, with a tiny
random Hugging Face causal LM (fixture ``hf_eval_model``), on CPU and without network access.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aoe_megatron.evaluation.mcnemar import (
    PairingError,
    chi2_p,
    compare,
    compare_runs,
    exact_p,
    load_outcomes,
    mcnemar,
)
from aoe_megatron.evaluation.protocol import PAPER_TASKS, ProtocolError, resolve_tasks
from tests.helpers import eval_rows

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- McNemar


def test_mcnemar_textbook_values():
    # Agresti, Categorical Data Analysis: presidential approval, 1600 people surveyed twice;
    # b = 150, c = 86: X2 = 64^2 / 236 = 17.36 (z = 4.17), p < 0.001.
    r = mcnemar(150, 86, both_correct=794, both_wrong=570)
    assert r.n == 1600 and r.test == "exact"
    assert r.chi2 == pytest.approx(64**2 / 236) and math.sqrt(r.chi2) == pytest.approx(4.17, abs=5e-3)
    assert r.p_chi2 == pytest.approx(3.0993e-5, rel=1e-4)  # scipy.stats.chi2.sf(17.356, 1)
    assert r.chi2_cc == pytest.approx(63**2 / 236)
    assert r.acc_a == pytest.approx(944 / 1600) and r.acc_b == pytest.approx(880 / 1600)
    # b = 6, c = 16: exact p = 2 * sum_{i<=6} C(22, i) / 2^22 = 2 * 110056 / 4194304.
    r = mcnemar(6, 16)
    assert r.p_exact == pytest.approx(2 * 110056 / 2**22, rel=1e-12)
    assert r.p_value == r.p_exact
    assert r.chi2 == pytest.approx(100 / 22) and r.chi2_cc == pytest.approx(81 / 22)
    assert mcnemar(6, 16, test="auto").test == "exact"
    assert mcnemar(150, 86, test="auto").test == "chi2-cc"
    # Degenerate tables.
    assert exact_p(0, 0) == 1.0 and chi2_p(0, 0) == (0.0, 1.0)
    assert exact_p(7, 7) == 1.0 and chi2_p(7, 7, continuity=True) == (0.0, 1.0)
    assert exact_p(0, 5000) == 0.0  # underflows cleanly
    with pytest.raises(ValueError):
        mcnemar(1, 2, test="fisher")


def test_mcnemar_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(0, 1), (1, 0), (3, 9), (12, 12), (24, 40), (150, 86), (1000, 1100), (4000, 4200)]:
        n, k = b + c, min(b, c)
        assert exact_p(b, c) == pytest.approx(min(1.0, 2 * stats.binom.cdf(k, n, 0.5)), rel=1e-9, abs=1e-300)
        assert exact_p(b, c) == pytest.approx(stats.binomtest(b, n, 0.5).pvalue, rel=1e-9)
        for continuity in (False, True):
            stat, p = chi2_p(b, c, continuity)
            expected = max(abs(b - c) - continuity, 0) ** 2 / n
            assert stat == pytest.approx(expected)
            assert p == pytest.approx(stats.chi2.sf(expected, 1), rel=1e-9)


def _write_samples(folder: Path, outcomes: dict[str, list[int]]) -> Path:
    (folder / "samples").mkdir(parents=True)
    for task, correct in outcomes.items():
        with open(folder / "samples" / f"{task}.jsonl", "w") as f:
            for i, x in enumerate(correct):
                f.write(json.dumps({"task": task, "doc_id": i, "correct": x, "pred": 0, "target": 0}) + "\n")
    return folder


def test_mcnemar_pools_tasks_and_refuses_mismatched_examples(tmp_path):
    a = _write_samples(tmp_path / "a", {"piqa": [1, 1, 0, 0, 1], "sst2": [1, 0, 1], "qqp": [1]})
    b = _write_samples(tmp_path / "b", {"piqa": [1, 0, 1, 0, 0], "sst2": [0, 0, 1]})
    report = compare_runs(a, b)
    assert report["tasks"] == ["piqa", "sst2"] and report["skipped"]["only_a"] == ["qqp"]
    p = report["pooled"]
    # piqa: (1,1) (1,0) (0,1) (0,0) (1,0); sst2: (1,0) (0,0) (1,1)
    assert (p["both_correct"], p["b"], p["c"], p["both_wrong"], p["n"]) == (2, 3, 1, 2, 8)
    assert p["p_value"] == exact_p(3, 1) == pytest.approx(0.625)
    assert report["per_task"]["piqa"]["b"] == 2 and report["per_task"]["sst2"]["b"] == 1
    assert compare_runs(a / "samples", b / "samples/piqa.jsonl")["tasks"] == ["piqa"]

    c = _write_samples(tmp_path / "c", {"piqa": [1, 0, 1, 0], "sst2": [0, 0, 1]})  # one piqa fewer
    with pytest.raises(PairingError, match="piqa: the runs scored different examples"):
        compare_runs(a, c)
    with pytest.raises(PairingError, match="no task in common"):
        compare({"piqa": {0: 1}}, {"sst2": {0: 1}})
    with pytest.raises(PairingError, match="not in both runs"):
        compare_runs(a, b, tasks=["qqp"])
    with open(tmp_path / "a" / "samples" / "sst2.jsonl", "a") as f:
        f.write(json.dumps({"task": "sst2", "doc_id": 0, "correct": 1}) + "\n")
    with pytest.raises(PairingError, match="duplicate example"):
        load_outcomes(a)


def test_mcnemar_cli(tmp_path, capsys):
    from aoe_megatron.cli import mcnemar as cli

    a = _write_samples(tmp_path / "a", {"sst2": [1] * 20 + [0] * 5})
    b = _write_samples(tmp_path / "b", {"sst2": [0] * 12 + [1] * 13})
    assert cli.main([str(a), str(b), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["pooled"]["b"], report["pooled"]["c"]) == (12, 5)
    assert report["pooled"]["p_value"] == pytest.approx(exact_p(12, 5))
    assert cli.main([str(a), str(b)]) == 0
    assert "McNemar p-value (exact)" in capsys.readouterr().out
    assert cli.main([str(a), str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- protocol


def test_protocol_tasks():
    assert [(t.name, t.num_fewshot) for t in PAPER_TASKS] == [
        ("arc_easy", 0), ("piqa", 0), ("social_iqa", 0), ("winogrande", 0), ("hellaswag", 0),
        ("mnli", 3), ("qnli", 3), ("sst2", 3), ("mrpc", 3), ("qqp", 3)]
    assert [t.name for t in resolve_tasks(["sst2", "siqa", "arc_easy", "sst2"])] == [
        "arc_easy", "social_iqa", "sst2"]
    with pytest.raises(ProtocolError, match="unknown task 'boolq'"):
        resolve_tasks(["boolq"])


# ----------------------------------------------------------------------------- evaluation

EVAL_SPLITS = {"arc_easy": "test", "mnli": "validation_matched"}  # others: validation
N_EVAL, N_TRAIN = 5, 6


@pytest.fixture(scope="session")
def eval_data(tmp_path_factory) -> Path:
    """DIR/<task>/<split>.jsonl for the ten tasks: the scored split, plus train for 3-shot tasks."""
    root = tmp_path_factory.mktemp("eval_data")
    for t in PAPER_TASKS:
        splits = {EVAL_SPLITS.get(t.name, "validation"): N_EVAL}
        if t.num_fewshot:
            splits["train"] = N_TRAIN
        for split, n in splits.items():
            (root / t.name).mkdir(exist_ok=True)
            with open(root / t.name / f"{split}.jsonl", "w") as f:
                for row in eval_rows(t.name, split, n):
                    f.write(json.dumps(row) + "\n")
    return root


@pytest.fixture(scope="session")
def hf_eval_model(tmp_path_factory) -> Path:
    """A Hugging Face model folder to evaluate: a tiny random Llama with a byte-level BPE tokenizer
    built here (no download)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("hf_eval_model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Question: Is this sentence positive or negative? Answer: positive",
                             "negative yes no True False Neither the a of sentence"] * 20, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf_tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=2048, bos_token_id=hf_tok.bos_token_id,
                      eos_token_id=hf_tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def eval_run(hf_eval_model, eval_data, tmp_path_factory):
    """All ten tasks through the Python API."""
    from aoe_megatron.evaluation.harness import EvalConfig, run_evaluation

    out = tmp_path_factory.mktemp("eval_out") / "run"
    cfg = EvalConfig(model=hf_eval_model, data_dir=eval_data, output=out, device="cpu",
                     bootstrap_iters=10, datasets_cache=tmp_path_factory.mktemp("ds_cache"))
    return out, run_evaluation(cfg)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_evaluation_outputs_are_consistent(eval_run):
    out, run = eval_run
    summary = json.loads((out / "results.json").read_text())
    assert summary == json.loads(json.dumps(run.summary))
    assert list(summary["tasks"]) == [t.name for t in PAPER_TASKS]
    assert summary["protocol"]["complete"] and summary["lm_eval_version"] == "0.4.13"
    for t in PAPER_TASKS:
        res = summary["tasks"][t.name]
        records = _jsonl(out / "samples" / f"{t.name}.jsonl")
        assert [r["doc_id"] for r in records] == list(range(N_EVAL)) == list(range(res["n"]))
        assert res["n_total"] == N_EVAL and res["num_fewshot"] == t.num_fewshot
        assert all(r["task"] == t.name and r["correct"] == int(r["pred"] == r["target"]) for r in records)
        assert sum(r["correct"] for r in records) / len(records) == pytest.approx(res["acc"])
        assert res["acc_stderr"] is not None and res["metric"] == "acc"
        assert set(res["data_files"]) == {res["eval_split"]} | ({"train"} if t.num_fewshot else set())
    # The targets follow each dataset's answer encoding.
    assert [r["target"] for r in _jsonl(out / "samples" / "arc_easy.jsonl")] == [0, 1, 2, 3, 0]
    assert [r["target"] for r in _jsonl(out / "samples" / "social_iqa.jsonl")] == [0, 1, 2, 0, 1]
    assert [r["target"] for r in _jsonl(out / "samples" / "winogrande.jsonl")] == [0, 1, 0, 1, 0]
    assert [r["target"] for r in _jsonl(out / "samples" / "hellaswag.jsonl")] == [0, 1, 2, 3, 0]
    assert summary["tasks"]["mrpc"]["metrics"]["f1"] is not None
    accs = [summary["tasks"][t.name]["acc"] for t in PAPER_TASKS]
    assert summary["average"]["acc"] == pytest.approx(sum(accs) / 10)


def test_few_shot_prompts(eval_run):
    out, run = eval_run
    # sst2 is 3-shot: three demonstrations from the train split, then the question.
    for s in run.raw["samples"]["sst2"]:
        context = s["arguments"][0][0]
        blocks = context.split("\n\n")
        assert len(blocks) == 4 and context.count("Is this sentence positive or negative?") == 4
        assert all(b.startswith("train sentence") and b.rsplit("Answer: ", 1)[1] in ("negative", "positive")
                   for b in blocks[:3])
        assert blocks[3].startswith(f"validation sentence {s['doc_id']} ") and blocks[3].endswith("Answer:")
    summary = json.loads((out / "results.json").read_text())
    assert summary["tasks"]["mnli"]["example_prompt"].count("\n\n") == 3
    # Zero-shot tasks have the question alone.
    assert summary["tasks"]["arc_easy"]["example_prompt"] == "Question: Which test 0 thing is hot?\nAnswer:"
    assert summary["tasks"]["hellaswag"]["example_prompt"] == "Cooking: A man validation 0 cracks an egg. He"


def test_markdown_table(eval_run):
    out, run = eval_run
    lines = (out / "results.md").read_text().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["Model", "ARC-E", "PIQA", "SIQA", "WINO", "HELLA", "MNLI", "QNLI", "SST2", "MRPC",
                      "QQP", "AVG"]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    values = [run.summary["tasks"][t.name]["acc"] for t in PAPER_TASKS]
    assert cells[1:] == [f"{100 * v:.2f}" for v in values] + [f"{100 * sum(values) / 10:.2f}"]


@pytest.mark.slow
def test_cli_subset_limit_and_determinism(eval_run, hf_eval_model, eval_data, tmp_path):
    """The CLI on two tasks, first 3 examples: same outcomes and prompts as the full API run."""
    _, run = eval_run
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "aoe_megatron.cli.evaluate", str(hf_eval_model), "--data-dir",
           str(eval_data), "--output", str(out), "--tasks", "sst2", "winogrande", "--device", "cpu",
           "--limit", "3", "--datasets-cache", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Running loglikelihood requests" in proc.stderr  # lm-eval's progress is shown
    summary = json.loads((out / "results.json").read_text())
    assert list(summary["tasks"]) == ["winogrande", "sst2"] and not summary["protocol"]["complete"]
    for task in ("winogrande", "sst2"):
        assert _jsonl(out / "samples" / f"{task}.jsonl") == run.samples[task][:3]
        assert summary["tasks"][task]["example_prompt"] == run.summary["tasks"][task]["example_prompt"]
    md = (out / "results.md").read_text()
    assert md.startswith("| Model | WINO | SST2 | AVG |") and "Smoke run: first 3 examples" in md
    # A second run refuses the non-empty output directory, unless --overwrite.
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1 and "use --overwrite" in proc.stderr and "Traceback" not in proc.stderr


def test_clean_errors(hf_eval_model, eval_data, tmp_path):
    from aoe_megatron.evaluation.data import MissingDataError
    from aoe_megatron.evaluation.harness import EvalConfig, EvaluationError, run_evaluation

    def cfg(**kw):
        base = dict(model=hf_eval_model, data_dir=eval_data, output=tmp_path / "o", device="cpu")
        return EvalConfig(**{**base, **kw})

    with pytest.raises(EvaluationError, match="model folder .*nope does not exist"):
        run_evaluation(cfg(model=tmp_path / "nope"))
    partial = tmp_path / "data"
    shutil.copytree(eval_data / "sst2", partial / "sst2")
    (partial / "sst2" / "train.jsonl").unlink()
    with pytest.raises(MissingDataError) as err:
        run_evaluation(cfg(data_dir=partial, tasks=("sst2", "piqa")))
    msg = str(err.value)
    assert str(partial / "sst2" / "train.jsonl") in msg and str(partial / "piqa" / "validation.jsonl") in msg
    assert "fetch-data" in msg
    assert not (tmp_path / "o").exists()  # nothing written before the checks pass
    with pytest.raises(ProtocolError):
        run_evaluation(cfg(tasks=("lambada",)))

    proc = subprocess.run([sys.executable, "-m", "aoe_megatron.cli.evaluate", str(hf_eval_model),
                           "--data-dir", str(eval_data), "--output", str(tmp_path / "x"),
                           "--num-fewshot", "5"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "protocol fixes the shots" in proc.stderr


def test_overwrite_replaces_only_our_files(tmp_path):
    from aoe_megatron.evaluation.harness import EvaluationError, prepare_output

    out = tmp_path / "out"
    (out / "samples").mkdir(parents=True)
    for name in ("results.json", "results.md", "samples/qqp.jsonl", "notes.txt"):
        (out / name).write_text("old")
    with pytest.raises(EvaluationError, match="not empty"):
        prepare_output(out, overwrite=False)
    prepare_output(out, overwrite=True)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["notes.txt", "samples"]


def test_fetch_data_requests_the_needed_splits(monkeypatch, tmp_path):
    """fetch-data (network replaced by a stub): which Hub dataset/config/split each task reads."""
    import datasets

    from aoe_megatron.evaluation.data import fetch_data

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        task = {"allenai/ai2_arc": "arc_easy", "baber/piqa": "piqa", "lighteval/siqa": "social_iqa",
                "allenai/winogrande": "winogrande", "Rowan/hellaswag": "hellaswag"}.get(path, name)
        return datasets.Dataset.from_list(eval_rows(task, split, 2))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    written = fetch_data(tmp_path, list(PAPER_TASKS))
    assert sorted(calls) == sorted([
        ("allenai/ai2_arc", "ARC-Easy", "test"), ("baber/piqa", None, "validation"),
        ("lighteval/siqa", None, "validation"), ("allenai/winogrande", "winogrande_xl", "validation"),
        ("Rowan/hellaswag", None, "validation"),
        ("nyu-mll/glue", "mnli", "validation_matched"), ("nyu-mll/glue", "mnli", "train"),
        *[("nyu-mll/glue", t, s) for t in ("qnli", "sst2", "mrpc", "qqp") for s in ("validation", "train")]])
    assert len(written) == 15 and (tmp_path / "mnli" / "validation_matched.jsonl").is_file()
    assert _jsonl(tmp_path / "arc_easy" / "test.jsonl") == eval_rows("arc_easy", "test", 2)
    calls.clear()
    assert fetch_data(tmp_path, resolve_tasks(["sst2"])) == [] and calls == []  # kept
    assert len(fetch_data(tmp_path, resolve_tasks(["sst2"]), overwrite=True)) == 2
