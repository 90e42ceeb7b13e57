"""Kernel tests run the Triton kernels in Triton's interpreter on the CPU, except on the
H200 where scripts/gpu/kernels.sh sets SITS_KERNELS_GPU=1 and runs the ``gpu`` tests.

Triton reads TRITON_INTERPRET when it is first imported, so it is set here, at import
time, before any test module of this folder imports ``kernels``.
"""

import os

if os.environ.get("SITS_KERNELS_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
