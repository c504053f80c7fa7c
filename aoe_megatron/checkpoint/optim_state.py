"""Optimizer state that survives a change of world size, expert-parallel size or ZeRO stage.

DeepSpeed ZeRO keeps each parameter's fp32 master weight and Adam moments as fragments of flat
per-rank partitions, whose boundaries depend on the world size. We read and write them per
parameter through DeepSpeed's tensor-fragment API (``safe_get_full_*`` / ``safe_set_full_*``:
the machinery under its universal checkpoints), and store them with megatron-core's distributed
checkpointing as sharded tensors that share the sharding of the model weight they belong to
(``make_sharded_optimizer_tensor``). Experts are then slices of global ``[E, ...]`` tensors, so a
checkpoint written at EP = e loads at any EP = e' (each rank reads the experts it now owns),
exactly as the model weights do.

Each rank writes and reads the full state of a share of the parameters only (``owners``): the
state of one parameter is gathered over the ranks that partition it, kept by its owner and
dropped by the others; on load the owner reads it and broadcasts it to them, one parameter at a
time. A rank's host memory for the optimizer state is then its share plus one parameter, not the
whole model's fp32 state (48 GB for the 4B model).

Not ``ds_to_universal.py``: it merges expert weights by name and gives every rank rank 0's
experts at EP > 1 (DeepSpeed 0.19's ``checkpoint/ds_to_universal.py`` keys fragments by parameter
name, and local expert names repeat on every EP rank). Not megatron-core's DistributedOptimizer: the
trainer's optimizer is DeepSpeed ZeRO.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from aoe_megatron.runtime.distributed import broadcast_from

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
    """ZeRO-1/2 (``DeepSpeedZeroOptimizer``), ZeRO-3, and ``BF16_Optimizer`` (what DeepSpeed runs
    for ZeRO-1 with bf16 weights and fp32 gradient accumulation): all three keep fp32 master
    partitions linked to the parameters by DeepSpeed's tensor-fragment mapping."""
    opt = engine.optimizer
    if not (hasattr(opt, "single_partition_of_fp32_groups") or _zero3(engine)
            or hasattr(opt, "fp32_groups_flat_partition")):
        raise NotImplementedError(
            f"checkpoints support DeepSpeed's ZeRO and BF16 optimizers, not {type(opt).__name__}")
    if not isinstance(opt.optimizer, torch.optim.AdamW):
        raise NotImplementedError(f"checkpoints hold AdamW state, not {type(opt.optimizer).__name__}")


def prepare_state(engine) -> None:
    """Check the engine and give every partition its AdamW state (before a load)."""
    _check_engine(engine)
    _adam_state_ready(engine)


def adam_step(engine) -> int:
    """AdamW's step count (updates applied: DeepSpeed skips non-finite ones)."""
    states = [s for s in engine.optimizer.optimizer.state.values() if "step" in s]
    return int(states[0]["step"]) if states else 0


def _partition_group(param):
    """The process group over which DeepSpeed partitions ``param``'s optimizer state (and over
    which its full-state getters reduce): the data-parallel group, or the expert-data-parallel
    group for an expert weight."""
    group = getattr(param, "ds_process_group", None) if hasattr(param, "ds_id") else \
        getattr(param, "_dp_group", None)
    if group is None:
        raise RuntimeError("a parameter is not linked to a DeepSpeed optimizer partition")
    return group


def _numel(param) -> int:
    return getattr(param, "ds_numel", None) or param.numel()  # ZeRO-3: the whole parameter's


def _full_shape(param) -> torch.Size:
    return getattr(param, "ds_shape", None) or param.shape


def owners(model) -> dict:
    """Parameter name -> the global rank that saves and loads its optimizer state.

    Each parameter goes to the least-loaded rank (by elements) of the group that partitions it,
    largest parameters first; dense parameters (partitioned over every data-parallel rank) are
    placed before expert ones, so that the ranks of one expert-data-parallel group, which know
    only their own experts, still agree on every placement they share.
    """
    import torch.distributed as dist

    params = [(name, p, dist.get_process_group_ranks(_partition_group(p)))
              for name, p in model.named_parameters()]
    world = dist.get_world_size()
    order = sorted(params, key=lambda item: (len(item[2]) != world, -_numel(item[1]), item[0]))
    load, out = {}, {}
    for name, param, ranks in order:
        owner = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[owner] = load.get(owner, 0) + _numel(param)
        out[name] = owner
    return out


