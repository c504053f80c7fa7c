"""Hugging Face export and import: logits and greedy generation equal megatron-core's, the round
trip restores every tensor, the tokenizer is the preprocessing one, bad inputs fail clearly."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aoe_megatron.hf.checkpoint_io import CheckpointReader, ConversionError
from aoe_megatron.hf.convert import export_to_hf, import_from_hf
from tests.helpers import eval_rows, megatron_model

ROOT = Path(__file__).resolve().parents[1]
MIXED_TEXT = "  Two  leading spaces,\tthen   runs of spaces; digits 0 12 345 6789 and 3.14159;\n\n" \
             "unicode: café, naïve, Ærø, 日本語, emoji 🙂, <s> and </s> as text.  "


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions, None).float()


def megatron_greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):  # no KV cache: the whole sequence each step
        ids = torch.cat([ids, megatron_logits(model, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _prompt_ids(corpus, tokenizer, n: int = 2, length: int = 24) -> torch.Tensor:
    lines = corpus["src"].read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines[5:5 + n]]
    return torch.tensor([tokenizer(t)["input_ids"][:length] for t in texts])


def _all_tensors(step_dir: Path) -> dict:
    reader = CheckpointReader(step_dir)
    return {key: reader.read(key) for key in reader.tensors()}


@pytest.mark.legs
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["aoe", "moe"])
def test_export_matches_megatron_and_round_trips(arch, corpus, tmp_path, trained_checkpoint,
                                                 megatron_world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step_dir = trained_checkpoint(arch)
    hf_dir = tmp_path / "hf"
    if arch == "aoe":  # the command line once, the API otherwise
        proc = subprocess.run([sys.executable, "-m", "aoe_megatron.cli.convert_to_hf", "--checkpoint",
                               str(step_dir.parent), "--output", str(hf_dir)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        export_to_hf(step_dir, hf_dir, log=None)
    config = json.loads((hf_dir / "config.json").read_text())
    if arch == "aoe":
        assert config["model_type"] == "aoe" and config["auto_map"]["AutoModelForCausalLM"] == \
            "modeling_aoe.AoEForCausalLM"
    else:  # transformers' own Mixtral: no remote code for the model
        assert config["model_type"] == "mixtral" and "auto_map" not in config
        assert not (hf_dir / "modeling_aoe.py").exists()

    tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    ids = _prompt_ids(corpus, tokenizer)
    assert (ids[:, 0] == tokenizer.bos_token_id).all()  # the manifest's BOS policy
    reference = megatron_model(step_dir)
    want = megatron_logits(reference, ids)
    for attn in ("eager", "sdpa"):
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, attn_implementation=attn,
                                                  dtype=torch.float32).eval()
        assert type(hf).__name__ == ("AoEForCausalLM" if arch == "aoe" else "MixtralForCausalLM")
        with torch.no_grad():
            got = hf(ids).logits
        assert (got - want).abs().max().item() <= 1e-4, attn

    # greedy generation of 20 tokens: HF with its KV cache, megatron recomputing everything
    generated = hf.generate(ids[:1, :12], max_new_tokens=20, do_sample=False, min_new_tokens=20,
                            eos_token_id=None, pad_token_id=0)
    torch.testing.assert_close(generated, megatron_greedy(reference, ids[:1, :12], 20),
                               rtol=0, atol=0)

    back = import_from_hf(hf_dir, tmp_path / "back", log=None)
    original, restored = _all_tensors(step_dir), _all_tensors(back)
    assert original.keys() == restored.keys()
    for key, value in original.items():
        torch.testing.assert_close(restored[key], value, rtol=0, atol=0,  # dtype checked too
                                   msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(megatron_logits(megatron_model(back), ids), want, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_safetensors_load_the_same(tmp_path, trained_checkpoint):
    from transformers import AutoModelForCausalLM

    step_dir = trained_checkpoint("aoe")
    export_to_hf(step_dir, tmp_path / "one", log=None)
    export_to_hf(step_dir, tmp_path / "many", max_shard_bytes=2**18, log=None)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ids = torch.tensor([[1, 415, 2936, 9060, 285, 1142]])
    one, many = (AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True)
                 for name in ("one", "many"))
    with torch.no_grad():
        torch.testing.assert_close(one(ids).logits, many(ids).logits, rtol=0, atol=0)


@pytest.mark.legs
def test_exported_tokenizer_is_the_preprocessing_tokenizer(corpus, tmp_path):
    """Encodes like aoe-preprocess, BOS policy included, without a checkpoint."""
    from transformers import AutoTokenizer

    from aoe_megatron.data.manifest import read_manifest
    from aoe_megatron.data.tokenizer import Tokenizer
    from aoe_megatron.hf.convert import export_tokenizer

    manifest = read_manifest(str(corpus["prefix"]))
    export_tokenizer(tmp_path, manifest, vocab_size=32000)
    hf = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    sp = Tokenizer(manifest["tokenizer"]["path"])
    ids = sp.encode([MIXED_TEXT])[0]
    assert hf(MIXED_TEXT)["input_ids"] == [sp.bos_id] + ids
    assert hf.encode(MIXED_TEXT, add_special_tokens=False) == ids
    assert hf.decode(ids) == sp.decode(ids) == MIXED_TEXT
    assert hf.decode([sp.bos_id] + ids, skip_special_tokens=True) == MIXED_TEXT
    # and the first preprocessed document, token for token: BOS + text + EOD
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    first_text = json.loads(corpus["src"].read_text().splitlines()[0])["text"]
    dataset = IndexedDataset(str(corpus["prefix"]))
    stored = [int(t) for t in dataset[0]]
    del dataset
    assert stored == hf(first_text)["input_ids"] + [sp.eos_id]

    manifest["policy"]["prepend_bos"] = False
    nobos = tmp_path / "nobos"
    nobos.mkdir()
    export_tokenizer(nobos, manifest, vocab_size=32000)
    assert AutoTokenizer.from_pretrained(nobos, trust_remote_code=True)(MIXED_TEXT)["input_ids"] == ids


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _no_partial_left(parent: Path) -> None:
    assert not [p for p in parent.iterdir() if ".partial-" in p.name]


@pytest.mark.slow
@pytest.mark.distributed
def test_bad_inputs_fail_clearly_and_leave_nothing(corpus, tmp_path, trained_checkpoint):
    from aoe_megatron.data.train_tokenizer import train_tokenizer

    step_dir = trained_checkpoint("aoe")
    out = tmp_path / "hf"
    # verify=False: the converter's own checks, on checkpoints whose manifest would refuse them first
    # (tests/test_checkpoint_readers.py covers the verification)

    # a missing shard file
    broken = _copy(step_dir, tmp_path / "missing" / "step_00000003")
    victim = sorted((broken / "model").glob("*.distcp"))[-1]
    victim.unlink()
    with pytest.raises(ConversionError, match=f"shard {victim}.*is missing"):
        export_to_hf(broken, out, verify=False, log=None)

    # state.json's expert-parallel layout does not match the shard files
    mismatched = _copy(step_dir, tmp_path / "layout" / "step_00000003")
    state = json.loads((mismatched / "state.json").read_text())
    state["layout"]["expert_parallel_size"] = 4
    (mismatched / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConversionError, match="expert_parallel_size=4.*different runs"):
        export_to_hf(mismatched, out, verify=False, log=None)

    # state.json's model config does not describe the saved weights
    state = json.loads((step_dir / "state.json").read_text())
    state["config"]["model"]["aoe"]["d_low"] = 8
    (mismatched / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConversionError, match=r"mlp.w_down would be written with shape \(64, 64\).*"
                                              r"needs \(64, 32\)"):
        export_to_hf(mismatched, out, verify=False, log=None)

    # a tokenizer that is not the one the data was tokenized with
    other = train_tokenizer([str(corpus["src"])], str(tmp_path / "other"), vocab_size=600)
    with pytest.raises(ConversionError, match="is not the one the training data was tokenized with"):
        export_to_hf(step_dir, out, tokenizer_model=other, log=None)
    assert not out.exists()
    _no_partial_left(tmp_path)

    # the output folder exists: refused, and left as it was
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match=f"output folder {out} already exists"):
        export_to_hf(step_dir, out, log=None)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    proc = subprocess.run([sys.executable, "-m", "aoe_megatron.cli.convert_to_hf", "--checkpoint",
                           str(step_dir), "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "already exists" in proc.stderr

    # the reverse: a folder whose tokenizer was swapped, and an existing output
    hf_dir = export_to_hf(step_dir, tmp_path / "good", log=None)
    swapped = _copy(hf_dir, tmp_path / "swapped")
    shutil.copyfile(other, swapped / "tokenizer.model")
    with pytest.raises(ConversionError, match="tokenizer.model is not the tokenizer this model was exported with"):
        import_from_hf(swapped, tmp_path / "ck", log=None)
    (tmp_path / "ck").mkdir()
    with pytest.raises(ConversionError, match="already exists"):
        import_from_hf(hf_dir, tmp_path / "ck", log=None)
    no_weights = _copy(hf_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="neither model.safetensors"):
        import_from_hf(no_weights, tmp_path / "ck2", log=None)
    assert not (tmp_path / "ck2").exists()
    _no_partial_left(tmp_path)


_SAVE_BIG = """
import sys, json, torch
from pathlib import Path
from megatron.core import dist_checkpointing
from aoe_megatron.runtime.distributed import init_megatron
from aoe_megatron.models.gpt import load_preset, build_gpt_model, transformer_config
from dataclasses import asdict
init_megatron()
for folder, hidden in zip(sys.argv[2::2], map(int, sys.argv[3::2])):
    cfg = load_preset("tiny", num_layers=8, hidden_size=hidden, num_attention_heads=8,
                      ffn_hidden_size=4 * hidden, num_experts=8, top_k=2)
    model = build_gpt_model(cfg, transformer_config(cfg, perform_initialization=False), use_te=False)
    step = Path(folder) / "step_00000001"
    (step / "model").mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(step / "model"))
    state = {"step": 1, "consumed_samples": 0, "config": {"model": asdict(cfg), "train": {"data": sys.argv[1]}},
             "layout": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 1}}
    (step / "state.json").write_text(json.dumps(state))
    del model
