"""Training settings: one schema (``TrainConfig``: each setting's default, help, group and
Megatron-LM name), filled from a preset's ``train:`` section and the command line
(``train/flags.py``), each value checked where it is declared (``__post_init__``);
``train/run.py`` resolves them against the model, the world and the files, once, before any
process group starts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, Optional, Union, get_args, get_origin, get_type_hints

from aoe_megatron.train.values import parse_overrides, parse_steps


def setting(default, group: str, help: str, *, megatron: Optional[str] = None, flag: str = "",
            nargs: Optional[str] = None):
    """A training setting: its default, its help-text group, its help, its Megatron-LM flag
    (``megatron``; the command line then spells it that way); its deprecated spellings are in
    ``runtime/deprecations.py``. ``flag`` overrides the spelling derived from the field name;
    ``nargs="+"``: the flag takes one or more values (a tuple of strings)."""
    return field(default=default, metadata={"group": group, "help": help, "megatron": megatron,
                                            "flag": flag, "nargs": nargs})


#: The help's groups, in order: Megatron-LM's (model, parallelism, training, learning rate,
#: checkpointing, data, logging) and our own faults group.
GROUPS = MODEL, PARALLEL, TRAINING, LR, CKPT, DATA, LOGGING, FAULTS = (
    "model", "parallelism", "training", "learning rate", "checkpointing", "data", "logging",
    "faults")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One run's training settings. Field names are the keys of a preset's ``train:`` section
    and of the run records, and Megatron-LM's flags where it has the setting (``train_iters``:
    ``--train-iters``; old keys load: ``upgrade_train_keys``); ``aoe_megatron.train.flags``
    spells them on the command line."""

    # --- model
    preset: str = setting(None, MODEL, "model preset: a name (tiny, 732m, 4b, aoe_732m, "
                          "moe_732m, ...: see the package's presets) or a YAML path; its model: "
                          "section is the model, its train: section the defaults of these flags")
    arch: Optional[Literal["aoe", "moe"]] = setting(
        None, MODEL, "override the preset's architecture: aoe (norm-based selection) or moe "
        "(megatron-core's routed MoE)")
    model_overrides: tuple = setting((), MODEL, "a model setting over the preset's, as KEY=VALUE "
                                     "(num_layers=4, aoe.d_low=128); repeatable", flag="--set")
    # --- parallelism
    tensor_model_parallel_size: int = setting(1, PARALLEL, "tensor-parallel size; only 1 for now "
                                              "(AoE layers are expert- and data-parallel)",
                                              megatron="--tensor-model-parallel-size")
    pipeline_model_parallel_size: int = setting(1, PARALLEL, "pipeline-parallel size; only 1 for "
                                                "now", megatron="--pipeline-model-parallel-size")
    expert_model_parallel_size: int = setting(1, PARALLEL, "expert-parallel size: processes that share "
                                        "one copy of the experts, each holding num_experts/EP of "
                                        "them; divides the processes",
                                        megatron="--expert-model-parallel-size")
    zero_stage: Literal[1, 2, 3] = setting(1, PARALLEL, "DeepSpeed ZeRO stage 1, 2 or 3 (optimizer state, + "
                              "gradients, + weights partitioned over data-parallel ranks); 3 only "
                              "with EP=1")
    distributed_timeout_minutes: float = setting(
        10.0, PARALLEL, "minutes a collective may wait for a peer before the run fails instead of "
        "hanging (a dead peer is noticed at once)", megatron="--distributed-timeout-minutes")
    # --- training
    micro_batch_size: int = setting(1, TRAINING, "sequences per forward/backward pass on one "
                                    "process", megatron="--micro-batch-size")
    global_batch_size: int = setting(8, TRAINING, "sequences per optimizer step over all data-"
                                     "parallel processes (the rest is gradient accumulation)",
                                     megatron="--global-batch-size")
    train_iters: Optional[int] = setting(None, TRAINING, "optimizer steps to train for (give this "
                                         "or --train-tokens)", megatron="--train-iters")
    train_tokens: Optional[int] = setting(None, TRAINING, "tokens to train on instead of "
                                          "--train-iters: steps = ceil(tokens / (global batch x "
                                          "sequence length))")
    weight_decay: float = setting(0.1, TRAINING, "AdamW weight decay", megatron="--weight-decay")
    adam_beta1: float = setting(0.9, TRAINING, "Adam beta1", megatron="--adam-beta1")
    adam_beta2: float = setting(0.95, TRAINING, "Adam beta2", megatron="--adam-beta2")
    clip_grad: float = setting(1.0, TRAINING, "clip the global gradient norm to this (0: no "
                               "clipping)", megatron="--clip-grad")
    seed: int = setting(1234, TRAINING, "random seed of the weights and the data order",
                        megatron="--seed")
    precision: Literal["auto", "bf16", "fp32"] = setting("auto", TRAINING, "weights and activations: bf16 or fp32; auto: bf16 "
                             "on CUDA, fp32 on the CPU (the optimizer keeps fp32 master weights "
                             "and Adam state either way); --bf16 is short for --precision bf16")
    grad_accum_dtype: Literal["fp32", "bf16"] = setting("fp32", TRAINING, "bf16 runs: dtype in which gradients are "
                                    "accumulated over micro-batches and reduced across processes "
                                    "(fp32 as Megatron-LM; bf16 halves that memory and traffic "
                                    "but rounds away small gradients)")
    moe_layer_recompute: bool = setting(False, TRAINING, "recompute each MoE layer's activations in backward "
                              "(less memory, about one more forward of the layer)",
                              megatron="--moe-layer-recompute")
    # --- learning rate
    lr: float = setting(2e-4, LR, "peak learning rate", megatron="--lr")
    min_lr: float = setting(1.28e-5, LR, "learning rate at the end of the cosine decay",
                            megatron="--min-lr")
    lr_warmup_iters: int = setting(4800, LR, "steps of linear warm-up to --lr",
                                megatron="--lr-warmup-iters")
    override_opt_param_scheduler: bool = setting(
        False, LR, "resuming: continue on this command's learning-rate schedule (--lr, --min-lr, "
        "--lr-warmup-iters, the run's length) where it differs from the checkpoint's",
        megatron="--override-opt_param-scheduler")
    use_checkpoint_opt_param_scheduler: bool = setting(
        False, LR, "resuming: continue on the checkpoint's learning-rate schedule, ignoring this "
        "command's --lr, --min-lr, --lr-warmup-iters and length for it (the run still trains "
        "to --train-iters; past the schedule's end the rate stays at its min-lr)",
        megatron="--use-checkpoint-opt_param-scheduler")
    # --- checkpointing
    save: Optional[str] = setting(None, CKPT, "write checkpoints into this folder (--keep-last "
                                  "prunes here); without --load the run starts from scratch and "
                                  "refuses a folder that already holds a checkpoint",
                                  megatron="--save")
    load: Optional[str] = setting(None, CKPT, "resume from the newest checkpoint in this folder "
                                  "that verifies (older ones are tried when the newest is "
                                  "damaged); a folder without one starts from scratch",
                                  megatron="--load")
    ckpt_dir: Optional[str] = setting(None, CKPT, "--save and --load in one: rerunning the same "
                                      "command resumes (the Slurm template's requeue)")
    save_interval: int = setting(0, CKPT, "steps between checkpoints; 0: only at the end and on "
                                 "SIGTERM/SIGUSR1", megatron="--save-interval")
    keep_last: int = setting(0, CKPT, "keep only the N newest checkpoints in the --save folder (0: "
                             "all); the one `latest` names and the newest verified one are never "
                             "deleted")
    load_weights: Optional[str] = setting(None, CKPT, "start from this checkpoint's model weights "
                                          "(saved at any EP size) with a fresh optimizer and "
                                          "schedule; ignored when --load finds a checkpoint")
    no_verify: bool = setting(False, CKPT, "read the --load-weights checkpoint without checking "
                              "its files against its manifest (a warning says so); resuming "
                              "with --load always verifies")
    # --- data
    data_path: Optional[tuple] = setting(
        None, DATA, "the training data: a data config YAML (run/data-*.yaml, or the package's by "
        "file name), a dataset prefix, or Megatron-LM's blend list W1 PREFIX1 W2 PREFIX2 ... "
        "(prefixes without weights are weighted by size); required unless --mock-data or "
        "--train-data-path", megatron="--data-path", nargs="+")
    split: Optional[str] = setting(
        None, DATA, "train,valid,test shares of each --data-path prefix's documents, e.g. "
        "98,1,1 (default 969,30,1 as Megatron-LM; a data config gives its own split:)",
        megatron="--split")
    train_data_path: Optional[tuple] = setting(
        None, DATA, "training datasets, read whole (a prefix or W1 PREFIX1 ...), instead of "
        "--data-path with --split", megatron="--train-data-path", nargs="+")
    valid_data_path: Optional[tuple] = setting(
        None, DATA, "validation datasets, read whole (with --train-data-path)",
        megatron="--valid-data-path", nargs="+")
    test_data_path: Optional[tuple] = setting(
        None, DATA, "test datasets (with --train-data-path): checked and recorded, not read by "
        "training", megatron="--test-data-path", nargs="+")
    no_manifest: bool = setting(
        False, DATA, "train on datasets without a preprocessing manifest (a Megatron-LM corpus "
        "not adopted with `aoe-verify-data --adopt`): structure checked, tokenizer "
        "(--tokenizer-model, else the default) taken on trust, with a warning")
    mock_data: bool = setting(False, DATA, "train on random tokens instead of --data-path (smoke "
                              "and debugging runs)", megatron="--mock-data")
    tokenizer_model: Optional[str] = setting(None, DATA, "if given, the data must have been "
                                             "tokenized with this sentencepiece file (its sha256 "
                                             "is checked)", megatron="--tokenizer-model")
    data_cache_path: Optional[str] = setting(
        None, DATA, "folder of megatron-core's dataset sample indices, built by rank 0 and read "
        "by every rank: on a filesystem every node sees (default: data-cache beside the run "
        "directory; never inside the corpus)", megatron="--data-cache-path")
    build_data_index_only: bool = setting(
        False, DATA, "build the data index cache for this command's exact settings and exit "
        "(one process, no GPU: a CPU node ahead of the job, which then reuses it); with "
        "--world-size")
    world_size: Optional[int] = setting(
        None, DATA, "with --build-data-index-only: the job's process count (nodes x GPUs per "
        "node), which decides its validation samples (default: WORLD_SIZE, else 1); training "
        "takes it from the launcher")
    allow_data_change: bool = setting(False, DATA, "resume even if the data differs from the "
                                      "checkpoint's record; a warning shows both, and later "
                                      "checkpoints record the new data")
    # --- logging
    log_interval: int = setting(1, LOGGING, "steps between training log lines and TensorBoard "
                                "points (selection statistics are computed on these steps only)",
                                megatron="--log-interval")
    eval_interval: int = setting(100, LOGGING, "steps between validation-loss evaluations (0: "
                                 "none)", megatron="--eval-interval")
    eval_iters: int = setting(4, LOGGING, "global batches per validation-loss evaluation",
                              megatron="--eval-iters")
    run_dir: Optional[str] = setting(
        None, LOGGING, "folder for TensorBoard logs, metrics.jsonl, the resolved config and the "
        "run's record; one run per folder (a resumed run appends; one that resumes no checkpoint "
        "first moves an earlier run's files to RUN_DIR/previous/<time>/); none: SAVE/run with "
        "--save or --ckpt-dir (restarts append there), else a new runs/<UTC time>-<preset>")
    tensorboard_dir: Optional[str] = setting(
        None, LOGGING, "folder for the TensorBoard event files instead of the run directory (rank "
        "0 writes them; a resumed run appends)", megatron="--tensorboard-dir")
    wandb_project: Optional[str] = setting(
        None, LOGGING, "also log to Weights & Biases, in this project (rank 0: the resolved "
        "arguments as the W&B run's config, every TensorBoard scalar as its history); needs "
        "the wandb extra: pip install 'aoe-megatron[wandb]'", megatron="--wandb-project")
    wandb_exp_name: Optional[str] = setting(
        None, LOGGING, "the W&B run's name (with --wandb-project; default: W&B's own)",
        megatron="--wandb-exp-name")
    # --- faults
    skip_nonfinite: int = setting(0, FAULTS, "skip at most this many steps whose loss or gradient "
                                  "norm is NaN or infinite, over the whole run (resumes included); "
                                  "0: the first one stops the run, naming the last good checkpoint")
    inject_nonfinite: Optional[str] = setting(None, FAULTS, "testing aid: steps (as logged, e.g. "
                                              "3,5) whose loss is made NaN on rank 0")

    def __post_init__(self) -> None:
        """What the settings alone decide (no file is read: ``train/run.py`` checks the folders)."""
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"{_flag(name)} must be one of {', '.join(map(str, choices))}, "
                                 f"got {value!r}")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) != 1:
                raise ValueError(
                    f"{_flag(name)} {getattr(self, name)}: tensor and pipeline parallelism are not "
                    f"supported yet; scale with data and expert parallelism")
        for name in ("micro_batch_size", "global_batch_size", "eval_iters", "log_interval",
                     "expert_model_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{_flag(name)} must be positive, got {getattr(self, name)}")
        if (self.train_iters is None) == (self.train_tokens is None):
            raise ValueError("give exactly one of --train-iters and --train-tokens")
        for name in ("train_iters", "train_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{_flag(name)} must be positive, got {getattr(self, name)}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler (this command's learning-rate "
                             "schedule) and --use-checkpoint-opt_param-scheduler (the "
                             "checkpoint's) exclude each other: give one")
        for name in ("keep_last", "save_interval", "eval_interval", "skip_nonfinite"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.build_data_index_only and self.mock_data:
            raise ValueError("--build-data-index-only builds the index of --data-path's datasets; "
                             "--mock-data has none")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes must be positive, got "
                             f"{self.distributed_timeout_minutes}")
        if self.ckpt_dir and (self.save or self.load):
            raise ValueError(f"--ckpt-dir {self.ckpt_dir} means both --save and --load: give "
                             f"either --ckpt-dir or --save/--load")
        if self.world_size is not None:
            if not self.build_data_index_only:
                raise ValueError("--world-size goes with --build-data-index-only (the job the "
                                 "cache is built for); training takes its world size from the "
                                 "launcher")
            if self.world_size <= 0:
                raise ValueError(f"--world-size must be positive, got {self.world_size}")
        given = [_flag(name) for name in ("data_path", "split", "train_data_path", "valid_data_path",
                                          "test_data_path") if getattr(self, name)]
        if given and self.mock_data:
            raise ValueError(f"{given[0]} and --mock-data exclude each other")
        self.nonfinite_steps  # a bad step list is a settings error before anything starts

    @property
    def nonfinite_steps(self) -> tuple:
        """``inject_nonfinite`` as step numbers: "3,5" -> (3, 5) (every reader reads this)."""
        return parse_steps(self.inject_nonfinite)

    def bf16(self) -> bool:
        """Whether the run computes in bf16 (``precision``, auto: where CUDA is)."""
        if self.precision == "auto":
            import torch

            return torch.cuda.is_available()
        return self.precision == "bf16"

    def steps(self, seq_length: int) -> int:
        """Optimizer steps of the run (``train_tokens`` counts ``seq_length``-token samples)."""
        if self.train_iters is not None:
            return self.train_iters
        return -(-self.train_tokens // (self.global_batch_size * seq_length))

    def save_dir(self) -> Optional[str]:
        """Where checkpoints are written (``--save``, else ``--ckpt-dir``)."""
        return self.save or self.ckpt_dir

    def load_dir(self) -> Optional[str]:
        """Where the run resumes from (``--load``, else ``--ckpt-dir``)."""
        return self.load or self.ckpt_dir

    def grad_accum(self, data_parallel_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)

    def model_overrides_dict(self) -> dict:
        """``--set`` and ``--arch`` as ``with_overrides`` keywords."""
        overrides = parse_overrides(self.model_overrides)
        if self.arch:
            overrides["arch"] = self.arch
        return overrides


def _choices(hint) -> tuple:
    """A Literal's values (inside Optional too), else ()."""
    if get_origin(hint) is Union:
        hint = next(a for a in get_args(hint) if a is not type(None))
    return get_args(hint) if get_origin(hint) is Literal else ()


#: Settings with a fixed set of values (their Literal types): the validation, the help's metavars
#: and the flag parsing's types read them here.
CHOICES = {name: c for name, hint in get_type_hints(TrainConfig).items() if (c := _choices(hint))}


def _flag(name: str) -> str:
    f = next(f for f in fields(TrainConfig) if f.name == name)
    return f.metadata.get("flag") or f.metadata.get("megatron") or "--" + name.replace("_", "-")
