"""Upstream's lines that a training run would print again and again, each said at most once per
process (megatron-core's dataset notes), or not at all where they are about choices made inside
megatron-core, DeepSpeed and torch rather than the user's (their FutureWarnings on a resume and
under torchrun, torch 2.11's UserWarnings on megatron-core 0.19.2's resume). Matched by logger
and message, or by category and message: nothing else is filtered.
"""

from __future__ import annotations

import logging
import re
import warnings

#: logger -> its messages (regular expressions, matched at the start) said once per process.
#: megatron-core's dataset builder says the first for the train and the valid split alike (a
#: one-dataset blend is how our data configs are built); the others for each index it cannot
#: cache (where there is no cache folder to write to).
SAY_ONCE = {
    "megatron.core.datasets.blended_dataset": (
        r"Building a BlendedDataset for a single MegatronDataset$",
        r"Cannot save the \w+ indexes because path_to_cache is None$"),
    "megatron.core.datasets.gpt_dataset": (
        r"Unable to save \w+ indexes because path_to_cache is None$",),
}

#: FutureWarnings raised inside the engines on every resume or multi-process run, each about an
#: API that megatron-core or DeepSpeed call, not one a user of aoe-megatron calls: DeepSpeed's
#: ZeRO all-gather (torch 2.13), megatron-core's checkpoint load (torch.distributed.checkpoint's
#: ``load_state_dict``) and its ShardedTensor checkpoints.
FUTURE_WARNINGS = (
    r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
    r"`load_state_dict` is deprecated and will be removed in future versions",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)
#: The same for UserWarnings that torch 2.11 raises on megatron-core 0.19.2's resume: it reads a
#: checkpoint's metadata with ``no_dist=True`` on purpose, passing the reader positionally.
USER_WARNINGS = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    r"load in a single process",
    r"The argument order of load has been changed",
)


class SayOnce(logging.Filter):
    """Lets a record whose message matches one of ``patterns`` through the first time only."""

    def __init__(self, patterns):
        super().__init__()
        self.patterns, self.said = tuple(re.compile(p) for p in patterns), set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        pattern = next((p for p in self.patterns if p.match(text)), None)
        if pattern is None:
            return True
        if pattern in self.said:
            return False
        self.said.add(pattern)
        return True


def quiet_repeated_upstream_lines() -> None:
    """Install the filters above (idempotent); a training process calls it before set-up."""
    for name, patterns in SAY_ONCE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, SayOnce) for f in logger.filters):
            logger.addFilter(SayOnce(patterns))
    for text in FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=text, category=FutureWarning)
    for text in USER_WARNINGS:
        warnings.filterwarnings("ignore", message=text, category=UserWarning)
