"""Run the paper's protocol with the LM Evaluation Harness on a Hugging Face model folder, offline.

Outputs, in the output directory:
  results.json         per-task metrics, example counts, shots, settings, data file hashes
  results.md           a Table-2-style row (accuracy in percent, AVG over the tasks run)
  samples/<task>.jsonl one line per example: task, doc_id, correct (0/1), pred, target
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aoe_megatron.evaluation.data import (
    MissingDataError,
    builtin_config,
    cached_task_manager,
    local_config,
    missing_data_message,
    required_files,
    split_plan,
)
from aoe_megatron.evaluation.protocol import (
    METRIC,
    PAPER_TASKS,
    PROTOCOL_DESCRIPTION,
    PROTOCOL_NAME,
    PaperTask,
    resolve_tasks,
)

log = logging.getLogger(__name__)

DEFAULT_SEED = 1234
OUTPUT_FILES = ("results.json", "results.md")
SAMPLES_DIR = "samples"


class EvaluationError(RuntimeError):
    """A run that cannot start (bad model folder, output directory, options)."""


@dataclass
class EvalConfig:
    model: Path
    data_dir: Path
    output: Path
    tasks: tuple[str, ...] | None = None  # None: the paper's ten
    device: str | None = None  # None: cuda if available, else cpu
    batch_size: int = 50  # as in the paper
    dtype: str = "float32"
    limit: int | None = None  # first N examples per task (smoke runs)
    seed: int = DEFAULT_SEED
    overwrite: bool = False
    # Only bootstrapped metrics (f1 of MRPC/QQP) use it; acc has a closed-form stderr.
    bootstrap_iters: int = 1000
    datasets_cache: Path | None = None  # Arrow cache of the json builder (None: HF default)
    trust_remote_code: bool = True


@dataclass
class EvalRun:
    summary: dict[str, Any]  # what results.json holds
    samples: dict[str, list[dict[str, Any]]]  # task -> per-example records (samples/<task>.jsonl)
    raw: dict[str, Any] = field(repr=False)  # lm_eval.simple_evaluate's return value


def force_offline() -> None:
    """No Hub access: must run before huggingface_hub / datasets / lm_eval are imported."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"


def check_model_dir(model: Path) -> None:
    if not model.is_dir():
        raise EvaluationError(f"model folder {model} does not exist (a Hugging Face model "
                              "directory with config.json, weights and tokenizer is expected)")
    if not (model / "config.json").is_file():
        raise EvaluationError(f"{model} has no config.json: not a Hugging Face model folder")


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless ``overwrite``."""
    if output.exists() and not output.is_dir():
        raise EvaluationError(f"--output {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise EvaluationError(f"--output {output} exists and is not empty (use --overwrite)")


def prepare_output(output: Path, overwrite: bool) -> None:
    """Create ``output``; with ``overwrite``, remove an earlier run's files (only those)."""
    check_output(output, overwrite)
    for name in OUTPUT_FILES:
        (output / name).unlink(missing_ok=True)
    if (output / SAMPLES_DIR).is_dir():
        for f in (output / SAMPLES_DIR).glob("*.jsonl"):
            f.unlink()
    output.mkdir(parents=True, exist_ok=True)


def run_evaluation(cfg: EvalConfig) -> EvalRun:
    """Evaluate ``cfg.model`` on the protocol's tasks and write the outputs to ``cfg.output``."""
    tasks = resolve_tasks(cfg.tasks)
    if cfg.limit is not None and cfg.limit < 1:
        raise EvaluationError("--limit must be a positive number of examples")
    model = Path(cfg.model).resolve()
    check_model_dir(model)
    check_output(Path(cfg.output), cfg.overwrite)
    if not Path(cfg.data_dir).is_dir():
        raise MissingDataError(missing_data_message([Path(cfg.data_dir)], [t.name for t in tasks],
                                                    Path(cfg.data_dir)))
    force_offline()
    import lm_eval

    task_manager = cached_task_manager()
    builtin = {t.name: builtin_config(t.name, task_manager) for t in tasks}
    missing = [p for t in tasks for p in required_files(builtin[t.name], t, cfg.data_dir).values()
               if not p.is_file()]
    if missing:
        raise MissingDataError(missing_data_message(missing, [t.name for t in tasks], cfg.data_dir))
    prepare_output(Path(cfg.output), cfg.overwrite)

    configs = [local_config(builtin[t.name], t, cfg.data_dir, cfg.datasets_cache) for t in tasks]
    task_objs = task_manager.load(configs)["tasks"]  # reads the data now, before the model
    device = cfg.device or _default_device()
    model_args = {"pretrained": str(model), "dtype": cfg.dtype,
                  "trust_remote_code": cfg.trust_remote_code}
    raw = lm_eval.simple_evaluate(
        model="hf", model_args=model_args, tasks=[task_objs[t.name] for t in tasks],
        batch_size=cfg.batch_size, device=device, limit=cfg.limit, log_samples=True,
        bootstrap_iters=cfg.bootstrap_iters, task_manager=task_manager,
        random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed,
    )
    if raw is None:  # not rank 0
        raise EvaluationError("lm_eval returned no results (not rank 0?)")

    samples = {t.name: per_example(task_objs[t.name], raw["samples"][t.name]) for t in tasks}
    summary = summarize(raw, tasks, builtin, cfg, model, device, samples)
    write_outputs(Path(cfg.output), summary, samples)
    return EvalRun(summary=summary, samples=samples, raw=raw)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _gold_index(task: Any, doc: dict[str, Any], target: Any) -> int:
    """Index of the correct choice, as lm-eval scores multiple-choice tasks."""
    if task.multiple_input:  # e.g. winogrande: one context per choice, the answer is an index
        return int(task.doc_to_text(doc))
    if isinstance(target, int):
        return target
    return list(task.doc_to_choice(doc)).index(target)


def per_example(task: Any, logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """lm-eval's logged samples -> {task, doc_id, correct, pred, target}, by doc_id."""
    out = []
    for s in sorted(logged, key=lambda s: s["doc_id"]):
        lls = [float(r[0]) for r in s["filtered_resps"]]
        out.append({
            "task": task.task_name,
            "doc_id": int(s["doc_id"]),
            "correct": int(s[METRIC] == 1.0),
            "pred": max(range(len(lls)), key=lls.__getitem__),  # first maximum, as np.argmax
            "target": _gold_index(task, s["doc"], s["target"]),
        })
    return out


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _first_prompt(logged: list[dict[str, Any]]) -> str | None:
    first = min(logged, key=lambda s: s["doc_id"], default=None)
    return None if first is None else first["arguments"][0][0]


def summarize(raw: dict[str, Any], tasks: list[PaperTask], builtin: dict[str, dict[str, Any]],
              cfg: EvalConfig, model: Path, device: str,
              samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    per_task = {}
    for t in tasks:
        res = raw["results"][t.name]
        metrics = {}
        for key, value in res.items():  # "acc,none", "acc_stderr,none", "f1,none", ...
            name, _, filt = key.partition(",")
            if filt == "none":
                metrics[name] = _number(value)
        plan = split_plan(builtin[t.name], t.num_fewshot)
        n_shot = raw["n-shot"][t.name]
        if n_shot != t.num_fewshot:
            raise EvaluationError(f"{t.name} ran {n_shot}-shot, the protocol says {t.num_fewshot}")
        per_task[t.name] = {
            "column": t.column,
            "num_fewshot": n_shot,
            "metric": METRIC,
            METRIC: metrics[METRIC],
            f"{METRIC}_stderr": metrics.get(f"{METRIC}_stderr"),
            "n": len(samples[t.name]),
            "n_total": raw["n-samples"][t.name]["original"],
            "eval_split": plan.eval_split,
            "fewshot_split": plan.fewshot_split,
            "metrics": metrics,
            "data_files": {split: {"path": str(p.resolve()), "sha256": _sha256(p)}
                           for split, p in required_files(builtin[t.name], t, cfg.data_dir).items()},
            "hub_dataset": {"path": builtin[t.name].get("dataset_path"),
                            "name": builtin[t.name].get("dataset_name")},
            "version": raw["versions"].get(t.name),
            "example_prompt": _first_prompt(raw["samples"][t.name]),
        }
    accs = [per_task[t.name][METRIC] for t in tasks]
    import lm_eval

    settings = asdict(cfg)
    settings.update(device=device, model=str(model))
    return {
        "protocol": {
            "name": PROTOCOL_NAME,
            "description": PROTOCOL_DESCRIPTION,
            "metric": METRIC,
            "num_fewshot": {t.name: t.num_fewshot for t in PAPER_TASKS},
            "complete": [t.name for t in tasks] == [t.name for t in PAPER_TASKS] and cfg.limit is None,
        },
        "model": str(model),
        "lm_eval_version": lm_eval.__version__,
        "transformers_version": raw.get("transformers_version"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.items()},
        "tasks": per_task,
        "average": {METRIC: sum(accs) / len(accs), "tasks": [t.name for t in tasks]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def markdown_table(summary: dict[str, Any]) -> str:
    """Table 2 layout: one column per task run (paper order), then AVG; accuracy in percent."""
    tasks = summary["tasks"]
    order = [t for t in PAPER_TASKS if t.name in tasks]
    header = ["Model", *(t.column for t in order), "AVG"]
    row = [Path(summary["model"]).name,
           *(f"{100 * tasks[t.name][METRIC]:.2f}" for t in order),
           f"{100 * summary['average'][METRIC]:.2f}"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
             "| " + " | ".join(row) + " |", ""]
    shots = ", ".join(f"{t.column} {tasks[t.name]['num_fewshot']}-shot" for t in order)
    lines.append(f"Accuracy (lm-eval `{METRIC}`, %); {shots}; "
                 f"lm-eval {summary['lm_eval_version']}; model {summary['model']}.")
    limit = summary["settings"].get("limit")
    if limit is not None:
        lines.append(f"\n**Smoke run: first {limit} examples per task only; not comparable to the paper.**")
    return "\n".join(lines) + "\n"


def write_outputs(output: Path, summary: dict[str, Any],
                  samples: dict[str, list[dict[str, Any]]]) -> None:
    (output / SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
    for task, records in samples.items():
        with open(output / SAMPLES_DIR / f"{task}.jsonl", "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    (output / "results.md").write_text(markdown_table(summary), encoding="utf-8")
    # Last: its presence marks a finished run.
    (output / "results.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n",
                                         encoding="utf-8")
