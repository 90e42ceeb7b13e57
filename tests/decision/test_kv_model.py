import json
from pathlib import Path

import pytest

from services.decision import estimator_cli
from services.decision.domain.kv_model import KNOWN_MODELS, collective_buffer_bytes, known_model, shape_from_hf_config
from services.decision.estimator import EstimateRequest, estimate, fit

GIB = 1024**3


def test_kv_bytes_use_kv_heads_not_attention_heads() -> None:
    shape = known_model("llama-3-8b")
    # 2 x layers x tokens x kv_heads x head_dim x bytes, verified on the H200 (FACTS.md).
    assert shape.kv_bytes(tokens=3 * 100, kv_dtype_bytes=2) == 2 * 32 * 300 * 8 * 128 * 2
    mha = known_model("llama-2-7b")
    assert mha.kv_bytes_per_token(2) == 4 * shape.kv_bytes_per_token(2)


def test_tensor_parallel_splits_kv_heads_and_replicates_when_fewer_than_ranks() -> None:
    shape = known_model("llama-3-70b")
    assert shape.kv_bytes_per_token(2, tp=4) == shape.kv_bytes_per_token(2) // 4
    assert shape.kv_heads_per_rank(16) == 1


def test_llama_3_8b_parameter_count_is_the_published_one() -> None:
    assert KNOWN_MODELS["llama-3-8b"].total_params() == pytest.approx(8.03e9, rel=0.005)
    assert KNOWN_MODELS["llama-3-70b"].total_params() == pytest.approx(70.6e9, rel=0.005)


def test_hf_config_gives_the_same_shape_as_the_table() -> None:
    config = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    }
    shape = shape_from_hf_config(config)
    table = known_model("llama-3-8b")
    assert shape.kv_bytes_per_token(2) == table.kv_bytes_per_token(2)
    assert shape.total_params() == table.total_params()


def test_hf_config_with_a_bad_field_names_it() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        shape_from_hf_config({"num_hidden_layers": -1, "hidden_size": 8})


def test_collective_buffer_term_grows_with_peers() -> None:
    assert collective_buffer_bytes(1) == 0
    assert collective_buffer_bytes(8, buffsize=4 << 20, channels=16) == 2 * (4 << 20) * 16 * 7


def test_estimate_and_fit_are_consistent() -> None:
    request = EstimateRequest(known_model("llama-3-8b"), batch=8, seq_len=4096, max_batched_tokens=8192)
    breakdown = estimate(request)
    assert breakdown.kv_bytes == 8 * 4096 * breakdown.kv_bytes_per_token
    assert breakdown.allocator_bytes == breakdown.weights_bytes + breakdown.kv_bytes + breakdown.workspace_bytes
    result = fit(request, gpu_bytes=140 * GIB, utilization=0.9)
    assert result.fits
    assert result.max_batch_at_seq_len >= 8
    # The KV room is exactly what is left of the budget.
    assert result.max_tokens * breakdown.kv_bytes_per_token <= result.kv_budget_bytes
    too_small = fit(request, gpu_bytes=16 * GIB, utilization=0.9)
    assert not too_small.fits and too_small.max_tokens == 0


def test_cli_prints_json_for_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 512,
            }
        )
    )
    code = estimator_cli.main([str(config), "--batch", "2", "--seq-len", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["breakdown"]["kv_bytes"] == 2 * 2 * (2 * 64) * 2 * 64 * 2


def test_cli_refuses_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert estimator_cli.main(["no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_cli_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert estimator_cli.main(["mistral-7b", "--batch", "4", "--seq-len", "1024"]) == 0
    assert "KV cache total" in capsys.readouterr().out
