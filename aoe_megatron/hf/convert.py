"""Training checkpoints <-> Hugging Face folders (AoE with remote code; stock MoE as Mixtral).

One table (``_links``) says, per layer, which megatron-core parameter becomes which Hugging Face
tensors and how (QKV split per query group, GLU halves split): export reads it one way, import
the other, so the round trip is exact by construction and tested.

Export streams: one layer slice of one checkpoint tensor is in memory at a time, and every
output tensor goes straight to its safetensors shard. Both directions write into
``OUT.partial-HOST-PID`` and rename it when complete: a failure never leaves a partial model.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from aoe_megatron.hf.checkpoint_io import (CheckpointReader, ConversionError, SafetensorsWriter,
                                           resolve_checkpoint)
from aoe_megatron.runtime import integrity

HF_DIR = Path(__file__).resolve().parent
REMOTE_CODE = ("configuration_aoe.py", "modeling_aoe.py")
TOKENIZER_CODE = "tokenization_aoe.py"
ROPE_THETA = 10000.0  # megatron-core GPTModel's rotary_base default (not changed by our presets)
RMS_EPS = 1e-5  # TransformerConfig.layernorm_epsilon default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ident(t):
    return [t]


def _cat0(parts):
    return torch.cat(parts, dim=0)


@dataclass(frozen=True)
class Link:
    """megatron parameter <-> Hugging Face tensors.

    ``dist_key`` is the layer-stacked key of the distributed checkpoint; ``index`` selects this
    parameter's slice of it ((layer,) or (layer, expert)); ``split`` turns the megatron tensor
    into the Hugging Face tensors (in ``hf`` order) and ``merge`` is its inverse.
    """

    param: str
    dist_key: str
    index: tuple
    hf: tuple
    split: Callable = _ident
    merge: Callable = lambda parts: parts[0]


def _qkv_ops(heads: int, groups: int, head_dim: int):
    """megatron-core packs QKV per query group: [q (heads/groups heads), k, v] for each group."""
    per = heads // groups

    def split(w):
        w = w.reshape(groups, per + 2, head_dim, -1)
        d = w.shape[-1]
        return [w[:, :per].reshape(-1, d), w[:, per].reshape(-1, d), w[:, per + 1].reshape(-1, d)]

    def merge(parts):
        q, k, v = parts
        d = q.shape[-1]
        q = q.reshape(groups, per, head_dim, d)
        return torch.cat([q, k.reshape(groups, 1, head_dim, d), v.reshape(groups, 1, head_dim, d)],
                         dim=1).reshape(-1, d)

    return split, merge


def _glu_split(w):
    return list(torch.chunk(w, 2, dim=0))  # megatron-core's linear_fc1: [gate; up]


def _links(cfg, num_query_groups: int) -> list:
    """Every parameter of the model ``cfg`` (a ModelConfig), in Hugging Face write order."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qkv_split, qkv_merge = _qkv_ops(cfg.num_attention_heads, num_query_groups, head_dim)
    links = [Link("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", (),
                  ("model.embed_tokens.weight",))]
    for l in range(cfg.num_layers):
        m, h = f"decoder.layers.{l}.", f"model.layers.{l}."
        links += [
            Link(m + "input_layernorm.weight", "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                 (l,), (h + "input_layernorm.weight",)),
            Link(m + "self_attention.linear_qkv.weight", "decoder.layers.self_attention.linear_qkv.weight",
                 (l,), tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), qkv_split, qkv_merge),
            Link(m + "self_attention.linear_proj.weight", "decoder.layers.self_attention.linear_proj.weight",
                 (l,), (h + "self_attn.o_proj.weight",)),
            Link(m + "pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                 (l,), (h + "post_attention_layernorm.weight",)),
        ]
        if cfg.arch == "aoe":
            links.append(Link(m + "mlp.router.weight", "decoder.layers.mlp.router.weight", (l,),
                              (h + "mlp.w_down",)))
            links += [Link(m + f"mlp.experts.{w}", f"decoder.layers.mlp.experts.{w}", (l,), (h + f"mlp.{w}",))
                      for w in ("w_up", "w_p", "w_o")]
            if cfg.expert_bias:
                links.append(Link(m + "mlp.router.expert_bias", "decoder.layers.mlp.router.expert_bias",
                                  (l,), (h + "mlp.expert_bias",)))
        else:
            moe = h + "block_sparse_moe."
            links.append(Link(m + "mlp.router.weight", "decoder.layers.mlp.router.weight", (l,),
                              (moe + "gate.weight",)))
            for e in range(cfg.num_experts):
                links.append(Link(
                    m + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                    "decoder.layers.mlp.experts.experts.linear_fc1.weight", (l, e),
                    (moe + f"experts.{e}.w1.weight", moe + f"experts.{e}.w3.weight"), _glu_split, _cat0))
            for e in range(cfg.num_experts):
                links.append(Link(
                    m + f"mlp.experts.local_experts.{e}.linear_fc2.weight",
                    "decoder.layers.mlp.experts.experts.linear_fc2.weight", (l, e),
                    (moe + f"experts.{e}.w2.weight",)))
    links.append(Link("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", (),
                      ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        links.append(Link("output_layer.weight", "output_layer.weight", (), ("lm_head.weight",)))
    return links


# ----------------------------------------------------------------------------- shared checks


def _model_config(raw: dict):
    from aoe_megatron.models.gpt import ModelConfig

    try:
        return ModelConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"invalid model configuration: {exc}") from None


def _check_exportable(cfg) -> None:
    from aoe_megatron.hf.configuration_aoe import NORM_ORDERS, SELECTIONS

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


@contextmanager
def _staged_output(out: Path, overwrite: bool):
    """Yields ``OUT.partial-HOST-PID`` to write into; renamed to ``out`` on success, removed on
    any failure: a conversion is published whole or not at all."""
    if out.exists() and not overwrite:
        raise ConversionError(
            f"output folder {out} already exists: choose a new path, remove it, or pass --overwrite "
            f"(it is replaced only once the new conversion is complete)"
        )
    tmp = out.parent / f"{out.name}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


# ----------------------------------------------------------------------------- tokenizer


def data_manifest(state: dict, *, data=None, manifest=None) -> dict:
    """The preprocessing manifest of the checkpoint's training data (tokenizer + BOS policy)."""
    from aoe_megatron.data.blend import DataConfig, check_manifests

    if manifest:
        path = Path(manifest)
        if not path.is_file():
            raise ConversionError(f"manifest {path} does not exist")
        return json.loads(path.read_text())
    data = data or (state.get("config", {}).get("train", {}) or {}).get("data")
    if not data or not Path(data).is_file():
        raise ConversionError(
            f"the training data config {data!r} recorded in state.json is not found from "
            f"{os.getcwd()}: pass --data DATA.yaml (the --data of the training run) or --manifest "
            f"PREFIX.manifest.json; the tokenizer and its BOS policy are read from there"
        )
    try:
        return check_manifests(DataConfig.load(data).prefixes)
    except (FileNotFoundError, ValueError) as exc:
        raise ConversionError(f"{data}: {exc}") from None


def export_tokenizer(folder: Path, manifest: dict, *, tokenizer_model=None, vocab_size: int) -> dict:
    """Write the exact preprocessing tokenizer (code + sentencepiece model) into ``folder``."""
    from aoe_megatron.data.tokenizer import sha256_of
    from aoe_megatron.hf.tokenization_aoe import AoETokenizer

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


# ----------------------------------------------------------------------------- export


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
            f"state.json says"
        )
    if shapes[key][:2] != (cfg.num_layers, cfg.num_experts):
        raise ConversionError(
            f"{reader.path}: {key} holds {shapes[key][:2]} (layers, experts) but state.json's "
            f"config says ({cfg.num_layers}, {cfg.num_experts})"
        )
    if cfg.num_experts % ep:
        raise ConversionError(f"{reader.path}/state.json: expert_parallel_size={ep} does not divide "
                              f"num_experts={cfg.num_experts}")
    per_rank = cfg.num_experts // ep
    for chunk in reader.metadata.state_dict_metadata[key].chunks:
        first, count = chunk.offsets[1], chunk.sizes[1]
        if first // per_rank != (first + count - 1) // per_rank:
            raise ConversionError(
                f"{reader.path}: a shard of {key} holds experts {first}..{first + count - 1}, which "
                f"no rank of the recorded layout (expert_parallel_size={ep}, {per_rank} experts per "
                f"rank) wrote: state.json and the shard files come from different runs; convert "
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
        from aoe_megatron.hf.configuration_aoe import AoEConfig

        config = AoEConfig(num_experts=cfg.num_experts, d_low=cfg.aoe.d_low, d_wide=d_wide,
                           norm=cfg.aoe.norm, selection=cfg.aoe.selection,
                           expert_bias=cfg.expert_bias, rope_theta=ROPE_THETA,
                           architectures=["AoEForCausalLM"], **common)
        config.auto_map = {"AutoConfig": "configuration_aoe.AoEConfig",
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
        from aoe_megatron.hf.modeling_aoe import AoEForCausalLM as model_class
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
            f"state.json's model config does not match the saved weights"
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
    cfg = _model_config(state.get("config", {}).get("model", {}))
    _check_exportable(cfg)
    _check_layout(reader, cfg)
    manifest_data = data_manifest(state, data=data, manifest=manifest)
    qkv_rows = reader.shape("decoder.layers.self_attention.linear_qkv.weight")[1]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    num_query_groups = (qkv_rows // head_dim - cfg.num_attention_heads) // 2  # rows: (H + 2G) * Dh
    links = _links(cfg, num_query_groups)
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
    with _staged_output(out, overwrite) as tmp:
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


# ----------------------------------------------------------------------------- import


def _hf_model_config(config: dict):
    """The ModelConfig of an exported folder (recorded at export, else read from config.json)."""
    recorded = (config.get("aoe_megatron") or {}).get("model")
    if recorded:
        return _model_config(recorded)
    kind = config.get("model_type")
    common = dict(num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                  num_attention_heads=config["num_attention_heads"], vocab_size=config["vocab_size"],
                  top_k=config["num_experts_per_tok"], seq_length=config.get("max_position_embeddings", 2048),
                  tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    if kind == "aoe":
        return _model_config({**common, "arch": "aoe", "num_experts": config["num_experts"],
                              "ffn_hidden_size": config["d_wide"],
                              "expert_bias": bool(config.get("expert_bias", False)),
                              "aoe": {"d_low": config["d_low"], "d_wide": config["d_wide"],
                                      "norm": config["norm"],
                                      # "weight_mode": exported before the rename (it warns)
                                      **{k: config[k] for k in ("selection", "weight_mode")
                                         if k in config}}})
    if kind == "mixtral":
        return _model_config({**common, "arch": "moe", "num_experts": config["num_local_experts"],
                              "ffn_hidden_size": config["intermediate_size"]})
    raise ConversionError(f"model_type {kind!r} is neither 'aoe' nor 'mixtral'")


class _HFTensors:
    """Lazy access to the safetensors of a Hugging Face folder; records what was used."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            weight_map = None
        else:
            raise ConversionError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for f in files:
            if not (folder / f).is_file():
                raise ConversionError(f"weight shard {folder / f} is missing: copy the whole folder again")
        self.handles = {f: safe_open(str(folder / f), framework="pt") for f in files}
        self.where = weight_map or {k: "model.safetensors" for k in self.handles["model.safetensors"].keys()}
        self.used = set()

    def dtype(self, name: str) -> torch.dtype:
        """From the safetensors header, without reading the tensor."""
        if name not in self.where:
            raise ConversionError(f"the Hugging Face folder has no tensor {name!r}")
        code = self.handles[self.where[name]].get_slice(name).get_dtype()
        return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[code]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ConversionError(f"the Hugging Face folder has no tensor {name!r}")
        self.used.add(name)
        return self.handles[self.where[name]].get_tensor(name)


def import_from_hf(folder, out, *, overwrite: bool = False, log: Callable = print) -> Path:
    """Convert a Hugging Face folder (exported AoE, or Mixtral) into a training checkpoint.

    Writes ``out/step_N`` (N = the exported step, else 0), model weights only, and no ``latest``
    (there is no optimizer state to resume): train from it with ``--load-weights out/step_N`` at
    any EP size (``--ckpt-dir out`` then adds the new run's checkpoints beside it). Memory: the
    model once (it is built, filled, and saved by megatron-core's distributed checkpointing).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from aoe_megatron.runtime.distributed import init_megatron, shutdown
    from aoe_megatron.models.gpt import build_gpt_model, transformer_config

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder / 'config.json'} is missing: {folder} is not a Hugging Face model folder")
    config = json.loads((folder / "config.json").read_text())
    cfg = _model_config_checked(folder, config)
    tensors = _HFTensors(folder)
    dtype = tensors.dtype("model.embed_tokens.weight")
    out = Path(out)
    with _staged_output(out, overwrite) as tmp:
        owns_group = not dist.is_initialized()  # else: a caller's world of size 1 (tests)
        if not owns_group and dist.get_world_size() != 1:
            raise ConversionError("import_from_hf runs in a single process")
        init_megatron(world_size=1, expert_parallel_size=1)
        try:
            tc = transformer_config(cfg, perform_initialization=False, params_dtype=dtype,
                                    use_cpu_initialization=True)
            model = build_gpt_model(cfg, tc, use_te=False)
            params = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
            heads = cfg.num_attention_heads
            groups = config.get("num_key_value_heads") or heads
            links = _links(cfg, groups)
            unmapped = sorted(set(params) - {link.param for link in links})
            if unmapped:
                raise ConversionError(f"model parameters without a Hugging Face source: {unmapped}")
            with torch.no_grad():
                for link in links:
                    value = link.merge([tensors.get(n) for n in link.hf])
                    target = params[link.param]
                    if value.shape != target.shape:
                        raise ConversionError(
                            f"{folder}: {link.hf} give {tuple(value.shape)} for {link.param}, the "
                            f"model described by config.json needs {tuple(target.shape)}")
                    target.copy_(value)
            unused = sorted(set(tensors.where) - tensors.used)
            if unused:
                raise ConversionError(f"{folder} holds tensors the model does not use: {unused[:5]}")
            step = (config.get("aoe_megatron") or {}).get("step") or 0
            step_dir = tmp / f"step_{step:08d}"
            (step_dir / "model").mkdir(parents=True)
            dist_checkpointing.save(model.sharded_state_dict(), str(step_dir / "model"))
        finally:
            if owns_group:
                shutdown()
        provenance = config.get("aoe_megatron") or {}
        state = {"step": step, "consumed_samples": provenance.get("consumed_samples") or 0,
                 "layout": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": None},
                 "config": {"model": asdict(cfg), "train": {"imported_from": str(folder.resolve())}},
                 "weights_only": True}
        (step_dir / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        integrity.write_manifest(step_dir)  # last, as a training checkpoint's: its readers verify
    if log:
        log(f"wrote {out / step_dir.name}: continue pretraining with --load-weights {out / step_dir.name}")
    return out / step_dir.name


def _model_config_checked(folder: Path, config: dict):
    try:
        cfg = _hf_model_config(config)
    except KeyError as exc:
        raise ConversionError(f"{folder / 'config.json'} lacks {exc}") from None
    tok_file = folder / "tokenizer.model"
    if tok_file.is_file():
        import sentencepiece as spm

        pieces = spm.SentencePieceProcessor(model_file=str(tok_file)).get_piece_size()
        if pieces > cfg.vocab_size:
            raise ConversionError(
                f"{tok_file} has {pieces} pieces but {folder / 'config.json'} says vocab_size="
                f"{cfg.vocab_size}: the tokenizer does not belong to this model"
            )
        recorded = ((config.get("aoe_megatron") or {}).get("tokenizer") or {}).get("sha256")
        if recorded:
            from aoe_megatron.data.tokenizer import sha256_of

            if sha256_of(tok_file) != recorded:
                raise ConversionError(
                    f"{tok_file} is not the tokenizer this model was exported with (sha256 "
                    f"{recorded[:12]}... in config.json): restore the folder's own tokenizer.model"
                )
    return cfg
