"""Weights & Biases, optional (``pip install 'aoe-megatron[wandb]'``): with ``--wandb-project``,
rank 0 sends the resolved arguments as the W&B run's config and every scalar it writes to
TensorBoard as history, keyed by step. ``--wandb-exp-name`` names the W&B run (Megatron-LM's
flags). Each launch is a W&B run of its own (a resumed run's steps continue its numbering); its
files go to ``WANDB_DIR``, else the run directory. ``WANDB_MODE=offline`` keeps them local.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

EXTRA = "aoe-megatron[wandb]"


def check(cfg) -> None:
    """Refuse W&B settings that cannot work, before any process group starts (ValueError)."""
    if cfg.wandb_exp_name and not cfg.wandb_project:
        raise ValueError("--wandb-exp-name names a W&B run of --wandb-project: give the project "
                         "too")
    if cfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"--wandb-project needs Weights & Biases, which is not installed: "
                         f"pip install '{EXTRA}' (or pip install wandb)")


class WandbSink:
    """One W&B run: ``scalar`` collects a step's values, ``flush`` sends them as one history
    row. None of it on ranks other than 0 (``open`` returns None there)."""

    def __init__(self, run):
        self.run, self.pending, self.step = run, {}, None

    @classmethod
    def open(cls, cfg, *, record: dict, run_dir, enabled: bool) -> Optional["WandbSink"]:
        if not (enabled and cfg.wandb_project):
            return None
        import os

        import wandb

        run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name or None,
                         dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                         config=record)
        return cls(run)

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.step is not None and step != self.step:
            self.flush()
        self.step = step
        self.pending[name] = value

    def flush(self) -> None:
        if self.pending:
            self.run.log(self.pending, step=self.step)
        self.pending = {}

    def close(self) -> None:
        self.flush()
        self.run.finish()
