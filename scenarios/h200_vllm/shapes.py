"""Model shapes the scenario serves: a Hugging Face config.json alone, weights drawn by vLLM.

vLLM's `--load-format dummy` fills the weights at random on the GPU from the config, so a
realistic shape costs no download and no disk: the memory and the step times are those of
the real model; the tokens it generates are noise. `decision_model` names the shape in the
decision's table (`services/decision/domain/kv_model.py`), which the estimator and the step
budget read; the decision can also read the written config.json itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    name: str
    decision_model: str
    config: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def write(self, directory: Path) -> Path:
        """Write config.json into `directory` (created) and return the directory."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config, indent=1))
        return directory


_LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 32768,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

_QWEN25_14B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "torch_dtype": "bfloat16",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "max_window_layers": 48,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "sliding_window": None,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "tie_word_embeddings": False,
}

SHAPES: dict[str, Shape] = {
    "llama-3-8b": Shape("llama-3-8b", "llama-3-8b", _LLAMA3_8B),
    "qwen2.5-14b": Shape("qwen2.5-14b", "qwen2.5-14b", _QWEN25_14B),
}


def shape(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}") from None
