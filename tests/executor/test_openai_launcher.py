"""The SITS OpenAI launcher's pieces without an engine: tier retagging, arguments, the tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sits.runtime.engine_control import priority_tier_of_request_id
from sits_app.stack.tokenizer import make_tokenizer, training_text
from sits_engine.vllm_plugin.openai_launcher import SCHEDULER_CLS, retag_headers, server_argv


def request_id(headers: list[tuple[bytes, bytes]] | None) -> str:
    assert headers is not None
    return dict(headers)[b"x-request-id"].decode()


def test_the_routed_tier_replaces_the_tier_a_client_named() -> None:
    tagged = retag_headers([(b"x-sits-priority", b"p2"), (b"X-Request-Id", b"p0-mine")])
    assert request_id(tagged) == "p2-mine"
    assert [key for key, _ in tagged or ()].count(b"x-request-id") == 1
    # vLLM's OpenAI server prefixes the id; the scheduler still reads the routed tier.
    assert priority_tier_of_request_id(f"chatcmpl-{request_id(tagged)}-1a2b3c4d") == 2
    assert priority_tier_of_request_id(f"cmpl-{request_id(tagged)}-0-1a2b3c4d") == 2


def test_a_request_without_a_routed_tier_keeps_its_id_and_an_unknown_tier_is_refused() -> None:
    assert retag_headers([(b"x-request-id", b"p0-direct")]) is None
    generated = retag_headers([(b"x-sits-priority", b"P0")])
    assert request_id(generated).startswith("p0-") and len(request_id(generated)) > 10
    with pytest.raises(ValueError):
        retag_headers([(b"x-sits-priority", b"p9")])


def test_the_launcher_adds_the_sits_scheduler_unless_one_is_named() -> None:
    args = server_argv(["--model", "m"])
    assert args[args.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    assert "--middleware" in args
    named = server_argv(["--model", "m", "--scheduler-cls=x.Y", "--scheduling-policy", "fcfs"])
    assert named.count("--scheduler-cls=x.Y") == 1 and "--scheduler-cls" not in named
    assert named.count("--scheduling-policy") == 1


def test_the_tokenizer_matches_the_model_and_never_yields_more_tokens_than_bytes(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    make_tokenizer(tmp_path, vocab_size=512)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    for text in [*training_text(20, seed=7), "ünïcödé ✓ 漢字", '{"json": [1, 2]}']:
        ids = tokenizer.encode(text).ids
        assert 0 < len(ids) <= len(text.encode())
        assert tokenizer.decode(ids) == text
    # Learned merges: ordinary text takes well under one token per byte.
    sample = " ".join(training_text(50, seed=3))
    assert len(tokenizer.encode(sample).ids) < 0.6 * len(sample.encode())
