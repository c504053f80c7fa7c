"""Training settings: a preset's ``train:`` section plus command-line overrides (``train/run.py``
resolves and validates them, once, before any process group starts)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Optional

from aoe_megatron.models.gpt import preset_dict


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    preset: str
    """Model preset name or YAML (its ``model:`` section; ``train:`` gives these defaults)."""
    data: Optional[str] = None
    """Data config YAML (run/data-*.yaml); required unless ``mock_data``."""
    mock_data: bool = False
    """Train on random tokens instead of ``data`` (smoke and debugging runs; Megatron-LM's name)."""
    arch: Optional[str] = None
    """Override the preset's architecture: aoe or moe."""
    model_overrides: tuple = ()
    """Model settings over the preset's, as KEY=VALUE (``num_layers=4``, ``aoe.d_low=128``)."""
    tensor_model_parallel_size: int = 1
    """Only 1 for now (AoE layers are expert- and data-parallel)."""
    pipeline_model_parallel_size: int = 1
    """Only 1 for now."""
    expert_parallel_size: int = 1
    zero_stage: int = 1
    precision: str = "auto"
    """Weights and activations: bf16 or fp32; auto: bf16 on CUDA, fp32 on the CPU. The fp32
    master weights and Adam state are kept by the optimizer either way."""
    grad_accum_dtype: str = "fp32"
    """bf16 runs: gradients are accumulated over the micro-batches and reduced across ranks in
    this dtype (fp32, as Megatron-LM does; bf16 halves that memory and traffic but rounds away
    small gradients over many micro-batches)."""
    micro_batch_size: int = 1
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    train_steps: Optional[int] = None
    train_tokens: Optional[int] = None
    """Alternative to train_steps: steps = ceil(tokens / (global_batch_size * seq_length))."""
    lr: float = 2e-4
    min_lr: float = 1.28e-5
    warmup_steps: int = 4800
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    seed: int = 1234
    distributed_timeout_minutes: float = 10.0
    """A collective waiting longer than this for a peer fails the run instead of hanging
    (Megatron-LM's flag and default; torch's own is 30). A dead peer is noticed at once."""
    recompute: bool = False
    """Recompute each MoE layer's activations in backward (saves memory)."""
    eval_interval: int = 100
    eval_iters: int = 4
    save_interval: int = 0
    """Steps between checkpoints; 0 saves only on a signal and at the end."""
    ckpt_dir: Optional[str] = None
    """Checkpoints go here; restarting the command resumes from the newest one that verifies."""
    keep_last: int = 0
    """Keep only the N newest checkpoints (0: all); never deletes the one ``latest`` names nor
    the newest one that passed verification (``last_verified``)."""
    load_weights: Optional[str] = None
    """Start from this checkpoint's model weights (saved at any EP size) with a fresh optimizer;
    ignored when ckpt_dir holds a checkpoint to resume from."""
    run_dir: str = "runs/default"
    """TensorBoard logs, the resolved config and the run's record."""
    log_interval: int = 1
    tokenizer_model: Optional[str] = None
    """If given, the data must have been tokenized with this file (its sha256 is checked)."""
    skip_nonfinite: int = 0
    """Skip at most this many steps whose loss or gradient norm is NaN or infinite, over the whole
    run (resumes included; their updates are never applied). 0: the first one stops the run,
    naming the step and the last good checkpoint."""
    inject_nonfinite: Optional[str] = None
    """Testing aid (fault injection): steps, numbered as logged, whose loss is made NaN on rank 0,
    e.g. ``3,5``."""
    allow_data_change: bool = False
    """Resume even if the data differs from the checkpoint's record (tokenizer, token counts,
    files, blend weights): a warning shows both, and later checkpoints record the new data."""

    def bf16(self) -> bool:
        """Whether the run computes in bf16 (``precision``, auto: where CUDA is)."""
        if self.precision == "auto":
            import torch

            return torch.cuda.is_available()
        return self.precision == "bf16"

    def steps(self, seq_length: int) -> int:
        """Optimizer steps of the run (``train_tokens`` counts ``seq_length``-token samples)."""
        if self.train_steps is not None:
            return self.train_steps
        return -(-self.train_tokens // (self.global_batch_size * seq_length))

    def grad_accum(self, data_parallel_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)

    def model_overrides_dict(self) -> dict:
        """``--set`` and ``--arch`` as ``with_overrides`` keywords."""
        overrides = parse_overrides(self.model_overrides)
        if self.arch:
            overrides["arch"] = self.arch
        return overrides


def parse_overrides(items) -> dict:
    """["num_layers=4", "aoe.d_low=128"] -> {"num_layers": 4, "aoe": {"d_low": 128}}."""
    import yaml

    out: dict = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key:
            raise ValueError(f"model override {item!r} is not KEY=VALUE")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m aoe_megatron.train",
        description="Pretrain an AoE or MoE GPT model (launch with torchrun, srun or deepspeed).",
    )
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "preset":
            ap.add_argument(flag, required=True)
        elif f.name == "model_overrides":
            ap.add_argument("--set", dest="model_overrides", action="append", default=None,
                            metavar="KEY=VALUE", help="model setting over the preset's (repeatable)")
        elif f.type in ("bool", bool):
            ap.add_argument(flag, action="store_true", default=None)
        else:
            kind = {"int": int, "float": float}.get(str(f.type).replace("Optional[", "").rstrip("]"), str)
            ap.add_argument(flag, type=kind, default=None)
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def parse_train_args(argv=None) -> TrainConfig:
    """CLI flags over the preset's ``train:`` section over the dataclass defaults."""
    return parse_with_preset(argv)[0]


def parse_with_preset(argv=None) -> tuple:
    """(TrainConfig, the preset as read): the preset file is read here, once per launch."""
    args = {k: v for k, v in vars(_parser().parse_args(argv)).items() if v is not None}
    args.pop("local_rank", None)
    preset = preset_dict(args["preset"])
    train_section = preset.get("train", {}) or {}
    known = {f.name for f in fields(TrainConfig)}
    unknown = set(train_section) - known
    if unknown:
        raise ValueError(f"unknown train settings {sorted(unknown)} in preset {args['preset']!r}")
    if "model_overrides" in args:
        args["model_overrides"] = tuple(args["model_overrides"])
    # The run's length is one setting: a length on the command line replaces the preset's.
    if {"train_steps", "train_tokens"} & set(args):
        train_section = {k: v for k, v in train_section.items() if k not in ("train_steps", "train_tokens")}
    return TrainConfig(**{**train_section, **args}), preset


def adopt_slurm_env() -> None:
    """Launched by ``srun`` directly (one task per GPU): take RANK / WORLD_SIZE / LOCAL_RANK from
    Slurm's variables. torchrun and the deepspeed launcher set them themselves."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def adopt_single_process_env() -> None:
    """A bare ``python -m aoe_megatron.train`` (no launcher set RANK and WORLD_SIZE): one process,
    rank 0, a free rendezvous port on this host. Launched runs are left as they are."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    from aoe_megatron.runtime.distributed import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def world_size_from_env() -> int:
    """The processes of this run, as the launcher says (torchrun, deepspeed: WORLD_SIZE; a bare
    ``srun``: SLURM_NTASKS); reads the environment only (``adopt_slurm_env`` writes it)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        return int(os.environ.get("SLURM_NTASKS", "1"))
    return 1
