"""The demo's and benches' engine shape: the same KV in tokens on vLLM's CPU and CUDA builds."""

from pathlib import Path

from sits_app.demo.paths import CPU_BLOCK_TOKENS, CUDA_BLOCK_TOKENS, EngineShape


def _blocks_override(shape: EngineShape) -> int:
    args = shape.server(Path("/nonexistent-model"), Path("/tmp/sits-shape-test.log"), sits=False).extra_args
    return int(args[args.index("--num-gpu-blocks-override") + 1])


def test_a_cpu_engine_gets_the_blocks_named() -> None:
    assert _blocks_override(EngineShape(kv_blocks=64)) == 64


def test_a_gpu_engine_gets_as_many_tokens_of_kv_in_its_smaller_blocks() -> None:
    gpu = _blocks_override(EngineShape(kv_blocks=64, gpu_memory_utilization=0.15))
    assert gpu * CUDA_BLOCK_TOKENS == 64 * CPU_BLOCK_TOKENS == 8192
