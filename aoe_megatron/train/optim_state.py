"""Optimizer state that survives a change of world size, expert-parallel size or ZeRO stage.

DeepSpeed ZeRO keeps each parameter's fp32 master weight and Adam moments as fragments of flat
per-rank partitions, whose boundaries depend on the world size. We read and write them per
parameter through DeepSpeed's tensor-fragment API (``safe_get_full_*`` / ``safe_set_full_*``:
the machinery under its universal checkpoints), and store them with megatron-core's distributed
checkpointing as sharded tensors that share the sharding of the model weight they belong to
(``make_sharded_optimizer_tensor``). Experts are then slices of global ``[E, ...]`` tensors, so a
checkpoint written at EP = e loads at any EP = e' (each rank reads the experts it now owns),
exactly as the model weights do.

Not ``ds_to_universal.py``: it merges expert weights by name and gives every rank rank 0's
experts at EP > 1 (``../shared/ENGINE-NOTES.md``). Not megatron-core's DistributedOptimizer: the
trainer's optimizer is DeepSpeed ZeRO.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
"""Per parameter: the fp32 master weight and AdamW's two moments."""


def param_shards(model) -> dict:
    """Parameter name -> the ShardedTensor (or factory) of the model's sharded state dict that
    holds it (matched by identity, as megatron-core's own optimizer checkpointing does)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model.sharded_state_dict())
    by_id = {id(t.data): t for t in nested_values(tensors)}
    shards = {}
    for name, param in model.named_parameters():
        if id(param) not in by_id:
            raise RuntimeError(f"parameter {name} has no sharded tensor in the model's "
                               f"sharded_state_dict(): its optimizer state cannot be checkpointed")
        shards[name] = by_id[id(param)]
    return shards


def _zero3(engine) -> bool:
    return hasattr(engine.optimizer, "fp32_partitioned_groups_flat")


def gathered(engine, model):
    """Under ZeRO-3, a context in which every parameter is whole on every rank (what the model's
    sharded state dict needs); otherwise a no-op. Transient: the whole model on each rank."""
    if not _zero3(engine):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def _adam_state_ready(engine) -> None:
    """Give every flat partition its AdamW state (torch creates it lazily at the first step, with
    zero moments and step 0, which is what is created here), so that DeepSpeed's per-parameter
    accessors can read or write it before any step."""
    opt = engine.optimizer
    base = opt.optimizer
    if _zero3(engine):  # its groups hold the flat partitions only around a step
        flats = list(opt.fp32_partitioned_groups_flat)
    else:
        flats = [flat for group in base.param_groups for flat in group["params"]]
    for flat in flats:
        if not base.state.get(flat):
            base.state[flat] = {"step": torch.tensor(0.0),
                                "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format)}
    if not _zero3(engine):
        # ZeRO-1/2 link the fragments once, after the first parameter group's first step, when
        # the other groups have no state yet: link again now that every group has it.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def weights_from_masters(engine) -> None:
    """The model's (low-precision) weights from the fp32 master partitions."""
    opt = engine.optimizer
    if _zero3(engine):
        for group in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(group)
    else:
        opt.update_lp_params()


def _check_engine(engine) -> None:
    opt = engine.optimizer
    if not (hasattr(opt, "single_partition_of_fp32_groups") or _zero3(engine)):
        raise NotImplementedError(
            f"checkpoints support DeepSpeed ZeRO optimizers, not {type(opt).__name__}")
    if not isinstance(opt.optimizer, torch.optim.AdamW):
        raise NotImplementedError(f"checkpoints hold AdamW state, not {type(opt.optimizer).__name__}")


def adam_step(engine) -> int:
    """AdamW's step count (updates applied: DeepSpeed skips non-finite ones)."""
    states = [s for s in engine.optimizer.optimizer.state.values() if "step" in s]
    return int(states[0]["step"]) if states else 0


def sharded_optimizer_state(model, engine, *, empty: bool = False) -> dict:
    """The optimizer state as sharded tensors keyed ``optimizer.<fp32|exp_avg|exp_avg_sq>.<key>``.

    Collective (every rank, same order); under ZeRO-3, call it inside ``gathered``. With
    ``empty``, uninitialised tensors to load into. Each parameter's full state is gathered over
    its data-parallel group (a transient fp32 copy per state, kept on the CPU).
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    _check_engine(engine)
    if not empty:
        _adam_state_ready(engine)
    shards = param_shards(model)
    out = {}
    for name, param in model.named_parameters():
        for key in STATE_KEYS:
            if empty:
                value = torch.empty(param.shape, dtype=torch.float32)
            elif key == "fp32":
                value = safe_get_full_fp32_param(param).cpu()
            else:
                value = safe_get_full_optimizer_state(param, key).cpu()
            out[f"{key}/{name}"] = make_sharded_optimizer_tensor(shards[name], value,
                                                                 prefix=f"optimizer.{key}")
    return out


def restore_optimizer_state(model, engine, loaded: dict, *, step: int) -> None:
    """Write loaded per-parameter state (``sharded_optimizer_state(empty=True)`` filled by
    ``dist_checkpointing.load``) into this run's ZeRO partitions; ``weights_from_masters`` then
    sets the model weights."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    _check_engine(engine)
    _adam_state_ready(engine)
    for name, param in model.named_parameters():
        device = param.device
        safe_set_full_fp32_param(param, loaded[f"fp32/{name}"].to(device))
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(param, loaded[f"{key}/{name}"].to(device), key)
    for state in engine.optimizer.optimizer.state.values():
        state["step"].fill_(step)


def restore_schedule(scheduler, last_epoch: int) -> None:
    """Put a LambdaLR at ``last_epoch`` and set the optimizer's learning rates from it (the
    number of parameter groups may differ between layouts; the schedule does not)."""
    scheduler.last_epoch = last_epoch - 1
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def rng_state() -> dict:
    """This rank's random generators: torch's CPU (and CUDA) state and megatron-core's tracker."""
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def reseed(seed: int, step: int, rank: int) -> None:
    """New streams for a resume at another world size (per-rank streams cannot be mapped)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    derived = (seed * 1_000_003 + step * 7919 + rank) % (2**31)
    torch.manual_seed(derived)
    model_parallel_cuda_manual_seed(derived)
