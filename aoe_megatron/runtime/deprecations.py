"""Every name kept only so that older commands, imports and settings still work: what to use
instead, and the release that removes it. CHANGELOG.md's "Deprecated" section lists the same;
``tests/test_deprecations.py`` checks that the code's aliases are exactly these, that each still
works and names its release, and fails once the package's version reaches a removal release while
the alias is still there.

Imports nothing of the package: the module aliases, the flag parser, the settings loaders and
``tools/`` read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: The release that removes the aliases of the 0.1 series.
NEXT = "0.2.0"


@dataclass(frozen=True)
class Deprecation:
    old: str                   # as a user writes it: a module, a script, a flag, a settings key
    new: str                   # what to write instead
    kind: str                  # module | script | flag | key (a layer's) | train_key
    removed_in: Optional[str]  # None: kept while data recorded with it is read (say why in `why`)
    why: str = ""

    def notice(self) -> str:
        """The one line a use of the old name prints or warns."""
        when = f"it goes in {self.removed_in}" if self.removed_in else "it still loads"
        return f"{self.old} is deprecated: use {self.new} ({when})"


_MODULES = {"aoe_megatron.config": "aoe_megatron.moe.config",
            "aoe_megatron.ops": "aoe_megatron.moe.ops",
            "aoe_megatron.model": "aoe_megatron.models.gpt",
            "aoe_megatron.distributed": "aoe_megatron.runtime.distributed"}
_SCRIPTS = {"ablation_table": "aoe-ablation-table", "bench": "aoe-bench",
            "bench_preprocess": "aoe-bench-preprocess", "checkpoints": "aoe-checkpoints",
            "convert_from_hf": "aoe-convert-from-hf", "convert_to_hf": "aoe-convert-to-hf",
            "count_params": "aoe-count-params", "evaluate": "aoe-evaluate", "mcnemar": "aoe-mcnemar",
            "norm_probe": "aoe-norm-probe", "preprocess_data": "aoe-preprocess",
            "study": "aoe-study", "train_tokenizer": "aoe-train-tokenizer"}
_FLAGS = {"--expert-parallel-size": "--expert-model-parallel-size",
          "--train-steps": "--train-iters", "--recompute": "--moe-layer-recompute",
          "--warmup-steps": "--lr-warmup-iters", "--data": "--data-path"}

#: A preset's ``train:`` keys, renamed to the Megatron-LM flags they are (issue #37).
_TRAIN_KEYS = {"train_steps": "train_iters", "warmup_steps": "lr_warmup_iters",
               "expert_parallel_size": "expert_model_parallel_size",
               "recompute": "moe_layer_recompute", "data": "data_path"}

DEPRECATIONS: tuple = (
    *(Deprecation(old, new, "module", NEXT) for old, new in _MODULES.items()),
    *(Deprecation(f"tools/{name}.py", new, "script", NEXT) for name, new in _SCRIPTS.items()),
    *(Deprecation(old, new, "flag", NEXT) for old, new in _FLAGS.items()),
    Deprecation("weight_mode", "selection", "key", None,
                why="checkpoints, Hugging Face exports and study records written before the rename "
                    "carry it: reading them is not a convenience to withdraw"),
    *(Deprecation(old, new, "train_key", None,
                  why="checkpoints, run records and study specs written before the rename carry "
                      "it: reading them is not a convenience to withdraw")
      for old, new in _TRAIN_KEYS.items()),
)


def deprecation(old: str) -> Deprecation:
    """The entry for ``old`` (KeyError if it is not deprecated)."""
    for d in DEPRECATIONS:
        if d.old == old:
            return d
    raise KeyError(f"{old} is not a deprecated name")


def renamed(kind: str) -> dict:
    """{old: new} of one kind."""
    return {d.old: d.new for d in DEPRECATIONS if d.kind == kind}


def upgrade_keys(section: dict, kind: str, *, where: str, warn: bool = True) -> dict:
    """A copy of the settings ``section`` with ``kind``'s old keys renamed to the new ones: each
    warns (DeprecationWarning, one line) unless ``warn`` is False (a record read back); a section
    with both names of one setting is refused (ValueError)."""
    import warnings

    out = dict(section)
    for old, new in renamed(kind).items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"{where} sets both {old!r} and {new!r}: {old!r} is the old name of "
                             f"{new!r}; keep {new!r} only.")
        if warn:
            warnings.warn(f"{where}: {deprecation(old).notice()}", DeprecationWarning, stacklevel=3)
        out[new] = out.pop(old)
    return out


def _release(version: str) -> tuple:
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())


def overdue(version: str) -> list:
    """The entries a package at ``version`` must no longer carry."""
    return [d for d in DEPRECATIONS
            if d.removed_in is not None and _release(version) >= _release(d.removed_in)]
