"""Training checkpoint -> Hugging Face folder (AoE with remote code; stock MoE as Mixtral).

Streams: one layer slice of one checkpoint tensor is in memory at a time, and every output tensor
goes straight to its safetensors shard, in ``OUT.partial-HOST-PID`` renamed when complete
(``checkpoint_io.staged_output``): a failure never leaves a partial model. The exact
preprocessing tokenizer (code and sentencepiece model) goes with it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch

from aoe_megatron.checkpoint import integrity
from aoe_megatron.checkpoint.layout import STATE
from aoe_megatron.data.blend import check_manifests
from aoe_megatron.data.config import DataConfig
from aoe_megatron.data.tokenizer import sha256_of
from aoe_megatron.hf.checkpoint_io import (CheckpointReader, ConversionError, SafetensorsWriter,
                                           resolve_checkpoint, staged_output)
from aoe_megatron.hf.mapping import links as all_links
from aoe_megatron.hf.mapping import model_config

HF_DIR = Path(__file__).resolve().parent
REMOTE_CODE = ("configuration_aoe.py", "modeling_aoe.py")
TOKENIZER_CODE = "tokenization_aoe.py"
ROPE_THETA = 10000.0  # megatron-core GPTModel's rotary_base default (not changed by our presets)
RMS_EPS = 1e-5  # TransformerConfig.layernorm_epsilon default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_exportable(cfg) -> None:
    from aoe_megatron.hf.configuration_aoe import (  # deferred: only exports load transformers
        NORM_ORDERS, SELECTIONS)

    if cfg.arch == "aoe":
        if cfg.aoe.factorized != "gate":
            raise ConversionError(f"factorized={cfg.aoe.factorized!r} (a rebuttal variant) has no "
                                  f"Hugging Face model; the exported AoE factorizes W_g")
        if cfg.aoe.inference_selection != "norm":
            raise ConversionError(f"inference_selection={cfg.aoe.inference_selection!r} (a rebuttal "
                                  f"variant) has no Hugging Face model")
        if cfg.aoe.rank_source != "cache":
            raise ConversionError(
                f"rank_source={cfg.aoe.rank_source!r} is a training control; the Hugging Face AoE "
                f"model ranks experts by their cache norm only"
            )
        if cfg.aoe.selection not in SELECTIONS or cfg.aoe.norm not in NORM_ORDERS:
            raise ConversionError(
                f"the Hugging Face AoE model implements selection {SELECTIONS} with norms "
                f"{NORM_ORDERS}; this checkpoint uses selection={cfg.aoe.selection!r}, "
                f"norm={cfg.aoe.norm!r}"
            )
    elif cfg.expert_bias or cfg.router.score_function != "softmax":
        raise ConversionError(
            "MoE with megatron-core's expert bias (sigmoid scores, a bias that chooses the experts) "
            "has no Mixtral equivalent: Mixtral routes by a softmax over the router logits, with no "
            "bias; this checkpoint's routing would change on export"
        )
    elif not cfg.router.is_stock:
        raise ConversionError(
            f"router variant {cfg.router} has no Mixtral equivalent: only the stock router exports"
        )
    elif cfg.top_k == 1:
        raise ConversionError(
            "top-1 stock MoE cannot be exported as Mixtral: megatron-core weights the expert by its "
            "softmax probability (pre-softmax routing), Mixtral renormalises the weight to 1"
        )


def data_manifest(state: dict, *, data=None, manifest=None) -> dict:
    """The preprocessing manifest of the checkpoint's training data (tokenizer + BOS policy)."""
    if manifest:
        path = Path(manifest)
        if not path.is_file():
            raise ConversionError(f"manifest {path} does not exist")
        return json.loads(path.read_text())
    recorded = state.get("config", {}) or {}
    if data is None and isinstance(recorded.get("data"), dict):  # absolute prefixes: any folder
        try:
            return check_manifests(DataConfig.load(recorded["data"]).prefixes)
        except (FileNotFoundError, ValueError) as exc:
            raise ConversionError(f"the training data recorded in {STATE}: {exc}; pass --data "
                                  f"DATA.yaml or --manifest PREFIX.manifest.json") from None
    train = recorded.get("train", {}) or {}
    data = data or train.get("data_path", train.get("data"))  # "data": records before the rename
    if isinstance(data, (list, tuple)):  # --data-path as given (a one-item list: a YAML)
        data = data[0] if len(data) == 1 else None
    if not data or not Path(data).is_file():
        raise ConversionError(
            f"the training data config {data!r} recorded in {STATE} is not found from "
            f"{os.getcwd()}: pass --data DATA.yaml (the --data of the training run) or --manifest "
            f"PREFIX.manifest.json; the tokenizer and its BOS policy are read from there"
        )
    try:
        return check_manifests(DataConfig.load(data).prefixes)
    except (FileNotFoundError, ValueError) as exc:
        raise ConversionError(f"{data}: {exc}") from None