def sharded_optimizer_state(model, engine, *, empty: bool = False) -> dict:
    """This rank's share of the optimizer state (``owners``), as sharded tensors keyed
    ``optimizer.<fp32|exp_avg|exp_avg_sq>.<key>`` with the sharding of the model weights.

    Collective (every rank, same order); under ZeRO-3, call it inside ``gathered``. With
    ``empty``, uninitialised tensors to load this rank's share into. Each parameter's full state
    is gathered over its partition group; only its owner keeps it (on the CPU).
    """
    from dataclasses import replace

    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    _check_engine(engine)
    if not empty:
        _adam_state_ready(engine)
    shards, owner, me = param_shards(model), owners(model), dist.get_rank()
    out = {}
    for name, param in model.named_parameters():
        for key in STATE_KEYS:
            if empty:
                value = (torch.empty(_full_shape(param), dtype=torch.float32)
                         if owner[name] == me else None)
            elif key == "fp32":
                value = safe_get_full_fp32_param(param)
            else:
                value = safe_get_full_optimizer_state(param, key)
            if owner[name] != me:
                continue  # gathered for the owner's sake (a collective); not kept
            tensor = make_sharded_optimizer_tensor(shards[name], value.cpu(),
                                                   prefix=f"optimizer.{key}")
            # the one copy of this slice in the checkpoint, whatever rank holds it
            out[f"{key}/{name}"] = replace(tensor, replica_id=0)
    return out


def restore_optimizer_state(model, engine, loaded: dict, *, step: int) -> None:
    """Write this rank's loaded share (``sharded_optimizer_state(empty=True)`` filled by
    ``dist_checkpointing.load``; consumed as it goes) into the ZeRO partitions of every rank: each
    parameter's state is broadcast by its owner over its partition group. Collective.
    ``weights_from_masters`` then sets the model weights."""
    import torch.distributed as dist
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    _check_engine(engine)
    _adam_state_ready(engine)
    owner, me = owners(model), dist.get_rank()
    for name, param in model.named_parameters():
        group = _partition_group(param)
        for key in STATE_KEYS:
            mine = loaded.pop(f"{key}/{name}") if owner[name] == me else None
            full = broadcast_from(mine, src=owner[name], shape=_full_shape(param),
                                  dtype=torch.float32, group=group).to(param.device)
            del mine
            if key == "fp32":
                safe_set_full_fp32_param(param, full)
            else:
                safe_set_full_optimizer_state(param, full, key)
            del full
    for state in engine.optimizer.optimizer.state.values():
        state["step"].fill_(step)


def restore_schedule(scheduler, last_epoch: int) -> None:
    """Put a LambdaLR at ``last_epoch`` and set the optimizer's learning rates from it (the
    number of parameter groups may differ between layouts; the schedule does not)."""
    scheduler.last_epoch = last_epoch - 1
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def schedule_in_force(scheduler):
    """The schedule a LambdaLR runs on, where its factor records itself (``record()``: the
    trainer's ``train.schedule.Schedule``), else None (a plain function)."""
    factors = getattr(scheduler, "lr_lambdas", None) or [None]
    return factors[0] if callable(getattr(factors[0], "record", None)) else None


def use_schedule(scheduler, schedule) -> None:
    """Put ``schedule`` (a ``train.schedule.Schedule``) in force in a LambdaLR at its position: its
    factor in every parameter group and its peak as every group's base rate (``initial_lr``, the
    scheduler's ``base_lrs``), so that each step's rate is ``schedule.lr_at(step)``."""
    groups = scheduler.optimizer.param_groups
    for group in groups:
        group["initial_lr"] = schedule.lr
    scheduler.base_lrs = [schedule.lr] * len(groups)
    scheduler.lr_lambdas = [schedule] * len(groups)
    restore_schedule(scheduler, scheduler.last_epoch)


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
