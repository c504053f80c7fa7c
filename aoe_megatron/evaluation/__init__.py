"""The paper's downstream evaluation (Table 2) with the LM Evaluation Harness, offline, and the
McNemar test the authors use to compare two models' per-example outcomes."""

from aoe_megatron.evaluation.mcnemar import McNemarResult, compare_runs, mcnemar
from aoe_megatron.evaluation.protocol import PAPER_TASKS, PaperTask, ProtocolError, resolve_tasks

__all__ = ["PAPER_TASKS", "McNemarResult", "PaperTask", "ProtocolError", "compare_runs",
           "mcnemar", "resolve_tasks"]
