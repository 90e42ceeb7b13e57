"""How the ``@triton.jit`` kernels of this package run: compiled on a GPU, interpreted on a CPU.

Triton reads ``TRITON_INTERPRET`` when a function is decorated, its own library
(``tl.sum``, ``tl.max``, ...) included, so the variable must be set before ``triton`` is
first imported in the process; ``tests/kernels/conftest.py`` does that for the CPU tests.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from kernels._probe import probe_kernel


def interpreting() -> bool:
    """Whether ``triton.jit`` hands out interpreted functions in this process."""
    return is_interpreted(probe_kernel)


def is_interpreted(kernel: object) -> bool:
    return isinstance(kernel, InterpretedFunction)


def normalize_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device), so that devices compare equal to tensors'."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(device: torch.device) -> None:
    """Fail with a readable reason when tensors sit where the kernels cannot run."""
    if interpreting():
        if device.type != "cpu":
            raise ValueError(
                f"Triton runs interpreted here (TRITON_INTERPRET=1): tensors must be on the CPU, not {device}"
            )
    elif device.type != "cuda":
        raise ValueError(
            f"tensors on {device}: the kernels need a CUDA device, or TRITON_INTERPRET=1 set "
            "before triton is first imported to run them on the CPU"
        )
