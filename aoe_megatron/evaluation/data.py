"""Task data for offline evaluation: lm-eval's own task definitions, local JSONL data.

Each task keeps lm-eval's configuration (prompts, choices, targets, process_docs, metrics, few-shot
settings); only the data source changes, from the Hugging Face Hub to ``DIR/<task>/<split>.jsonl``
read by the ``json`` dataset builder. Which splits a task needs follows lm-eval's own rules: it is
evaluated on ``test_split`` if set, else ``validation_split``; few-shot examples come from
``fewshot_split``, else ``training_split``, else ``validation_split`` (few-shot tasks only).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aoe_megatron.evaluation.protocol import PaperTask, ProtocolError

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

log = logging.getLogger(__name__)

_SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


class MissingDataError(FileNotFoundError):
    """Task data files absent from the local data directory."""


@dataclass(frozen=True)
class SplitPlan:
    """The splits one task needs: the one it is scored on, and the few-shot pool (if shots > 0)."""

    eval_split: str
    fewshot_split: str | None

    @property
    def needed(self) -> tuple[str, ...]:
        extra = (self.fewshot_split,) if self.fewshot_split not in (None, self.eval_split) else ()
        return (self.eval_split, *extra)


@functools.cache
def cached_task_manager() -> TaskManager:
    """lm-eval's index of its built-in tasks (takes seconds to build; one per process)."""
    from lm_eval.tasks import TaskManager

    log.info("indexing lm-eval's task configurations")
    return TaskManager()


def builtin_config(name: str, task_manager: TaskManager) -> dict[str, Any]:
    """lm-eval's configuration of task ``name`` (its YAML, ``!function`` entries resolved)."""
    from lm_eval.tasks._yaml_loader import load_yaml  # the loader TaskManager itself uses

    entry = task_manager.task_index.get(name)
    if entry is None or entry.yaml_path is None:
        raise ProtocolError(f"lm-eval has no YAML task named {name!r}")
    cfg = load_yaml(entry.yaml_path, resolve_func=True)
    for key in ("tag", "group", "task_list"):  # index structure, not task configuration
        cfg.pop(key, None)
    return cfg


def split_plan(cfg: dict[str, Any], num_fewshot: int) -> SplitPlan:
    name = cfg.get("task")
    eval_split = cfg.get("test_split") or cfg.get("validation_split")
    if not eval_split:
        raise ProtocolError(f"task {name!r} has neither a test nor a validation split")
    fewshot = None
    if num_fewshot > 0:
        fs_cfg = cfg.get("fewshot_config") or {}
        fewshot = fs_cfg.get("split") or cfg.get("fewshot_split")
        if fewshot is None and fs_cfg.get("samples") is None:
            fewshot = (cfg.get("training_split") or cfg.get("validation_split")
                       or cfg.get("test_split"))
        if fewshot is None and fs_cfg.get("samples") is None:
            raise ProtocolError(f"task {name!r} has no split to draw few-shot examples from")
    return SplitPlan(eval_split, fewshot)


def data_file(data_dir: Path, task: str, split: str) -> Path:
    return Path(data_dir) / task / f"{split}.jsonl"


def required_files(cfg: dict[str, Any], task: PaperTask, data_dir: Path) -> dict[str, Path]:
    """split -> the JSONL file it is read from."""
    plan = split_plan(cfg, task.num_fewshot)
    return {split: data_file(data_dir, task.name, split) for split in plan.needed}


def local_config(
    cfg: dict[str, Any],
    task: PaperTask,
    data_dir: Path,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """``cfg`` reading the task's JSONL files from ``data_dir``, with the protocol's shot count.

    Split fields the run does not need are cleared, so that e.g. a zero-shot task does not require
    its training split. Raises :class:`MissingDataError` naming every absent file.
    """
    files = required_files(cfg, task, data_dir)
    missing = [p for p in files.values() if not p.is_file()]
    if missing:
        raise MissingDataError(missing_data_message(missing, [task.name], data_dir))
    new = dict(cfg)
    new.pop("dataset_name", None)
    new["dataset_path"] = "json"
    kwargs: dict[str, Any] = {"data_files": {s: str(p.resolve()) for s, p in files.items()}}
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    new["dataset_kwargs"] = kwargs
    for key in _SPLIT_KEYS:
        if new.get(key) is not None and new[key] not in files:
            new[key] = None
    new["num_fewshot"] = task.num_fewshot
    new["metadata"] = {**(cfg.get("metadata") or {}), "data_source": "local-jsonl",
                       "hub_dataset": [cfg.get("dataset_path"), cfg.get("dataset_name")]}
    return new


def missing_data_message(missing: list[Path], tasks: list[str], data_dir: Path) -> str:
    lines = ["missing task data file(s):", *(f"  {p}" for p in missing)]
    lines.append(
        "Get them on a machine with network access with\n"
        f"  aoe-evaluate fetch-data --data-dir {data_dir} --tasks {' '.join(tasks)}\n"
        "and copy the directory here (layout: DIR/<task>/<split>.jsonl)."
    )
    return "\n".join(lines)


def fetch_data(
    data_dir: Path,
    tasks: list[PaperTask],
    overwrite: bool = False,
) -> list[Path]:
    """Download the splits each task needs from the Hub and write ``data_dir/<task>/<split>.jsonl``.

    Needs network access; existing files are kept unless ``overwrite``. Returns the files written.
    """
    import datasets

    task_manager = cached_task_manager()
    written = []
    for task in tasks:
        cfg = builtin_config(task.name, task_manager)
        kwargs = dict(cfg.get("dataset_kwargs") or {})
        kwargs.pop("trust_remote_code", None)  # datasets >= 4 runs no dataset scripts
        for split in split_plan(cfg, task.num_fewshot).needed:
            path = data_file(data_dir, task.name, split)
            if path.exists() and not overwrite:
                log.info("%s exists, kept", path)
                continue
            log.info("%s: %s %s split %r", task.name, cfg["dataset_path"], cfg.get("dataset_name"), split)
            ds = datasets.load_dataset(cfg["dataset_path"], cfg.get("dataset_name"), split=split,
                                       **kwargs)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
            with open(tmp, "w", encoding="utf-8") as f:
                for row in ds:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            os.replace(tmp, path)
            log.info("wrote %s (%d rows)", path, len(ds))
            written.append(path)
    return written
