"""A byte-level BPE tokenizer for the random-weight test model, trained on the spot.

vLLM's OpenAI server needs a tokenizer for text prompts and chat messages, and
nothing may be downloaded here; so one is trained with the `tokenizers` library
on text generated from a fixed seed (the same bytes every time, so the same
tokenizer everywhere) and saved beside the model as `tokenizer.json` plus a
`tokenizer_config.json` that `transformers` reads (special tokens and a chat
template). Byte-level: any UTF-8 text encodes, and no text yields more tokens
than it has bytes, which the mesh's admission relies on when it only has a bound.

Its vocabulary is exactly the model's (`vocab_size`): ids 0..2 are the special
tokens that `LlamaConfig` names by default (pad 0, bos 1, eos 2).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
# A chat template vLLM renders for /v1/chat/completions: one line per message, then the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
_WORDS = " ".join(
    (
        "the memory engine request token prompt stream priority tier shed admit refuse cache block "
        "gpu cuda out of kv budget step batch decode prefill envoy mesh policy decision executor "
        "validator capture kafka redis latency throughput queue wait p0 p1 p2 model llama vllm "
        "a an and or to in on is are was be with for from at by this that it as not no yes",
    )
).split()


def training_text(lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English with digits and punctuation, so common merges exist."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words).capitalize() + rng.choice(".?!,;:"))
    return out


def has_tokenizer(directory: Path) -> bool:
    return (directory / TOKENIZER_FILE).exists() and (directory / CONFIG_FILE).exists()


def make_tokenizer(directory: Path, vocab_size: int, max_model_len: int = 2048) -> Path:
    """Train and write (once) the tokenizer files into `directory`; returns `directory`.

    Files are written into a temporary folder and renamed into place one by one,
    the config last, so a reader that sees the config also sees the tokenizer.
    """
    if has_tokenizer(directory):
        return directory
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens; the model has {vocab_size}")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "model_max_length": max_model_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=directory))
    try:
        tokenizer.save(str(staging / TOKENIZER_FILE))
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (staging / TOKENIZER_FILE).replace(directory / TOKENIZER_FILE)
        (staging / CONFIG_FILE).replace(directory / CONFIG_FILE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory
