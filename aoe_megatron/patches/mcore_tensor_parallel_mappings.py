"""Patch for ``megatron/core/tensor_parallel/mappings.py`` (megatron-core 0.16.1, 0.19.2), CPU only.

What: the first-dimension gather and reduce-scatter (used by the allgather token dispatcher over
the TP x EP group, and by sequence parallelism) and the all-to-all (alltoall dispatcher, EP > 1)
allocate on the input's device and use collectives gloo has.
Why: upstream allocates with ``torch.cuda.current_device()`` and uses ``all_gather_into_tensor`` /
``reduce_scatter_tensor``; gloo has no reduce-scatter, gathers only equal-sized lists, and takes
all-to-all split sizes as Python lists, not tensors.
"""

from __future__ import annotations

from ._patching import cuda_absent, module, replace

TARGET = "megatron.core.tensor_parallel.mappings"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    import torch
    import torch.distributed as dist

    world_size = group.size()
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is None:
        parts = [torch.empty_like(input_) for _ in range(world_size)]
        dist.all_gather(parts, input_, group=group)
        return torch.cat(parts, dim=0)
    # NOTE: gloo gathers only equal sizes: pad every part to the largest, then trim.
    sizes = [int(s) for s in output_split_sizes]
    longest = max(sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)


def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    world_size = group.size()
    if world_size == 1:
        return input_
    import torch
    import torch.distributed as dist

    # NOTE: gloo has no reduce-scatter: all-reduce, then keep this rank's rows.
    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    rank = group.rank()
    if input_split_sizes is None:
        assert total.shape[0] % world_size == 0, "first dimension must divide by the group size"
        return total.chunk(world_size, dim=0)[rank].contiguous()
    return torch.split(total, [int(s) for s in input_split_sizes], dim=0)[rank].contiguous()


def _as_list(splits):
    return None if splits is None else [int(s) for s in splits]


def _all_to_all_forward(ctx, group, input, output_split_sizes, input_split_sizes,
                        use_nccl_stream=False):
    # NOTE: use_nccl_stream (0.19.2; upstream's backward reads it back) means nothing to gloo.
    import torch
    import torch.distributed as dist

    ctx.group = group
    ctx.use_nccl_stream = use_nccl_stream
    ctx.output_split_sizes = output_split_sizes
    ctx.input_split_sizes = input_split_sizes
    if group.size() == 1:
        return input
    input = input.contiguous()
    out_sizes, in_sizes = _as_list(output_split_sizes), _as_list(input_split_sizes)
    if out_sizes is None:
        output = torch.empty_like(input)
    else:
        output = input.new_empty((sum(out_sizes), *input.shape[1:]))
    dist.all_to_all_single(
        output, input, output_split_sizes=out_sizes, input_split_sizes=in_sizes, group=group
    )
    return output


def apply() -> bool:
    if not cuda_absent():
        return False
    mod = module(TARGET)
    replace(mod, "_gather_along_first_dim", _gather_along_first_dim)
    replace(mod, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)
    replace(mod._AllToAll, "forward", staticmethod(_all_to_all_forward))
    return True
