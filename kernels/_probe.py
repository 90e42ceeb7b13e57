# mypy: disable-error-code="untyped-decorator"
"""A kernel that is never launched: its type says how ``triton.jit`` decorated this process's kernels."""

import triton


@triton.jit
def probe_kernel() -> None:
    pass
