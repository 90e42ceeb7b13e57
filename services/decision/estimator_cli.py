"""`sits estimate`: memory breakdown of serving a model, and the largest batch × length that fits.

    .venv/bin/python -m services.decision.estimator_cli llama-3-8b --batch 32 --seq-len 4096 \
        --gpu-memory-gib 141 --utilization 0.9
    .venv/bin/python -m services.decision.estimator_cli path/to/config.json --tp 2 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.decision.domain.kv_model import KNOWN_MODELS, ModelShape, known_model, shape_from_hf_config
from services.decision.estimator import EstimateRequest, MemoryBreakdown, estimate, fit

GIB = 1024**3
H200_BYTES = 143771 * 1024 * 1024


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"a config.json path or a known model: {', '.join(sorted(KNOWN_MODELS))}")
    parser.add_argument("--batch", type=int, default=1, help="sequences at once (default 1)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence, prompt + output")
    parser.add_argument("--dtype", default="bfloat16", help="weight and activation dtype (default bfloat16)")
    parser.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="tokens per forward step (vLLM max_num_batched_tokens); default: whole prefill",
    )
    parser.add_argument(
        "--gpu-memory-gib", type=float, default=H200_BYTES / GIB, help="device memory in GiB (default: an H200, 140.4)"
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.9,
        help="share of the device the engine may use (vLLM gpu_memory_utilization, default 0.9)",
    )
    parser.add_argument("--nccl-buffsize", type=int, default=None, help="NCCL_BUFFSIZE in bytes (default 4 MiB)")
    parser.add_argument("--nccl-channels", type=int, default=None, help="NCCL channels (default 16)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def load_shape(model: str) -> ModelShape:
    path = Path(model)
    if path.suffix == ".json" or path.is_file() or path.is_dir():
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object")
        return shape_from_hf_config(config, name=path.parent.name or path.name)
    return known_model(model)


def _request(args: argparse.Namespace) -> EstimateRequest:
    extra: dict[str, int] = {}
    if args.nccl_buffsize is not None:
        extra["nccl_buffsize"] = args.nccl_buffsize
    if args.nccl_channels is not None:
        extra["nccl_channels"] = args.nccl_channels
    return EstimateRequest(
        shape=load_shape(args.model),
        batch=args.batch,
        seq_len=args.seq_len,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        tp=args.tp,
        max_batched_tokens=args.max_batched_tokens,
        **extra,
    )


def _table(breakdown: MemoryBreakdown, request: EstimateRequest, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    fits = fit(request, int(args.gpu_memory_gib * GIB), args.utilization)
    table = Table(
        title=f"{breakdown.model}: batch {request.batch} × {request.seq_len} tokens, {request.dtype}, "
        f"TP {request.tp} (per rank)"
    )
    table.add_column("part")
    table.add_column("GiB", justify="right")
    table.add_column("note")
    rows = [
        ("weights", breakdown.weights_bytes, f"{breakdown.params / 1e9:.2f} B parameters"),
        (
            "KV cache per layer",
            breakdown.kv_bytes_per_layer,
            f"{breakdown.kv_bytes_per_token} B per token (all layers)",
        ),
        (
            "KV cache total",
            breakdown.kv_bytes,
            f"{request.shape.num_layers} layers, {request.shape.kv_heads_per_rank(request.tp)} KV heads per rank",
        ),
        ("activations", breakdown.activation_bytes, f"{request.chunk_tokens} tokens per forward step"),
        ("fixed workspace", breakdown.fixed_workspace_bytes, "cuBLAS and similar"),
        ("PyTorch allocator total", breakdown.allocator_bytes, "≈ torch.cuda.max_memory_allocated"),
        ("NCCL buffers", breakdown.collective_buffer_bytes, "estimate: BUFFSIZE × channels × peers × 2"),
        ("CUDA context", breakdown.cuda_context_bytes, "outside the allocator"),
        ("device total", breakdown.device_bytes, "≈ NVML process memory"),
    ]
    for name, value, note in rows:
        table.add_row(name, f"{value / GIB:.2f}", note)
    console = Console()
    console.print(table)
    verdict = "fits" if fits.fits else "does NOT fit"
    console.print(
        f"{args.gpu_memory_gib:.1f} GiB × {args.utilization:.2f}: this batch {verdict}; "
        f"KV room for {fits.max_tokens} tokens: batch {fits.max_batch_at_seq_len} at {request.seq_len} "
        f"tokens, or {fits.max_seq_len_at_batch} tokens at batch {request.batch}."
    )


def run(args: argparse.Namespace) -> int:
    try:
        request = _request(args)
        breakdown = estimate(request)
        fits = fit(request, int(args.gpu_memory_gib * GIB), args.utilization)
    except ValueError as exc:
        print(f"sits estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"breakdown": breakdown.as_dict(), "fit": fits.as_dict()}, indent=2))
    else:
        _table(breakdown, request, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sits estimate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
