"""Measurement probes: wall and CPU time, saved-for-backward bytes, peak memory, GEMM peak.

Peak memory on CPU: there is no allocator statistic, so the benchmark asks glibc to serve every
allocation of 64 KiB or more with its own mmap (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``): freed
tensors then leave the resident set at once and RSS tracks live tensors. A measurement resets
the kernel's high-water mark (``/proc/self/clear_refs`` "5"), reads VmRSS, runs, and reads VmHWM.
"""

from __future__ import annotations

import ctypes
import re
import statistics
import time
from typing import Callable, Iterable

import torch

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device | str) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``fn()``; CUDA work is synchronized around it."""
    synchronize(device)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    fn()
    synchronize(device)
    return time.perf_counter() - wall0, time.process_time() - cpu0


def summarize(values: list[float]) -> dict:
    """Median, min and max of repeated measurements, plus the raw values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "reps": list(values)}


def ratio(a: float, b: float) -> float | None:
    """a / b, or None where b is 0 (e.g. a peak below what the CPU probe resolves)."""
    return a / b if b else None


class SavedTensorBytes:
    """Bytes autograd saves for backward inside the ``with`` block, parameters excluded.

    Each saved tensor's storage counts once (views of one storage share it), keyed by the
    storage's address. NOTE: only tensors that go through autograd's saved-tensor mechanism
    (``save_for_backward`` and built-in ops) are seen; tensors an autograd Function keeps as
    plain ``ctx`` attributes are not.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self.storages: dict[int, int] = {}
        self.count = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.count += 1
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded:
            self.storages[key] = storage.nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def enable_cpu_peak_tracking() -> bool:
    """Make RSS track live tensors (glibc, Linux); False where that is not possible."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return ok
    except OSError:
        return False


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_memory(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes ``fn()`` adds above what was in use when it started.

    CUDA: the caching allocator's max_memory_allocated. CPU: VmHWM - VmRSS (see the module note;
    call ``enable_cpu_peak_tracking`` once first).
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _proc_status_bytes("VmRSS")
    fn()
    return _proc_status_bytes("VmHWM") - before


#: Dense (no 2:4 sparsity) bf16 Tensor Core peak, TFLOP/s, by the words of the device's name
#: (torch.cuda.get_device_name(), split at non-alphanumerics, any case), first match wins. NVIDIA's datasheets print the sparse figure (H100 SXM 1,979, H100 PCIe 1,513, H200
#: 1,979, A100 624) and say dense is half: H100/H200 as reproduced from the H100 datasheet by
#: archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html, A100 by
#: glennklockwood.com/garden/processors/A100 (citing the A100 datasheet). NVL boards (H100 NVL,
#: H200 NVL) are rated lower and are not listed: they get None.
DATASHEET_BF16_TFLOPS = ((("H100", "PCIe"), 756.0), (("H100", "NVL"), None), (("H100",), 989.0),
                         (("H200", "NVL"), None), (("H200",), 989.0), (("A100",), 312.0))


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> tuple[float | None, str]:
    """(FLOP/s, note): the GPU's datasheet dense peak for bf16 (fp16 is the same figure); None
    with the reason on the CPU, for another dtype or for a device not in the table."""
    if device_name == "cpu":
        return None, "the CPU: no datasheet figure (the measured matmul is the denominator)"
    if dtype not in (torch.bfloat16, torch.float16):
        return None, f"no datasheet figure used for {dtype} (bf16/fp16 only)"
    have = {w.upper() for w in re.split(r"[^A-Za-z0-9]+", device_name)}
    for words, tflops in DATASHEET_BF16_TFLOPS:
        if all(w.upper() in have for w in words):
            if tflops is None:
                break
            return tflops * 1e12, f"{device_name}: {tflops:g} TFLOP/s dense bf16 (datasheet)"
    return None, f"{device_name!r} is not in the datasheet table (bench/measure.py)"


def gemm_peak_flops(device: torch.device | str, dtype: torch.dtype, *, n: int = 2048,
                    reps: int = 3) -> float:
    """The best FLOP/s of an n x n x n matmul at this device and dtype (a measured MFU
    denominator; at n = 2048 an H200 reached 333 TFLOP/s in bf16, well below what 8192 gets)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best = min(timed(lambda: a @ b, device)[0] for _ in range(reps))
    return 2 * n ** 3 / best