"""

_PEAK = """
import resource, sys
import torch, transformers, sentencepiece, safetensors
from aoe_megatron.hf import convert, checkpoint_io
from torch.distributed.checkpoint import FileSystemReader
convert.export_to_hf(sys.argv[1], sys.argv[2] + "-warmup", log=None)  # imports, caches
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert.export_to_hf(sys.argv[3], sys.argv[2], log=None)
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.slow
def test_export_memory_stays_near_one_layer_slice(corpus, tmp_path):
    """A 0.9 GB checkpoint exports with a peak far below its size (streaming, not loading)."""
    env = {k: v for k, v in os.environ.items()  # not this process's rendezvous (session fixture)
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = lambda *a: subprocess.run([sys.executable, "-c", *a], cwd=ROOT, capture_output=True,
                                    text=True, timeout=600, env=env)
    proc = run(_SAVE_BIG, str(corpus["data"]), str(tmp_path / "small"), "64", str(tmp_path / "ckpt"),
               "512")
    assert proc.returncode == 0, proc.stderr[-3000:]
    size = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*.distcp"))
    reader = CheckpointReader(tmp_path / "ckpt" / "step_00000001")
    largest_slice = max(math.prod(s[1:]) if k.startswith("decoder.layers.") else math.prod(s)
                        for k, s in reader.tensors().items()) * 4
    proc = run(_PEAK, str(tmp_path / "small" / "step_00000001"), str(tmp_path / "hf"),
               str(tmp_path / "ckpt" / "step_00000001"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, peak = (int(x) * 1024 for x in proc.stdout.split()[-2:])
    grew = peak - before
    print(f"checkpoint {size / 2**20:.0f} MiB, largest slice {largest_slice / 2**20:.0f} MiB, "
          f"export grew the peak RSS by {grew / 2**20:.0f} MiB")
    assert size > 800 * 2**20
    assert grew < 4 * largest_slice + 150 * 2**20 < size / 2


@pytest.mark.slow
@pytest.mark.distributed
def test_exported_aoe_model_runs_the_evaluation(tmp_path, trained_checkpoint):
    """aoe-evaluate's harness on the exported AoE folder: a zero-shot multiple-choice task and
    a 3-shot task, offline, and lm-eval encodes with the training data's BOS policy."""
    from aoe_megatron.evaluation.harness import EvalConfig, run_evaluation

    hf_dir = export_to_hf(trained_checkpoint("aoe"), tmp_path / "hf", log=None)
    data = tmp_path / "eval_data"
    for task, split, n in (("arc_easy", "test", 4), ("sst2", "validation", 4), ("sst2", "train", 6)):
        (data / task).mkdir(parents=True, exist_ok=True)
        (data / task / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows(task, split, n)))
    run = run_evaluation(EvalConfig(model=hf_dir, data_dir=data, output=tmp_path / "eval", device="cpu",
                                    tasks=("arc_easy", "sst2"), datasets_cache=tmp_path / "cache"))
    assert run.summary["tasks"]["sst2"]["num_fewshot"] == 3 and run.summary["tasks"]["arc_easy"]["n"] == 4
    for task in ("arc_easy", "sst2"):
        records = [json.loads(x) for x in (tmp_path / "eval" / "samples" / f"{task}.jsonl").read_text().splitlines()]
        assert sum(r["correct"] for r in records) / len(records) == pytest.approx(run.summary["tasks"][task]["acc"])

    # lm-eval's own model wrapper on this folder puts BOS first, as training did
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(hf_dir), trust_remote_code=True, device="cpu", batch_size=1)
    assert lm.tok_encode("Question: hot?")[0] == lm.tokenizer.bos_token_id == 1


@pytest.mark.legs
def test_aoe_expert_bias_crosses_both_ways(corpus, tmp_path, megatron_world):
    """AoE with its norm bias (aux-loss-free balancing): a Hugging Face model with nonzero biases,
    imported, computes the same logits in megatron-core (the bias chooses the experts on both
    sides, never weights them) and exports back to the same tensors. The MoE expert-bias preset
    is refused, by name, before anything is written."""
    from safetensors.torch import load_file

    from aoe_megatron.hf.configuration_aoe import AoEHFConfig
    from aoe_megatron.hf.modeling_aoe import AoEForCausalLM

    torch.manual_seed(0)
    config = AoEHFConfig(vocab_size=32000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_experts=4, num_experts_per_tok=2, d_low=4, d_wide=24, expert_bias=True)
    hf = AoEForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.expert_bias.copy_(torch.tensor([0.4, -0.3, 0.1, -0.2]))
    hf.save_pretrained(tmp_path / "hf")
    step = import_from_hf(tmp_path / "hf", tmp_path / "mc", log=None)
    ids = torch.randint(0, 32000, (2, 16))
    with torch.no_grad():
        want = hf(ids).logits
        hf.model.layers[0].mlp.expert_bias.zero_()  # without the bias, other logits
        assert (hf(ids).logits - want).abs().max() > 1e-4
    assert (megatron_logits(megatron_model(step), ids) - want).abs().max() <= 1e-4

    export_to_hf(step, tmp_path / "back", data=corpus["data"], log=None)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["expert_bias"] is True
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(
        tmp_path / "back" / "model.safetensors")
    assert "model.layers.1.mlp.expert_bias" in after
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=key)

    state = json.loads((step / "state.json").read_text())
    state["config"]["model"].update(arch="moe", expert_bias=True, aoe={},
                                    router={"score_function": "sigmoid"})
    (step / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConversionError, match="no Mixtral equivalent"):
        export_to_hf(step, tmp_path / "moe", data=corpus["data"], verify=False, log=None)
    assert not (tmp_path / "moe").exists()