def export_tokenizer(folder: Path, manifest: dict, *, tokenizer_model=None, vocab_size: int) -> dict:
    """Write the exact preprocessing tokenizer (code + sentencepiece model) into ``folder``."""
    from aoe_megatron.hf.tokenization_aoe import (  # deferred: only exports load transformers
        AoETokenizer)

    tok = manifest["tokenizer"]
    path = Path(tokenizer_model or tok["path"])
    if not path.is_file():
        raise ConversionError(
            f"tokenizer {path} (from the data manifest) does not exist: pass --tokenizer-model PATH"
        )
    sha = sha256_of(path)
    if sha != tok["sha256"]:
        raise ConversionError(
            f"tokenizer {path} (sha256 {sha[:12]}...) is not the one the training data was "
            f"tokenized with ({tok['path']}, sha256 {tok['sha256'][:12]}...): pass that file"
        )
    if tok["vocab_size"] > vocab_size:
        raise ConversionError(
            f"tokenizer {path} has {tok['vocab_size']} pieces but the model's vocab_size is "
            f"{vocab_size}: the checkpoint and the data manifest do not belong together"
        )
    shutil.copyfile(HF_DIR / TOKENIZER_CODE, folder / TOKENIZER_CODE)
    tokenizer = AoETokenizer(vocab_file=str(path), prepend_bos=manifest["policy"]["prepend_bos"])
    tokenizer.init_kwargs["auto_map"] = {"AutoTokenizer": ["tokenization_aoe.AoETokenizer", None]}
    tokenizer.save_pretrained(str(folder))
    return {"sha256": sha, "prepend_bos": manifest["policy"]["prepend_bos"], "vocab_size": tok["vocab_size"]}


def _check_layout(reader: CheckpointReader, cfg) -> None:
    """Global shapes must be the configured model's; expert shards must match the saved EP."""
    shapes = reader.tensors()
    layout = reader.state.get("layout", {})
    ep = layout.get("expert_parallel_size", 1)
    key = ("decoder.layers.mlp.experts.w_up" if cfg.arch == "aoe"
           else "decoder.layers.mlp.experts.experts.linear_fc2.weight")
    if key not in shapes:
        raise ConversionError(
            f"{reader.path / 'model'} has no {key!r}: it is not a {cfg.arch} checkpoint as its "
            f"{STATE} says"
        )
    if shapes[key][:2] != (cfg.num_layers, cfg.num_experts):
        raise ConversionError(
            f"{reader.path}: {key} holds {shapes[key][:2]} (layers, experts) but {STATE}'s "
            f"config says ({cfg.num_layers}, {cfg.num_experts})"
        )
    if cfg.num_experts % ep:
        raise ConversionError(f"{reader.path / STATE}: expert_parallel_size={ep} does not divide "
                              f"num_experts={cfg.num_experts}")
    per_rank = cfg.num_experts // ep
    for chunk in reader.metadata.state_dict_metadata[key].chunks:
        first, count = chunk.offsets[1], chunk.sizes[1]
        if first // per_rank != (first + count - 1) // per_rank:
            raise ConversionError(
                f"{reader.path}: a shard of {key} holds experts {first}..{first + count - 1}, which "
                f"no rank of the recorded layout (expert_parallel_size={ep}, {per_rank} experts per "
                f"rank) wrote: {STATE} and the shard files come from different runs; convert "
                f"the checkpoint directory as training wrote it"
            )


class _LayerCache:
    """The last (key, layer) read, so splitting one tensor into several does not re-read it."""

    def __init__(self, reader: CheckpointReader):
        self.reader, self.key, self.value = reader, None, None

    def get(self, key: str, index: tuple) -> torch.Tensor:
        layer, rest = (index[0], index[1:]) if index else (None, ())
        if (key, layer) != self.key:
            self.value = None  # free the previous slice first
            self.value = self.reader.read(key, layer)
            self.key = (key, layer)
        out = self.value
        for i in rest:
            out = out[i]
        return out


def _hf_config(cfg, *, num_query_groups: int, d_wide: int, dtype: torch.dtype, tok: dict, provenance: dict):
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=num_query_groups,
        head_dim=cfg.hidden_size // cfg.num_attention_heads, max_position_embeddings=cfg.seq_length,
        rms_norm_eps=RMS_EPS, tie_word_embeddings=cfg.tie_embeddings, num_experts_per_tok=cfg.top_k,
        bos_token_id=1 if tok.get("bos_id") is None else tok["bos_id"], eos_token_id=tok.get("eos_id", 2),
        aoe_megatron=provenance,
    )
    if cfg.arch == "aoe":
        from aoe_megatron.hf.configuration_aoe import (  # deferred: only exports load transformers
            AoEHFConfig)

        config = AoEHFConfig(num_experts=cfg.num_experts, d_low=cfg.aoe.d_low, d_wide=d_wide,
                             norm=cfg.aoe.norm, selection=cfg.aoe.selection,
                             expert_bias=cfg.expert_bias, rope_theta=ROPE_THETA,
                             architectures=["AoEForCausalLM"], **common)
        config.auto_map = {"AutoConfig": "configuration_aoe.AoEHFConfig",
                           "AutoModelForCausalLM": "modeling_aoe.AoEForCausalLM"}
    else:
        from transformers import MixtralConfig

        config = MixtralConfig(intermediate_size=cfg.ffn_hidden_size, num_local_experts=cfg.num_experts,
                               rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                               sliding_window=None, router_aux_loss_coef=cfg.alpha_aux,
                               architectures=["MixtralForCausalLM"], **common)
    config.dtype = dtype
    return config


