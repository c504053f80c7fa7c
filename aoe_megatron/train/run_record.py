"""What rank 0 records and says about a run at its start: ``config.json`` (the resolved
arguments), ``run.json`` (command, versions, host, threads, data) and the console's first lines
(the arguments, the parameter counts, the layout: ``train/console.py``)."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch

import aoe_megatron
from aoe_megatron.models.params import count_parameters
from aoe_megatron.train import console


#: What metrics.jsonl's per-layer figures cover (``moe/selection_stats.py``).
SELECTION_STATS = "every training micro-batch since the previous logging step"


def record_run(run, run_dir: Path) -> None:
    """Write ``config.json`` and ``run.json`` of ``run`` (a ``train.run.Run``) into ``run_dir``."""
    import deepspeed
    import megatron.core

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(run.record(), indent=2, default=str) + "\n")
    record = {
        "command": [sys.executable, *sys.argv],
        "world_size": run.world_size,
        "versions": {"aoe_megatron": aoe_megatron.__version__, "torch": torch.__version__,
                     "megatron_core": megatron.core.__version__, "deepspeed": deepspeed.__version__,
                     "python": platform.python_version()},
        "host": platform.node(),
        "threads": {"torch": torch.get_num_threads(),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
        # metrics.jsonl's "layers": what they cover (a run.json without this key: the last
        # micro-batch before the logging step's read)
        "selection_stats": SELECTION_STATS,
    }
    if run.cfg.mock_data:
        record["data"] = "mock: random tokens (--mock-data), not a corpus"
    if run.manifest is not None:
        record["data_tokenizer_sha256"] = run.manifest["tokenizer"]["sha256"]
        record["data_policy"] = run.manifest["policy"]
    (run_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")


def start_lines(parts) -> list:
    """What rank 0 says before the first step (``parts``: ``train.setup.Parts``): the resolved
    arguments, the parameters (``models/params.count_parameters``; this rank's from its model),
    the layout."""
    run, cfg = parts.run, parts.run.cfg
    counts = count_parameters(run.model)
    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu"
    return [*console.arguments_lines(run.record()),
            console.parameters_line(total=counts.total, active=counts.active,
                                    local=sum(p.numel() for p in parts.model.parameters())),
            console.layout_line(world=run.world_size, ep=cfg.expert_model_parallel_size,
                                zero=cfg.zero_stage, micro=cfg.micro_batch_size,
                                grad_accum=run.grad_accum, global_batch=cfg.global_batch_size,
                                seq_length=run.model.seq_length, device=device,
                                dtype="bf16" if cfg.bf16() else "fp32")]
