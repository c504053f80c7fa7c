"""Starting training processes on this host: the one command builder behind the study runner, the
tools that launch runs and every test that starts processes.

One process: ``python -m aoe_megatron.train ...`` (the entry point sets up a world of one).
Several: ``python -m torch.distributed.run --standalone --nproc_per_node N -m aoe_megatron.train``.

NOTE: ``--standalone`` lets torchrun bind its rendezvous store on a free port itself and hand that
store to the workers (``TORCHELASTIC_USE_AGENT_STORE``): no port is chosen ahead of time, so two
launches at once cannot race for one (picking a free port, closing it and passing it on as
``--master_port`` can). Multi-node jobs go through ``run/slurm/pretrain.sbatch``, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

TRAIN = "aoe_megatron.train"
#: What a launcher sets for its workers; a child run must not inherit this process's.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
SUMMARY_VAR = "AOE_SUMMARY"
"""Where rank 0 writes the run's summary (losses by step, resume point) as JSON, if set."""


def command(args: Sequence, *, nproc: int = 1, module: str = TRAIN,
            python: str = sys.executable) -> list:
    """The command line that runs ``python -m module args`` in ``nproc`` processes here."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    entry = ["-m", module, *map(str, args)]
    if nproc == 1:
        return [python, *entry]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            *entry]


def child_env(extra: Optional[dict] = None, *, threads: Optional[int] = None) -> dict:
    """This environment without a launcher's rank variables (the child sets up its own world),
    plus ``extra``; ``threads`` sets OMP_NUM_THREADS (torch's intra-op threads per process)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def start(args: Sequence, *, nproc: int = 1, env: Optional[dict] = None, threads=None,
          cwd=None, stdout=subprocess.PIPE, module: str = TRAIN,
          python: str = sys.executable) -> subprocess.Popen:
    """Start the run without waiting; its stderr goes where its stdout does (``stdout``: PIPE or
    an open file). ``python``: another environment's interpreter (the other CI leg's)."""
    return subprocess.Popen(command(args, nproc=nproc, module=module, python=python),
                            env=child_env(env, threads=threads), cwd=cwd, stdout=stdout,
                            stderr=subprocess.STDOUT, text=True)


@dataclass(frozen=True)
class Finished:
    returncode: int
    output: str
    """stdout and stderr, interleaved as written."""
    summary_path: Optional[Path] = None

    def summary(self) -> dict:
        """Rank 0's summary, losses keyed by int step (raises if the run wrote none)."""
        if self.summary_path is None or not self.summary_path.is_file():
            raise FileNotFoundError(f"the run wrote no summary; its output ends:\n"
                                    f"{self.output[-4000:]}")
        data = json.loads(self.summary_path.read_text())
        for key in ("losses", "valid_losses"):
            if key in data:
                data[key] = {int(k): v for k, v in data[key].items()}
        return data


def run(args: Sequence, *, nproc: int = 1, env: Optional[dict] = None, threads=None, cwd=None,
        timeout: float = 600, summary: Optional[Path] = None, module: str = TRAIN,
        python: str = sys.executable) -> Finished:
    """Run to the end (killed after ``timeout`` seconds); ``summary``: where rank 0 writes its
    summary (see ``Finished.summary``)."""
    extra = dict(env or {})
    if summary is not None:
        extra[SUMMARY_VAR] = str(summary)
    proc = start(args, nproc=nproc, env=extra, threads=threads, cwd=cwd, module=module,
                 python=python)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        output += f"\n[launch] killed after {timeout} s"
    return Finished(proc.returncode, output, None if summary is None else Path(summary))