def _check_against_hf_model(config, entries, source: Path) -> None:
    """Every tensor about to be written has the name and shape the Hugging Face model expects."""
    if config.model_type == "aoe":
        from aoe_megatron.hf.modeling_aoe import (  # deferred: only exports load transformers
            AoEForCausalLM as model_class)
    else:
        from transformers import MixtralForCausalLM as model_class
    with torch.device("meta"):
        model = model_class(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                if not (config.tie_word_embeddings and k == "lm_head.weight")}
    if config.model_type == "mixtral":  # transformers fuses the experts; files keep Mixtral's layout
        expected = {k: v for k, v in expected.items() if ".mlp." not in k}
        entries = [e for e in entries if ".block_sparse_moe." not in e[0]]
    got = {name: shape for name, shape, _ in entries}
    wrong = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
    if wrong:
        k = wrong[0]
        raise ConversionError(
            f"{source}: tensor {k} would be written with shape {got.get(k)} but the model described "
            f"by the checkpoint's config needs {expected.get(k)} ({len(wrong)} such tensors): "
            f"{STATE}'s model config does not match the saved weights"
        )


def export_to_hf(checkpoint, out, *, data=None, manifest=None, tokenizer_model=None,
                 dtype: Optional[str] = None, max_shard_bytes: int = 5 * 2**30,
                 overwrite: bool = False, verify: bool = True, log: Callable = print) -> Path:
    """Convert a training checkpoint (any EP size) into a Hugging Face folder ``out``. The
    checkpoint is verified first (``integrity.require_verified``; ``verify=False`` skips it): a
    damaged one raises ``integrity.CheckpointDamaged`` and nothing is written."""
    path = resolve_checkpoint(checkpoint)
    integrity.require_verified(path, verify=verify, what="aoe-convert-to-hf", log=log)
    reader = CheckpointReader(path)
    state = reader.state
    cfg = model_config(state.get("config", {}).get("model", {}))
    _check_exportable(cfg)
    _check_layout(reader, cfg)
    manifest_data = data_manifest(state, data=data, manifest=manifest)
    qkv_rows = reader.shape("decoder.layers.self_attention.linear_qkv.weight")[1]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    num_query_groups = (qkv_rows // head_dim - cfg.num_attention_heads) // 2  # rows: (H + 2G) * Dh
    links = all_links(cfg, num_query_groups)
    stored = reader.tensors()
    unused = sorted(set(stored) - {link.dist_key for link in links})
    if unused:
        raise ConversionError(f"{reader.path / 'model'} holds tensors this converter does not map: {unused}")

    out_dtype = DTYPES[dtype] if dtype else reader.metadata.state_dict_metadata[links[0].dist_key].properties.dtype
    entries = []
    for link in links:
        shape = reader.shape(link.dist_key)[len(link.index):]
        meta_parts = link.split(torch.empty(shape, device="meta"))
        entries += [(name, tuple(p.shape), out_dtype) for name, p in zip(link.hf, meta_parts)]
    d_wide = reader.shape("decoder.layers.mlp.experts.w_up")[-1] if cfg.arch == "aoe" else None

    out = Path(out)
    with staged_output(out, overwrite) as tmp:
        tok = export_tokenizer(tmp, manifest_data, tokenizer_model=tokenizer_model, vocab_size=cfg.vocab_size)
        provenance = {"checkpoint": str(reader.path.resolve()), "step": state.get("step"),
                      "consumed_samples": state.get("consumed_samples"), "layout": state.get("layout"),
                      "model": asdict(cfg), "tokenizer": tok}
        config = _hf_config(cfg, num_query_groups=num_query_groups, d_wide=d_wide, dtype=out_dtype,
                            tok=manifest_data["tokenizer"], provenance=provenance)
        _check_against_hf_model(config, entries, reader.path)
        config.save_pretrained(str(tmp))
        if cfg.arch == "aoe":
            for name in REMOTE_CODE:
                shutil.copyfile(HF_DIR / name, tmp / name)
        writer = SafetensorsWriter(tmp, entries, max_shard_bytes=max_shard_bytes)
        cache = _LayerCache(reader)
        for link in links:
            parts = link.split(cache.get(link.dist_key, link.index))
            for name, part in zip(link.hf, parts):
                writer.write(name, part)
            if log and link.param.endswith("pre_mlp_layernorm.weight"):
                log(f"  layer {link.index[0] + 1}/{cfg.num_layers}")
        writer.close()
    if log:
        log(f"wrote {out} ({cfg.arch}: {len(entries)} tensors in {len(writer.files)} file(s), {out_dtype})")
    return out
