"""The training console: Python ``logging`` with a timestamp and the rank on every line, as
Megatron-LM and torchtitan users expect; what a run says at its start (the resolved arguments, the
parameter counts, the layout) and on each logging step.

A line reads ``[2025-01-31 12:00:00][rank 0] step      10/100  loss ...``: the message follows a
fixed prefix (``PREFIX``), and ``message(line)`` returns it, for the readers of a run's output
(the study runner, tools). The training loop's messages go through the ``aoe_megatron`` logger;
``set_up`` also gives the root logger the same format, so that megatron-core's and torch's
warnings carry a time and a rank too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

from aoe_megatron.runtime.upstream_noise import quiet_repeated_upstream_lines

LOGGER = logging.getLogger("aoe_megatron.train")
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
FORMAT = "[%(asctime)s][rank %(rank)s] %(message)s"
PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]\[rank \d+\] ")
"""What ``FORMAT`` puts before each message."""


def message(line: str) -> str:
    """The message of a console line (its prefix removed; a line without one as it is)."""
    return PREFIX.sub("", line, count=1)


def say(text: str) -> None:
    """One console line (rank 0 calls it for the run's own lines; any rank may)."""
    _our_handler()
    LOGGER.info(text)


class _Stdout(logging.StreamHandler):
    """A handler on whatever ``sys.stdout`` is when a record is emitted (a test's capture
    replaces it after the handler exists)."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ sets it; the property reads it live
        pass


class _Rank(logging.Filter):
    """Adds ``record.rank``: the launcher's RANK at the time of the record (0 without one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


def _handler() -> logging.Handler:
    handler = _Stdout()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt=DATE_FORMAT))
    handler.addFilter(_Rank())
    return handler


def _our_handler() -> None:
    """The ``aoe_megatron`` logger at INFO with the format above, on stdout (idempotent)."""
    ours = logging.getLogger("aoe_megatron")
    if not any(isinstance(h, _Stdout) for h in ours.handlers):
        ours.addHandler(_handler())
        ours.setLevel(logging.INFO)
        ours.propagate = False


def set_up() -> None:
    """The console of a training process (idempotent): our logger (``_our_handler``); the root
    logger the same format (WARNING and up from other libraries) unless the embedding program
    has given it handlers; upstream's repeated lines at most once (``runtime/upstream_noise``)."""
    _our_handler()
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_handler())
    quiet_repeated_upstream_lines()


# --- what a run says at its start -----------------------------------------------------------

def _flatten(record: dict, prefix: str = "") -> list:
    """[("train.lr", 0.0002), ...]: a run record's leaves, lists and tuples as JSON."""
    rows = []
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows.extend(_flatten(value, name + "."))
        else:
            rows.append((name, json.dumps(value, default=str)
                         if isinstance(value, (list, tuple, dict)) else value))
    return rows


def arguments_lines(record: dict) -> list:
    """The resolved arguments (``Run.record()``: config.json), one per line, as Megatron-LM
    prints its own: ``  train.lr ........................ 0.0002``."""
    rows = _flatten(record)
    width = max(len(name) for name, _ in rows) + 4
    return (["------------------------ arguments ------------------------"]
            + [f"  {name} {'.' * (width - len(name))} {value}" for name, value in rows]
            + ["-------------------- end of arguments ---------------------"])


def count(n: int) -> str:
    """1234567 -> '1.23M' (parameters)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def parameters_line(*, total: int, active: int, local: int) -> str:
    """Total and active parameters of the model (``models/params.count_parameters``) and those
    this rank holds (its experts only, under expert parallelism)."""
    return (f"parameters: {count(total)} total ({total:,}), {count(active)} active per token "
            f"({active:,}); this rank holds {count(local)} ({local:,})")


def layout_line(*, world: int, ep: int, zero: int, micro: int, grad_accum: int, global_batch: int,
                seq_length: int, device: str, dtype: str) -> str:
    """How the run is laid out: processes, parallelism, batch, device and precision."""
    dp = world  # tensor and pipeline parallel sizes are 1
    return (f"layout: {world} process(es) = data-parallel {dp} (experts: expert-parallel {ep} x "
            f"expert-data-parallel {world // ep}), ZeRO-{zero}; global batch {global_batch} = "
            f"micro-batch {micro} x {grad_accum} accumulation step(s) x data-parallel {dp}, "
            f"{seq_length} tokens per sequence ({global_batch * seq_length:,} tokens per step); "
            f"{device}, {dtype}")


# --- a logging step ---------------------------------------------------------------------------

def step_line(*, step: int, total: int, loss: float, lr: float, grad_norm, ms_per_step: float,
              tokens_per_s: float, tokens: int, skipped: int, memory: str, eta_s: float) -> str:
    """``step N/M  loss ...``: the figures of a logging step (``metrics.Reporter``)."""
    norm = "n/a" if grad_norm is None else f"{grad_norm:.4f}"
    return (f"step {step:>7}/{total}  loss {loss:.4f}  lr {lr:.3e}  grad norm {norm}  "
            f"{ms_per_step:,.1f} ms/step  {tokens_per_s:,.0f} tokens/s  {tokens:,} tokens  "
            f"skipped {skipped}  memory {memory}  ETA {eta_s / 60:.1f} min")
