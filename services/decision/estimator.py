"""Memory estimate of serving a Llama-shaped model: weights, KV cache, workspace.

Pure arithmetic over `services.decision.domain.kv_model`, standard library
only (it also runs on the GPU machine for the validation in scripts/gpu).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from services.decision.domain.kv_model import (
    DEFAULT_CUDA_CONTEXT_BYTES,
    DEFAULT_FIXED_WORKSPACE_BYTES,
    DEFAULT_NCCL_BUFFSIZE,
    DEFAULT_NCCL_CHANNELS,
    ModelShape,
    collective_buffer_bytes,
    dtype_bytes,
)


@dataclass(frozen=True, slots=True)
class EstimateRequest:
    shape: ModelShape
    batch: int
    seq_len: int
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    tp: int = 1
    # Tokens one forward step processes at most (vLLM's max_num_batched_tokens);
    # None means the whole batch × seq_len prefill in one step.
    max_batched_tokens: int | None = None
    nccl_buffsize: int = DEFAULT_NCCL_BUFFSIZE
    nccl_channels: int = DEFAULT_NCCL_CHANNELS
    fixed_workspace_bytes: int = DEFAULT_FIXED_WORKSPACE_BYTES
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES

    def __post_init__(self) -> None:
        if self.batch <= 0 or self.seq_len <= 0:
            raise ValueError("batch and seq_len must be positive")
        if self.tp <= 0:
            raise ValueError("tp must be positive")
        if self.max_batched_tokens is not None and self.max_batched_tokens <= 0:
            raise ValueError("max_batched_tokens must be positive")
        dtype_bytes(self.dtype)
        if self.kv_dtype is not None:
            dtype_bytes(self.kv_dtype)

    @property
    def chunk_tokens(self) -> int:
        whole = self.batch * self.seq_len
        return whole if self.max_batched_tokens is None else min(whole, self.max_batched_tokens)


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes per tensor-parallel rank."""

    model: str
    tp: int
    params: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_layer: int
    kv_bytes: int
    activation_bytes: int
    fixed_workspace_bytes: int
    collective_buffer_bytes: int
    cuda_context_bytes: int

    @property
    def workspace_bytes(self) -> int:
        return self.activation_bytes + self.fixed_workspace_bytes

    @property
    def allocator_bytes(self) -> int:
        """What the PyTorch caching allocator holds at the peak (torch.cuda.max_memory_allocated)."""
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes

    @property
    def device_bytes(self) -> int:
        """What NVML sees for the process: the allocator plus NCCL buffers and the CUDA context."""
        return self.allocator_bytes + self.collective_buffer_bytes + self.cuda_context_bytes

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            workspace_bytes=self.workspace_bytes, allocator_bytes=self.allocator_bytes, device_bytes=self.device_bytes
        )
        return data


@dataclass(frozen=True, slots=True)
class Fit:
    gpu_bytes: int
    utilization: float
    budget_bytes: int
    kv_budget_bytes: int
    max_tokens: int
    max_batch_at_seq_len: int
    max_seq_len_at_batch: int
    fits: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(request: EstimateRequest) -> MemoryBreakdown:
    shape = request.shape
    weight_bytes = dtype_bytes(request.dtype)
    kv_bytes = dtype_bytes(request.kv_dtype or request.dtype)
    tokens = request.batch * request.seq_len
    per_token = shape.kv_bytes_per_token(kv_bytes, request.tp)
    return MemoryBreakdown(
        model=shape.name,
        tp=request.tp,
        params=shape.total_params(),
        weights_bytes=shape.weight_bytes_per_rank(weight_bytes, request.tp),
        kv_bytes_per_token=per_token,
        kv_bytes_per_layer=tokens * shape.kv_bytes_per_token_per_layer(kv_bytes, request.tp),
        kv_bytes=tokens * per_token,
        activation_bytes=shape.activation_bytes(request.chunk_tokens, request.batch, weight_bytes, request.tp),
        fixed_workspace_bytes=request.fixed_workspace_bytes,
        collective_buffer_bytes=collective_buffer_bytes(request.tp, request.nccl_buffsize, request.nccl_channels),
        cuda_context_bytes=request.cuda_context_bytes,
    )


def fit(request: EstimateRequest, gpu_bytes: int, utilization: float) -> Fit:
    """The largest batch × length whose KV fits `gpu_bytes × utilization` beside the rest.

    The budget is what vLLM's gpu_memory_utilization means: a share of the
    whole device, CUDA context and NCCL buffers included.
    """
    if gpu_bytes <= 0:
        raise ValueError("gpu_bytes must be positive")
    if not 0.0 < utilization <= 1.0:
        raise ValueError("utilization must be in (0, 1]")
    breakdown = estimate(request)
    budget = int(gpu_bytes * utilization)
    fixed = (
        breakdown.weights_bytes
        + breakdown.workspace_bytes
        + breakdown.collective_buffer_bytes
        + breakdown.cuda_context_bytes
    )
    kv_budget = max(0, budget - fixed)
    max_tokens = kv_budget // breakdown.kv_bytes_per_token
    return Fit(
        gpu_bytes=gpu_bytes,
        utilization=utilization,
        budget_bytes=budget,
        kv_budget_bytes=kv_budget,
        max_tokens=max_tokens,
        max_batch_at_seq_len=max_tokens // request.seq_len,
        max_seq_len_at_batch=max_tokens // request.batch,
        fits=breakdown.device_bytes <= budget,
    )
