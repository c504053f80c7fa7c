"""Hugging Face folder (an exported AoE, or Mixtral) -> training checkpoint, weights only.

The model is built by megatron-core, filled through ``mapping.links`` read backwards, and saved
by its distributed checkpointing into ``OUT.partial-HOST-PID``, renamed when complete
(``checkpoint_io.staged_output``), with the manifest every checkpoint reader verifies.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from aoe_megatron.checkpoint import integrity, layout
from aoe_megatron.data.tokenizer import sha256_of
from aoe_megatron.hf.checkpoint_io import ConversionError, staged_output
from aoe_megatron.hf.mapping import links as all_links
from aoe_megatron.hf.mapping import model_config
from aoe_megatron.models.gpt import build_gpt_model, transformer_config
from aoe_megatron.runtime.distributed import init_megatron, shutdown


def hf_model_config(config: dict):
    """The ModelConfig of an exported folder (recorded at export, else read from config.json)."""
    recorded = (config.get("aoe_megatron") or {}).get("model")
    if recorded:
        return model_config(recorded)
    kind = config.get("model_type")
    common = dict(num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                  num_attention_heads=config["num_attention_heads"], vocab_size=config["vocab_size"],
                  top_k=config["num_experts_per_tok"], seq_length=config.get("max_position_embeddings", 2048),
                  tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    if kind == "aoe":
        return model_config({**common, "arch": "aoe", "num_experts": config["num_experts"],
                              "ffn_hidden_size": config["d_wide"],
                              "expert_bias": bool(config.get("expert_bias", False)),
                              "aoe": {"d_low": config["d_low"], "d_wide": config["d_wide"],
                                      "norm": config["norm"],
                                      # "weight_mode": exported before the rename (it warns)
                                      **{k: config[k] for k in ("selection", "weight_mode")
                                         if k in config}}})
    if kind == "mixtral":
        return model_config({**common, "arch": "moe", "num_experts": config["num_local_experts"],
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

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder / 'config.json'} is missing: {folder} is not a Hugging Face model folder")
    config = json.loads((folder / "config.json").read_text())
    cfg = _model_config_checked(folder, config)
    tensors = _HFTensors(folder)
    dtype = tensors.dtype("model.embed_tokens.weight")
    out = Path(out)
    with staged_output(out, overwrite) as tmp:
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
            links = all_links(cfg, groups)
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
            step_dir = tmp / layout.step_name(step)
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
        layout.state_path(step_dir).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        integrity.write_manifest(step_dir)  # last, as a training checkpoint's: its readers verify
    if log:
        log(f"wrote {out / step_dir.name}: continue pretraining with --load-weights {out / step_dir.name}")
    return out / step_dir.name


def _model_config_checked(folder: Path, config: dict):
    try:
        cfg = hf_model_config(config)
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
            if sha256_of(tok_file) != recorded:
                raise ConversionError(
                    f"{tok_file} is not the tokenizer this model was exported with (sha256 "
                    f"{recorded[:12]}... in config.json): restore the folder's own tokenizer.model"
                )
    return cfg
