"""The launcher's environment: rank and world size from torchrun, the deepspeed launcher, a bare
``srun`` or none (one process)."""

from __future__ import annotations

import os


def adopt_slurm_env() -> None:
    """Launched by ``srun`` directly (one task per GPU): take RANK / WORLD_SIZE / LOCAL_RANK from
    Slurm's variables. torchrun and the deepspeed launcher set them themselves."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def adopt_single_process_env() -> None:
    """A bare ``python -m aoe_megatron.train`` (no launcher set RANK and WORLD_SIZE): one process,
    rank 0, a free rendezvous port on this host. Launched runs are left as they are."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    from aoe_megatron.runtime.distributed import free_port  # deferred: torch loads after --help

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def world_size_from_env() -> int:
    """The processes of this run, as the launcher says (torchrun, deepspeed: WORLD_SIZE; a bare
    ``srun``: SLURM_NTASKS); reads the environment only (``adopt_slurm_env`` writes it)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        return int(os.environ.get("SLURM_NTASKS", "1"))
    return 1
