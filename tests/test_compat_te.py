"""TransformerEngine is chosen only when it imports and runs (issue #20, item 2): a broken install
that ``find_spec`` still finds, kernels that do not load, or a megatron-core that did not see TE
leave the specs on the local path, with a one-line reason logged once. TE is not installed here:
each case is a fake ``transformer_engine`` (a finder whose import raises, or stand-in modules).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import types

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs

from aoe_megatron.runtime import compat
from aoe_megatron.models import spec as spec_mod


class _BrokenTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An installed TE whose import fails as a broken install does (a CUDA library missing)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformer_engine":
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError("libcudnn.so.9: cannot open shared object file: No such file or directory")


@pytest.fixture
def fresh_probe(monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    cache_clear = getattr(compat, "transformer_engine_status", None)
    if cache_clear is not None:
        cache_clear.cache_clear()
    yield
    if cache_clear is not None:
        cache_clear.cache_clear()


def test_broken_te_install_is_not_chosen(fresh_probe, monkeypatch, caplog):
    """find_spec sees TE; it fails to import on a CUDA machine: the specs stay local, saying why once."""
    monkeypatch.setattr(sys, "meta_path", [_BrokenTE(), *sys.meta_path])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert compat.have_transformer_engine()  # installed ...
    with caplog.at_level(logging.WARNING, logger="aoe_megatron.runtime.compat"):
        assert spec_mod.use_transformer_engine() is False  # ... but not used
        assert spec_mod.use_transformer_engine() is False
    usable, why = compat.transformer_engine_status()
    assert not usable and "\n" not in why
    assert "import transformer_engine.pytorch failed (OSError: libcudnn.so.9" in why
    assert [r.getMessage() for r in caplog.records] == [f"TransformerEngine not used: {why}"]


def test_without_cuda_te_is_not_imported(fresh_probe, monkeypatch):
    """The CPU path stays cheap: no CUDA, no TE import (a broken one would raise here)."""
    monkeypatch.setattr(sys, "meta_path", [_BrokenTE(), *sys.meta_path])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compat.transformer_engine_status() == (False, "no CUDA device")
    assert "transformer_engine" not in sys.modules


class _RMSNorm(torch.nn.RMSNorm):
    def __init__(self, hidden_size, device=None):
        super().__init__(hidden_size, device=device)


class _RMSNormWithoutKernels(_RMSNorm):
    def forward(self, x):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\n"
                           "CUDA kernel errors might be asynchronously reported")


@pytest.mark.parametrize("norm, megatron_saw_te, grouped, reason", [
    (_RMSNorm, True, object, None),
    (_RMSNormWithoutKernels, True, object, "a TransformerEngine RMSNorm on cpu failed (RuntimeError: "
     "CUDA error: no kernel image is available for execution on the device)"),
    (_RMSNorm, False, object, "megatron-core could not import TransformerEngine when it loaded its TE spec"),
    (_RMSNorm, True, None, "this TransformerEngine has no GroupedLinear (megatron-core needs TE >= 1.9 "
     "for grouped experts)"),
], ids=["works", "kernels_fail", "megatron_core_without_it", "te_too_old"])
def test_probe_runs_one_te_op(norm, megatron_saw_te, grouped, reason, fresh_probe, monkeypatch):
    """An importable TE counts only if megatron-core's TE spec saw it (with the GroupedLinear the
    baseline's experts need) and one TE op runs."""
    from megatron.core.extensions import transformer_engine as mcore_te

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.RMSNorm = norm
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    for module in (gpt_layer_specs, mcore_te):
        monkeypatch.setattr(module, "HAVE_TE", megatron_saw_te)
    monkeypatch.setattr(mcore_te, "TEColumnParallelGroupedLinear", grouped)  # None before TE 1.9
    assert compat.probe_transformer_engine("cpu") == reason
