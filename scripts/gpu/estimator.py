"""Validate the memory estimator against a real PyTorch forward + greedy generate on the H200.

Builds Llama-shaped models with random bf16 weights directly on the GPU (no
downloads), preallocates a KV cache for batch × (prompt + new tokens), runs a
chunked prefill and a greedy decode with a hand-written Llama forward, and
compares torch.cuda.max_memory_allocated / max_memory_reserved and NVML's
process memory with `services.decision.estimator`.

Run on the GPU machine from the repository root:
    python3 -m scripts.gpu.estimator --out "$OUT/estimator_validation.json"
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.decision.domain.kv_model import KNOWN_MODELS, ModelShape
from services.decision.estimator import EstimateRequest, estimate

GIB = 1024**3


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    batch: int
    prompt_len: int
    new_tokens: int
    max_batched_tokens: int


CASES = [
    Case(KNOWN_MODELS["llama-3-8b"], batch=64, prompt_len=4032, new_tokens=64, max_batched_tokens=8064),
    Case(
        ModelShape("llama-30b-gqa", 60, 6656, 17920, 52, 4, 128, 32000),
        batch=16,
        prompt_len=4032,
        new_tokens=64,
        max_batched_tokens=8064,
    ),
    Case(KNOWN_MODELS["llama-2-7b"], batch=24, prompt_len=2016, new_tokens=32, max_batched_tokens=4032),
]


class Llama:
    def __init__(self, shape: ModelShape, device: torch.device) -> None:
        self.shape = shape
        dt = torch.bfloat16
        h, q_out, kv_out, inter = (
            shape.hidden_size,
            shape.num_attention_heads * shape.head_dim,
            shape.num_kv_heads * shape.head_dim,
            shape.intermediate_size,
        )

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, dtype=dt).mul_(0.02)

        self.embed = rand(shape.vocab_size, h)
        self.lm_head = self.embed if shape.tie_word_embeddings else rand(shape.vocab_size, h)
        self.final_norm = torch.ones(h, device=device, dtype=dt)
        self.layers = [
            {
                "ln1": torch.ones(h, device=device, dtype=dt),
                "ln2": torch.ones(h, device=device, dtype=dt),
                "wq": rand(q_out, h),
                "wk": rand(kv_out, h),
                "wv": rand(kv_out, h),
                "wo": rand(h, q_out),
                "wg": rand(inter, h),
                "wu": rand(inter, h),
                "wd": rand(h, inter),
            }
            for _ in range(shape.num_layers)
        ]


def rope_tables(head_dim: int, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv)
    return freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (b, heads, n, d); cos/sin: (n, d/2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


GQA_FLASH: dict[str, bool] = {}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if GQA_FLASH.get("ok", True):
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            GQA_FLASH["ok"] = True
            return out
        except RuntimeError:
            GQA_FLASH["ok"] = False
    # Fallback: expand kv heads a few rows at a time so the copy stays small.
    group = q.shape[1] // k.shape[1]
    outs = []
    for start in range(0, q.shape[0], 4):
        sl = slice(start, start + 4)
        kk = k[sl].repeat_interleave(group, dim=1)
        vv = v[sl].repeat_interleave(group, dim=1)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            outs.append(F.scaled_dot_product_attention(q[sl], kk, vv, is_causal=causal))
    return torch.cat(outs)


def forward(
    model: Llama,
    tokens: torch.Tensor,
    rows: slice,
    pos0: int,
    cache: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """One step over `tokens` (b, n) at positions pos0.. for batch rows `rows`; returns next tokens (b,)."""
    shape = model.shape
    b, n = tokens.shape
    heads, kv_heads, d = shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    x = F.embedding(tokens, model.embed)
    c, s = cos[pos0 : pos0 + n], sin[pos0 : pos0 + n]
    for index, layer in enumerate(model.layers):
        hn = F.rms_norm(x, (shape.hidden_size,), layer["ln1"], 1e-5)
        q = (hn @ layer["wq"].T).view(b, n, heads, d).transpose(1, 2)
        k = (hn @ layer["wk"].T).view(b, n, kv_heads, d).transpose(1, 2)
        v = (hn @ layer["wv"].T).view(b, n, kv_heads, d).transpose(1, 2)
        del hn
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        kv = cache[index]  # (2, batch, kv_heads, max_len, d)
        kv[0, rows, :, pos0 : pos0 + n] = k
        kv[1, rows, :, pos0 : pos0 + n] = v
        del k, v
        keys, values = kv[0, rows, :, : pos0 + n], kv[1, rows, :, : pos0 + n]
        att = attention(q, keys, values, causal=n > 1)
        del q
        x = x + att.transpose(1, 2).reshape(b, n, heads * d) @ layer["wo"].T
        del att
        hn = F.rms_norm(x, (shape.hidden_size,), layer["ln2"], 1e-5)
        act = F.silu(hn @ layer["wg"].T) * (hn @ layer["wu"].T)
        del hn
        x = x + act @ layer["wd"].T
        del act
    last = F.rms_norm(x[:, -1], (shape.hidden_size,), model.final_norm, 1e-5)
    logits = (last @ model.lm_head.T).float()
    return logits.argmax(dim=-1)


def nvml_process_bytes() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        return None


def run_case(case: Case, device: torch.device) -> dict[str, Any]:
    shape = case.shape
    max_len = case.prompt_len + case.new_tokens
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    started = time.perf_counter()
    model = Llama(shape, device)
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated() - base
    cache = [
        torch.empty(2, case.batch, shape.num_kv_heads, max_len, shape.head_dim, device=device, dtype=torch.bfloat16)
        for _ in range(shape.num_layers)
    ]
    kv = torch.cuda.memory_allocated() - base - weights
    cos, sin = rope_tables(shape.head_dim, max_len, device)
    prompts = torch.randint(0, shape.vocab_size, (case.batch, case.prompt_len), device=device)
    rows_per_chunk = max(1, case.max_batched_tokens // case.prompt_len)
    next_tokens = torch.empty(case.batch, dtype=torch.long, device=device)
    with torch.inference_mode():
        for start in range(0, case.batch, rows_per_chunk):
            rows = slice(start, min(case.batch, start + rows_per_chunk))
            next_tokens[rows] = forward(model, prompts[rows], rows, 0, cache, cos, sin)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - started
        generated = [next_tokens]
        for step in range(case.new_tokens - 1):
            tok = forward(model, generated[-1][:, None], slice(0, case.batch), case.prompt_len + step, cache, cos, sin)
            generated.append(tok)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    peak_allocated = torch.cuda.max_memory_allocated() - base
    peak_reserved = torch.cuda.max_memory_reserved()
    nvml = nvml_process_bytes()

    request = EstimateRequest(
        shape=shape,
        batch=case.batch,
        seq_len=max_len,
        dtype="bfloat16",
        tp=1,
        max_batched_tokens=rows_per_chunk * case.prompt_len,
    )
    breakdown = estimate(request)
    result = {
        "model": shape.name,
        "shape": {
            k: getattr(shape, k)
            for k in (
                "num_layers",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_kv_heads",
                "head_dim",
                "vocab_size",
            )
        },
        "batch": case.batch,
        "prompt_len": case.prompt_len,
        "new_tokens": case.new_tokens,
        "prefill_chunk_tokens": rows_per_chunk * case.prompt_len,
        "gqa_flash": GQA_FLASH.get("ok"),
        "measured": {
            "weights_bytes": weights,
            "kv_bytes": kv,
            "peak_allocated_bytes": peak_allocated,
            "peak_reserved_bytes": peak_reserved,
            "nvml_process_bytes": nvml,
            "transient_peak_bytes": peak_allocated - weights - kv,
        },
        "estimate": breakdown.as_dict(),
        "rel_error_allocated": (breakdown.allocator_bytes - peak_allocated) / peak_allocated,
        "rel_error_reserved": (breakdown.allocator_bytes - peak_reserved) / peak_reserved,
        "rel_error_nvml": None if nvml is None else (breakdown.device_bytes - nvml) / nvml,
        "rel_error_weights": (breakdown.weights_bytes - weights) / weights,
        "rel_error_kv": (breakdown.kv_bytes - kv) / kv,
        "prefill_s": round(prefill_s, 3),
        "total_s": round(elapsed, 3),
        "generated_finite": bool(torch.stack(generated).ge(0).all().item()),
    }
    del model, cache, generated, prompts, next_tokens
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "estimator_validation.json"))
    parser.add_argument("--cases", default="all", help="comma-separated model names, or 'all'")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.cuda.init()  # type: ignore[no-untyped-call]
    cases = CASES if args.cases == "all" else [c for c in CASES if c.shape.name in args.cases.split(",")]
    results = []
    for case in cases:
        res = run_case(case, device)
        results.append(res)
        nvml_err = None if res["rel_error_nvml"] is None else round(100 * res["rel_error_nvml"], 2)
        print(
            f"{res['model']:>16}  B={res['batch']:<3} T={res['prompt_len'] + res['new_tokens']:<5} "
            f"peak alloc {res['measured']['peak_allocated_bytes'] / GIB:7.2f} GiB  "
            f"estimate {res['estimate']['allocator_bytes'] / GIB:7.2f} GiB  "
            f"err {100 * res['rel_error_allocated']:+.2f}%  reserved err {100 * res['rel_error_reserved']:+.2f}%"
            f"  nvml err {nvml_err}"
            f"  {res['total_s']} s",
            flush=True,
        )
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cases": results,
        "max_rel_error_allocated": max(abs(r["rel_error_allocated"]) for r in results),
        "max_rel_error_reserved": max(abs(r["rel_error_reserved"]) for r in results),
    }
    with open(args.out, "w") as fh:
        json.dump(summary, fh, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}))
    return 0 if all(math.isfinite(r["rel_error_allocated"]) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
