"""``aoe-train`` (and ``python -m aoe_megatron.train``, torchrun's form): ``--help`` and
``--version`` are answered from the flag schema (``train/flags.py``) before torch loads; anything
else is the training loop's ``main`` (``train/loop.py``: the run's settings, lock, run directory
and signals around the loop)."""

from __future__ import annotations

import sys

from aoe_megatron.runtime.exit import exit_now
from aoe_megatron.train.flags import parser
from aoe_megatron.train.threads import prefer_passive_wait

#: Arguments answered without training (argparse prints and exits).
ANSWERED = ("-h", "--help", "--version")


def main(argv=None) -> int:
    """``aoe-train``: 0 finished or stopped after saving, 2 bad settings, 3 halted, 4 folder
    held, 128 + N ended by signal N (``train.loop.main``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ANSWERED for arg in argv):
        parser().parse_args(argv)  # prints the help or the versions and exits (a bad flag: 2)

    prefer_passive_wait()  # before torch loads: OpenMP reads it once (train/threads.py)
    from aoe_megatron.train.loop import (  # deferred: torch loads after OMP_WAIT_POLICY
        main as train)

    return train(argv)


if __name__ == "__main__":
    exit_now(main())
