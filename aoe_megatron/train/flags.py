"""The train command's flags, generated from ``TrainConfig``'s schema (``config.setting``):
Megatron-LM's spelling where Megatron-LM has the setting, help grouped as Megatron-LM groups its
own, deprecated spellings accepted with a note until the release ``runtime/deprecations.py``
names, no abbreviations. Megatron-LM's
model-shape flags (``--num-layers``, ...) are spellings of ``--set`` (``train/model_flags.py``);
an unknown flag gets a sentence saying what to type instead. The parser is built without torch
(``--help``); reading the preset (``parse_with_preset``) loads it."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from aoe_megatron.runtime.command_line import CommandParser
from aoe_megatron.runtime.deprecations import deprecation, renamed
from aoe_megatron.train.config import CHOICES, GROUPS, TrainConfig
from aoe_megatron.train.model_flags import MODEL_FLAGS, hint, with_model_flags
from aoe_megatron.train.values import TRAIN_LEGACY_KEYS, upgrade_train_keys

PROG = "aoe-train"
#: Flags that are not a field of their own, listed after the field they set:
#: spelling -> (field, value, Megatron-LM's spelling, help).
SHORTCUTS = {"--bf16": ("precision", "bf16", "--bf16", "short for --precision bf16")}
#: The namespace's prefix for the model flags' values (model_flags.MODEL_FLAGS).
MODEL_FLAG = "model_flag:"

#: New spelling -> its deprecated ones (runtime/deprecations.py).
_OLD: dict = {}
for _old, _new in renamed("flag").items():
    _OLD.setdefault(_new, []).append(_old)


def flag_of(f) -> str:
    """The command-line spelling of a ``TrainConfig`` field."""
    return f.metadata.get("flag") or f.metadata.get("megatron") or "--" + f.name.replace("_", "-")


def flag(name: str) -> str:
    """The spelling of the setting ``name`` (a preset's ``train:`` key), e.g. for launchers."""
    return flag_of(next(f for f in fields(TrainConfig) if f.name == name))


class _Deprecated(argparse.Action):
    """An old spelling: stores like the new one and says, once, on rank 0, what to type now."""

    def __init__(self, option_strings, dest, new: str, kind=None, **kwargs):
        self.new, self.kind = new, kind
        super().__init__(option_strings, dest, nargs=0 if kind is bool else None, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if os.environ.get("RANK", "0") == "0":
            print(f"note: {deprecation(option_string).notice()}; {self.new} is Megatron-LM's name",
                  file=sys.stderr, flush=True)
        if self.kind is bool:
            values = True
        elif self.dest == "model_overrides":
            values = [*(getattr(namespace, self.dest) or []), values]
        setattr(namespace, self.dest, values)


def _kind(f):
    if f.name in CHOICES:  # a Literal: its values' type
        return type(CHOICES[f.name][0])
    name = str(f.type).replace("Optional[", "").rstrip("]")
    return {"int": int, "float": float, "bool": bool, "tuple": tuple}.get(name, str)


#: Placeholders in the help (others: N for integers, X for reals).
METAVARS = {**{name: "{" + ",".join(map(str, c)) + "}" for name, c in CHOICES.items()},
            "preset": "NAME|YAML", "save": "DIR",
            "load": "DIR", "ckpt_dir": "DIR", "load_weights": "STEP_DIR",
            "data_path": "YAML|PREFIX", "split": "A,B,C",
            "tokenizer_model": "FILE", "run_dir": "DIR", "inject_nonfinite": "STEPS",
            "data_cache_path": "DIR", "tensorboard_dir": "DIR", "wandb_project": "NAME",
            "wandb_exp_name": "NAME"}


def _default_text(f) -> str:
    if f.name == "preset":
        return " (required)"
    if f.metadata["group"] == "model":
        return ""
    default = ("none" if f.default is None else "off" if f.default is False else f.default)
    return f" (default: {default}, or the preset's train.{f.name})"


class _TrainParser(CommandParser):
    """An unknown flag gets a sentence (``model_flags.hint``), not the usage's fifty flags."""

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            ours = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            keys = {f.name: flag_of(f) for f in fields(TrainConfig)}
            keys.update({old: keys[new] for old, new in TRAIN_LEGACY_KEYS.items()})
            hints = [h for t in extras if t.startswith("--") and (h := hint(t, PROG, ours, keys))]
            self.error("unrecognized arguments: " + " ".join(extras) + "".join(
                f"\n  {h}" for h in hints))
        return namespace

    def error(self, message):
        self.exit(2, f"{PROG}: error: {message}\n{PROG} --help lists every flag; a model setting "
                     f"without a flag of its own is --set KEY=VALUE\n")


def parser() -> argparse.ArgumentParser:
    ap = _TrainParser(
        prog=PROG, allow_abbrev=False,
        description="Pretrain an AoE or MoE GPT model. One process: `aoe-train ...`; several: "
                    "`torchrun --nproc-per-node N -m aoe_megatron.train ...`, srun or the "
                    "deepspeed launcher. Flags follow Megatron-LM's names; each defaults to the "
                    "preset's train: section, then to the value shown.")
    groups = {name: ap.add_argument_group(name) for name in GROUPS}
    for f in fields(TrainConfig):
        group, kind, spelling = groups[f.metadata["group"]], _kind(f), flag_of(f)
        text = f"{f.metadata['help']}{_default_text(f)}"
        metavar = METAVARS.get(f.name, {int: "N", float: "X"}.get(kind))
        if kind is bool:
            group.add_argument(spelling, dest=f.name, action="store_true", default=None, help=text)
        elif f.metadata.get("nargs"):
            group.add_argument(spelling, dest=f.name, nargs=f.metadata["nargs"], default=None,
                               metavar=METAVARS.get(f.name, "PATH"), help=text)
        elif kind is tuple:
            group.add_argument(spelling, dest=f.name, action="append", default=None,
                               metavar="KEY=VALUE", help=text)
        else:
            group.add_argument(spelling, dest=f.name, type=kind, default=None,
                               required=f.name == "preset", help=text, metavar=metavar)
        for old in _OLD.get(spelling, ()):
            if f.metadata.get("nargs"):  # an old spelling of a list flag takes its one old value
                kind = str
            group.add_argument(old, dest=f.name, action=_Deprecated, new=spelling, kind=kind,
                               type=None if kind in (bool, tuple) else kind, default=None,
                               metavar=metavar, help=argparse.SUPPRESS)
        for spelling, (dest, value, _, text) in SHORTCUTS.items():
            if dest == f.name:
                group.add_argument(spelling, dest=dest, action="store_const", const=value,
                                   default=None, help=text)
        if f.name == "model_overrides":
            for spelling, m in MODEL_FLAGS.items():
                text = f"{m.help} (--set {m.key}={m.switch or m.metavar}; default: the preset's)"
                if m.switch:
                    group.add_argument(spelling, dest=MODEL_FLAG + spelling, action="store_const",
                                       const=m.switch, default=None, help=text)
                else:
                    group.add_argument(spelling, dest=MODEL_FLAG + spelling, default=None,
                                       metavar=m.metavar, help=text)
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def parse_train_args(argv=None) -> TrainConfig:
    """CLI flags over the preset's ``train:`` section over the dataclass defaults."""
    return parse_with_preset(argv)[0]


def parse_with_preset(argv=None) -> tuple:
    """(TrainConfig, the preset as read): the preset file is read here, once per launch."""
    from aoe_megatron.models.gpt import preset_dict  # deferred: torch loads after --help

    args = {k: v for k, v in vars(parser().parse_args(argv)).items() if v is not None}
    args.pop("local_rank", None)
    given = {k[len(MODEL_FLAG):]: args.pop(k) for k in list(args) if k.startswith(MODEL_FLAG)}
    if given:
        args["model_overrides"] = with_model_flags(given, tuple(args.get("model_overrides", ())))
    preset = preset_dict(args["preset"])
    train_section = upgrade_train_keys(preset.get("train", {}) or {},
                                       where=f"preset {args['preset']}: train")
    known = {f.name for f in fields(TrainConfig)}
    unknown = set(train_section) - known
    if unknown:
        raise ValueError(f"unknown train settings {sorted(unknown)} in preset {args['preset']!r}")
    if "model_overrides" in args:
        args["model_overrides"] = tuple(args["model_overrides"])
    for f in fields(TrainConfig):  # list settings: a preset's single string is a one-item list
        for source in (args, train_section):
            if f.metadata.get("nargs") and source.get(f.name) is not None:
                value = source[f.name]
                source[f.name] = (value,) if isinstance(value, str) else tuple(value)
    # The run's length is one setting: a length on the command line replaces the preset's.
    if {"train_iters", "train_tokens"} & set(args):
        train_section = {k: v for k, v in train_section.items() if k not in ("train_iters", "train_tokens")}
    return TrainConfig(**{**train_section, **args}), preset


def markdown_table() -> str:
    """docs/flags.md's table: each flag, its group, its Megatron-LM name (or none), old spellings."""
    rows = ["| flag | group | Megatron-LM | preset key | deprecated spelling |",
            "|---|---|---|---|---|"]
    for f in fields(TrainConfig):
        megatron = f"`{f.metadata['megatron']}`" if f.metadata["megatron"] else "none"
        old = ", ".join(f"`{o}`" for o in _OLD.get(flag_of(f), ())) or ""
        rows.append(f"| `{flag_of(f)}` | {f.metadata['group']} | {megatron} | `{f.name}` | {old} |")
    for spelling, (dest, value, megatron, _) in SHORTCUTS.items():
        rows.append(f"| `{spelling}` | training | `{megatron}` | `{dest}: {value}` | |")
    for spelling, m in MODEL_FLAGS.items():  # spellings of --set KEY=VALUE
        value = f": {m.switch}" if m.switch else ""
        rows.append(f"| `{spelling}` | model | `{spelling}` | `model.{m.key}{value}` | |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
