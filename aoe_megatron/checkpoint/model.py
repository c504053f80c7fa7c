"""A checkpoint's model, for every reader that wants the weights and not a training run: the
trainer's ``--load-weights``, the study's evaluation and norm probe, the tests.

``load_model(step_dir)`` builds the model its state record describes and loads its weights, at
expert-parallel size 1 on this process (a megatron world must be up); ``load_weights`` fills a
model built elsewhere, at any expert-parallel size. Neither verifies the checkpoint: its readers
do first (``integrity.require_verified``), each with its own ``--no-verify``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from aoe_megatron.checkpoint.errors import CheckpointTooNew
from aoe_megatron.checkpoint.layout import is_checkpoint, read_state
from aoe_megatron.models.gpt import ModelConfig, build_gpt_model, transformer_config
from aoe_megatron.runtime.versions import installed_mcore, mcore_at_least


def check_release(step_dir) -> None:
    """Refuse, with the way out, a checkpoint the installed megatron-core cannot read: from 0.17
    on megatron-core keeps a distributed checkpoint's common state inside it, without the
    ``common.pt`` that 0.16.1 reads (the other way, 0.16.1's checkpoints load under 0.19.2)."""
    path = Path(step_dir)
    meta = path / "model" / "metadata.json"
    if mcore_at_least("0.17") or not meta.is_file() or "common_backend" in json.loads(meta.read_text()):
        return
    saved = read_state(path).get("megatron_core") if is_checkpoint(path) else None
    raise CheckpointTooNew(f"{path} was saved under megatron-core {saved or '0.17 or later'}, whose "
                           f"checkpoints megatron-core {installed_mcore()} cannot read (no "
                           f"model/common.pt): load it where megatron-core 0.19.2 is installed "
                           f"(Python 3.12; docs/compatibility.md)")


def load_weights(step_dir, model) -> None:
    """``step_dir``'s model weights into ``model``, at any expert-parallel size."""
    from megatron.core import dist_checkpointing

    check_release(step_dir)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(Path(step_dir) / "model"))
    result = model.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{step_dir}: missing {missing}, unexpected {result.unexpected_keys}")


def model_config(step_dir) -> ModelConfig:
    """The model settings ``step_dir``'s state record holds."""
    return ModelConfig.from_dict(read_state(step_dir)["config"]["model"])


def load_model(step_dir, cfg: Optional[ModelConfig] = None, *, device=None, dtype: str = "fp32",
               use_te: Optional[bool] = None):
    """The model of ``step_dir`` (settings: ``cfg``, else its state record's) with its weights, in
    eval mode on ``device`` (default: CUDA if there is one); ``dtype`` "bf16" builds it in bf16;
    ``use_te=False`` builds it without TransformerEngine."""
    cfg = cfg or model_config(step_dir)
    extra = {"bf16": True, "params_dtype": torch.bfloat16} if dtype == "bf16" else {}
    model = build_gpt_model(cfg, transformer_config(cfg, perform_initialization=False, **extra),
                            use_te=use_te)
    load_weights(step_dir, model)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return model.to(device).eval()
