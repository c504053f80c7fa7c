"""The paper's evaluation protocol (AoE, arXiv 2501.13074, Table 2), defined in this one place.

Ten tasks of the LM Evaluation Harness, scored by accuracy (lm-eval's ``acc``): five zero-shot
commonsense tasks and five three-shot GLUE tasks. The number of shots is part of the protocol and
cannot be overridden. Task names are lm-eval's own (SIQA is ``social_iqa`` there).
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOL_NAME = "aoe-table2"
PROTOCOL_DESCRIPTION = (
    "AoE (arXiv 2501.13074) Table 2: ARC-E, PIQA, SIQA, WINO, HELLA zero-shot; "
    "MNLI, QNLI, SST2, MRPC, QQP three-shot; accuracy (lm-eval 'acc')"
)
METRIC = "acc"


@dataclass(frozen=True)
class PaperTask:
    name: str  # lm-eval task name
    column: str  # Table 2 column header
    num_fewshot: int


PAPER_TASKS: tuple[PaperTask, ...] = (
    PaperTask("arc_easy", "ARC-E", 0),
    PaperTask("piqa", "PIQA", 0),
    PaperTask("social_iqa", "SIQA", 0),
    PaperTask("winogrande", "WINO", 0),
    PaperTask("hellaswag", "HELLA", 0),
    PaperTask("mnli", "MNLI", 3),
    PaperTask("qnli", "QNLI", 3),
    PaperTask("sst2", "SST2", 3),
    PaperTask("mrpc", "MRPC", 3),
    PaperTask("qqp", "QQP", 3),
)
_BY_NAME = {t.name: t for t in PAPER_TASKS}
# Other spellings accepted on the command line.
ALIASES = {"siqa": "social_iqa", "arc_e": "arc_easy", "wino": "winogrande", "hella": "hellaswag"}


class ProtocolError(ValueError):
    """A request outside the paper's protocol (unknown task, ...)."""


def resolve_tasks(names: list[str] | tuple[str, ...] | None) -> list[PaperTask]:
    """The paper tasks for ``names`` (None: all ten), deduplicated, in Table 2 order."""
    if not names:
        return list(PAPER_TASKS)
    wanted = set()
    for raw in names:
        key = ALIASES.get(raw.lower(), raw.lower())
        if key not in _BY_NAME:
            raise ProtocolError(
                f"unknown task {raw!r}; the protocol's tasks are: "
                + ", ".join(t.name for t in PAPER_TASKS) + " (aliases: " + ", ".join(ALIASES) + ")"
            )
        wanted.add(key)
    return [t for t in PAPER_TASKS if t.name in wanted]


def paper_task(name: str) -> PaperTask:
    return resolve_tasks([name])[0]
