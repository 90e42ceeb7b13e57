"""Copy-engine transfers from device to pinned host memory: no SM does any of the work.

The CUDA runtime is reached through ``cuda-bindings`` (``cuda.bindings.runtime``), or
``cupy`` where that is missing; both are on the GPU machine's image, neither is a
dependency of the CPU build, so they are imported on first use. Pointers and stream
handles are plain integers (``tensor.data_ptr()``, ``torch.cuda.Stream.cuda_stream``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost


class DmaUnavailableError(RuntimeError):
    """Neither cuda-bindings nor cupy can be imported in this process."""


@functools.cache
def _backend() -> tuple[str, Any]:
    for name in ("cuda.bindings.runtime", "cupy.cuda.runtime"):
        try:
            return name, importlib.import_module(name)
        except ImportError:
            continue
    raise DmaUnavailableError("copy-engine snapshots need cuda-bindings or cupy")


def _check(rt: Any, result: tuple[Any, ...], what: str) -> None:
    err = result[0]
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {err!r} ({rt.cudaGetErrorString(err)[1]!r})")


def copy_2d_to_host(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> bool:
    """``height`` rows of ``width`` bytes, rows ``src_pitch`` apart on the device, ``dst_pitch`` on the host.

    Returns False when the driver refused the pitched copy as an invalid value and the
    rows went one copy each instead (still by the copy engines).
    """
    name, rt = _backend()
    if name != "cuda.bindings.runtime":  # cupy raises on errors itself
        rt.memcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, _DEVICE_TO_HOST, stream)
        return True
    d2h = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    result = rt.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, d2h, stream)
    if result[0] != rt.cudaError_t.cudaErrorInvalidValue or height == 1:
        _check(rt, result, "cudaMemcpy2DAsync")
        return True
    for row in range(height):
        _check(
            rt, rt.cudaMemcpyAsync(dst + row * dst_pitch, src + row * src_pitch, width, d2h, stream), "cudaMemcpyAsync"
        )
    return False


def copy_batch_to_host(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int) -> None:
    """Many independent copies in one call (``cudaMemcpyBatchAsync``, CUDA 12.8+; cuda-bindings only)."""
    name, rt = _backend()
    if name != "cuda.bindings.runtime":
        raise DmaUnavailableError("batched copies need cuda-bindings")
    attrs = rt.cudaMemcpyAttributes()
    attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    attrs.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    _check(
        rt,
        rt.cudaMemcpyBatchAsync(list(dsts), list(srcs), list(sizes), len(sizes), [attrs], [0], 1, stream),
        "cudaMemcpyBatchAsync",
    )
