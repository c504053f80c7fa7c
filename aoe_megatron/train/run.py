"""A run resolved once: the settings, the model, the data config and its manifests, read and
validated together before any process group starts; every later stage takes them from here.

``parse_run(argv)`` reads the preset (and its bases) once, the data config once and each
dataset's manifest once; ``resolve(cfg)`` does the same for settings built in code.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from aoe_megatron.checkpoint.layout import checkpoints
from aoe_megatron.data.blend import check_manifests, read_manifests
from aoe_megatron.data.config import DataConfig
from aoe_megatron.data.integrity import check_datasets
from aoe_megatron.data.splits import check_splits
from aoe_megatron.data.tokenizer import sha256_of
from aoe_megatron.models.gpt import ModelConfig, model_of_preset, preset_dict
from aoe_megatron.train import wandb_sink
from aoe_megatron.train.config import TrainConfig
from aoe_megatron.train.launcher_env import world_size_from_env
from aoe_megatron.train.engine import check_zero_and_ep
from aoe_megatron.train.flags import parse_with_preset


@dataclass(frozen=True)
class Run:
    cfg: TrainConfig
    model: ModelConfig
    world_size: int
    steps: int
    data: Optional[object] = None
    """The ``DataConfig`` (None: ``--mock-data``)."""
    manifests: dict = field(default_factory=dict)
    """{prefix: preprocessing manifest} of every dataset of ``data``."""

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank and step at this world size."""
        return self.cfg.grad_accum(self.world_size)

    @property
    def manifest(self) -> Optional[dict]:
        """The first dataset's manifest (they share the tokenizer and policy), or None."""
        return next(iter(self.manifests.values()), None)

    def record(self) -> dict:
        """The resolved settings: config.json, and every checkpoint's record of them (the data
        config with absolute prefixes, so that its readers work from any folder)."""
        return {"train": asdict(self.cfg), "model": asdict(self.model),
                "data": None if self.data is None else self.data.to_dict()}


def parse_run(argv=None, world_size: Optional[int] = None) -> Run:
    """The command line as one resolved run (raises ValueError / FileNotFoundError)."""
    cfg, preset = parse_with_preset(argv)
    return resolve(cfg, world_size, preset=preset)


def resolve(cfg: TrainConfig, world_size: Optional[int] = None, *,
            preset: Optional[dict] = None) -> Run:
    """Validate ``cfg`` for ``world_size`` processes (default: the launcher's) and read what it
    names; raises ValueError naming the problem. Touches no process group."""
    world = world_size_from_env() if world_size is None else world_size
    _check_settings(cfg)
    if cfg.world_size is not None:  # --build-data-index-only's (TrainConfig checked)
        world = cfg.world_size
    model = model_of_preset(preset_dict(cfg.preset) if preset is None else preset,
                            **cfg.model_overrides_dict())  # unknown keys, bad settings raise
    _check_layout(cfg, model, world)
    steps = cfg.steps(model.seq_length)
    if steps <= 0:
        raise ValueError("the run has no training step")

    beyond = [s for s in cfg.nonfinite_steps if s > steps]
    if beyond:
        raise ValueError(f"--inject-nonfinite step {beyond[0]} is beyond the run's {steps} steps")
    if not cfg.mock_data and not any((cfg.data_path, cfg.split, cfg.train_data_path,
                                      cfg.valid_data_path, cfg.test_data_path)):
        raise ValueError("no --data-path: give a data config (run/data-*.yaml), a dataset prefix "
                         "(Megatron-LM's forms work too), or --mock-data to train on random "
                         "tokens (smoke and debugging runs only)")
    data, manifests = _read_data(cfg, model, steps)
    return Run(cfg=cfg, model=model, world_size=world, steps=steps, data=data,
               manifests=manifests)


def _check_settings(cfg: TrainConfig) -> None:
    """What the settings need of this machine (TrainConfig checked the values themselves): the
    wandb extra, the checkpoint folders."""
    wandb_sink.check(cfg)
    _check_checkpoint_folders(cfg)
    if cfg.load_weights is not None and not os.path.isdir(os.path.join(cfg.load_weights, "model")):
        raise ValueError(f"--load-weights {cfg.load_weights} is not a checkpoint directory "
                         f"(it has no model/ folder)")


def _check_checkpoint_folders(cfg: TrainConfig) -> None:
    """--save/--load as in Megatron-LM, --ckpt-dir for both; a run that would start from scratch
    in a folder of checkpoints is refused rather than write over them."""
    save = cfg.save_dir()
    if save and not cfg.load_dir() and os.path.isdir(save) and (found := checkpoints(save)):
        raise ValueError(f"--save {save} already holds checkpoints (newest {found[-1].name}) and "
                         f"no --load was given, so this run would start from scratch and write "
                         f"over them: add --load {save} to resume from it, or choose an empty "
                         f"folder")


def _check_layout(cfg: TrainConfig, model: ModelConfig, world: int) -> None:
    """Expert parallelism, ZeRO and the batch against the model and the world size."""
    ep = cfg.expert_model_parallel_size
    if model.arch == "aoe":
        model.aoe_config(ep)  # EP must divide the experts
    elif model.num_experts % ep:
        raise ValueError(f"num_experts={model.num_experts} is not divisible by expert parallel "
                         f"size {ep}")
    if world % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the {world} processes")

    check_zero_and_ep(cfg.zero_stage, ep)
    if cfg.global_batch_size % (cfg.micro_batch_size * world):
        raise ValueError(f"global batch {cfg.global_batch_size} is not a multiple of micro batch "
                         f"{cfg.micro_batch_size} x {world} data-parallel processes")


def _on_rank0(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


def _read_data(cfg: TrainConfig, model: ModelConfig, steps: int) -> tuple:
    """(DataConfig, {prefix: manifest}), each file read once; (None, {}) for mock data."""
    if cfg.mock_data:
        return None, {}

    data = DataConfig.from_args(cfg.data_path, split=cfg.split, train=cfg.train_data_path,
                                valid=cfg.valid_data_path, test=cfg.test_data_path)
    manifests = read_manifests(data.prefixes, no_manifest=cfg.no_manifest,
                               tokenizer_model=cfg.tokenizer_model, say=_on_rank0)
    check_datasets(manifests, say=_on_rank0)  # sizes and .idx against .bin: a few bytes a file
    sha = sha256_of(cfg.tokenizer_model) if cfg.tokenizer_model else None
    first = check_manifests(data.prefixes, sha, manifests=manifests)
    if first["tokenizer"]["vocab_size"] > model.vocab_size:
        raise ValueError(f"the data's tokenizer has {first['tokenizer']['vocab_size']} ids but "
                         f"the model's vocabulary is {model.vocab_size}")
    if not first["policy"]["append_eod"]:
        raise ValueError(f"{data.prefixes[0]} holds documents without an EOD token after each "
                         f"(its manifest: append_eod false): training needs them separated. "
                         f"Preprocess again with --append-eod")
    valid = data.valid_blend[0] if data.valid_blend else data.train_blend[0]
    check_splits([data.train_blend[0] if steps else [], valid if cfg.eval_interval else [], []],
                 split=data.split, sample_tokens=model.seq_length + 1)
    return data, manifests
