"""Patch for ``megatron/core/dist_checkpointing/strategies/state_dict_saver.py`` (0.16.1, 0.19.2), CPU only.

What: ``save_state_dict_async_finalize`` broadcasts its failure flag from a CPU tensor.
Why: upstream creates the flag with ``device=torch.cuda.current_device()``, so every
``dist_checkpointing.save`` fails at its last step without CUDA. ``strategies/torch.py`` imports
the function by name, so that binding is replaced too. The rest is upstream's logic.
"""

from __future__ import annotations

from ._patching import cuda_absent, module, replace_bound

TARGET = "megatron.core.dist_checkpointing.strategies.state_dict_saver"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _save_state_dict_async_finalize(storage_writer, global_metadata, dist_wrapper) -> None:
    import torch

    saver = module(TARGET)
    write_results = storage_writer.retrieve_write_results()
    all_results = dist_wrapper.gather_object(write_results)
    node_failures = {}
    if dist_wrapper.is_coordinator:
        node_failures = saver._get_failure_dict(all_results)
        if not node_failures:
            assert global_metadata is not None
            storage_writer.finish(global_metadata, all_results)
    failed = torch.tensor([int(len(node_failures) > 0)], dtype=torch.int)
    torch.distributed.broadcast(failed, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group)
    if failed:
        raise saver.CheckpointException("write", node_failures)


def apply() -> bool:
    if not cuda_absent():
        return False
    replace_bound("save_state_dict_async_finalize", _save_state_dict_async_finalize,
                  TARGET, "megatron.core.dist_checkpointing.strategies.torch")
    return True
