"""Patch for ``megatron/core/dist_checkpointing/strategies/filesystem_async.py`` (0.16.1, 0.19.2),
every machine.

What: the files that ``FileSystemWriterAsync.write_preloaded_data`` opens for writing (the data
files ``__<rank>_<i>.distcp``, which it opens through the module's name ``open``) are
``runtime.hashing.HashingWriter`` objects: each byte is hashed as it is written, and a digest
record (size, sha256, mtime) is left beside the file when it closes. Nothing else changes: the
same bytes reach the same file, through the same buffered file object.
Why: a checkpoint's manifest needs the sha256 of every file, and reading back the data files
(about 10 GB at 732M parameters, 56 GB at 4B) doubled the I/O of the save that must fit in the
stop window after Slurm's SIGTERM. The writers are forked processes in 0.16.1 and threads in
0.19.2, so the digest travels through a file, which ``checkpoint.integrity.hash_files`` takes in
place of a re-read and removes. Without the patch (or with ``use_msc``, which opens its files
elsewhere) there are no records and the manifest hashes the files as before.
"""

from __future__ import annotations

import builtins

from ._patching import module, replace
from aoe_megatron.runtime.hashing import open_recorded

TARGET = "megatron.core.dist_checkpointing.strategies.filesystem_async"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _open(file, mode="r", *args, **kwargs):
    """``open`` as the module sees it: a new binary file written whole is hashed as it goes."""
    if mode in ("wb", "bw") and not args and not kwargs:
        return open_recorded(file, mode)
    return builtins.open(file, mode, *args, **kwargs)


def apply() -> bool:
    fs_async = module(TARGET)
    if vars(fs_async).get("open") is _open:
        return True
    if "open" in vars(fs_async):
        raise RuntimeError(f"{TARGET} defines its own 'open': review "
                           f"aoe_megatron/patches/mcore_dist_ckpt_write_digests.py against it")
    replace(fs_async, "open", _open)
    return True
