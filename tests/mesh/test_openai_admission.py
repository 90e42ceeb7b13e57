"""What an OpenAI request asks of the engine, and the 4xx it gets when it asks wrongly (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sits_mesh.openai_admission import CHAT_TOKENS_PER_MESSAGE, OpenAIRequestError, parse_openai
from sits_mesh.policy import HttpApi, MeshPolicy, PolicyError, parse_policy

HTTP = HttpApi(models=["m"], max_model_len=1024)


def parse(body: Any, endpoint: str = "completions", http: HttpApi = HTTP) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_openai(raw, endpoint, http)  # type: ignore[arg-type]


def refusal(body: Any, endpoint: str = "completions") -> OpenAIRequestError:
    with pytest.raises(OpenAIRequestError) as caught:
        parse(body, endpoint)
    return caught.value


def test_prompt_tokens_are_bounded_by_bytes_and_new_tokens_count_every_choice() -> None:
    shape = parse({"model": "m", "prompt": "héllo", "max_tokens": 10, "n": 3})
    assert (shape.prompt_tokens, shape.max_tokens) == (6, 30)
    assert parse({"model": "m", "prompt": [[1, 2, 3], [4]], "max_tokens": 1}).prompt_tokens == 4
    assert parse({"model": "m", "prompt": ["ab", "c"], "max_completion_tokens": 2}).max_tokens == 2
    # No limit named: the engine may run to the model's length.
    assert parse({"model": "m", "prompt": "abcd"}).max_tokens == 1020
    chat = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "chat")
    assert chat.prompt_tokens >= len("user: hi\n") + CHAT_TOKENS_PER_MESSAGE
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}
    assert parse({"model": "m", "messages": [parts]}, "chat").prompt_tokens == chat.prompt_tokens
    # prompt_logprobs reach admission: -1 (the whole vocabulary), k, or absent.
    assert parse({"model": "m", "prompt": "x", "prompt_logprobs": -1}).prompt_logprobs == -1
    assert parse({"model": "m", "prompt": "x", "prompt_logprobs": 5}).prompt_logprobs == 5
    assert parse({"model": "m", "prompt": "x"}).prompt_logprobs == 0


@pytest.mark.parametrize(
    ("body", "endpoint", "status", "code"),
    [
        (b"{nope", "completions", 400, "invalid_json"),
        ([1, 2], "completions", 400, "invalid_json"),
        ({"prompt": "x"}, "completions", 400, "missing_field"),
        ({"model": "other", "prompt": "x"}, "completions", 404, "model_not_found"),
        ({"model": "m"}, "completions", 400, "missing_field"),
        ({"model": "m", "prompt": [1, "a"]}, "completions", 400, "invalid_request"),
        ({"model": "m", "messages": []}, "chat", 400, "missing_field"),
        ({"model": "m", "messages": [{"content": "x"}]}, "chat", 400, "invalid_request"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, "completions", 400, "invalid_request"),
        ({"model": "m", "prompt": "x", "n": True}, "completions", 400, "invalid_request"),
        ({"model": "m", "prompt": "x", "prompt_logprobs": "all"}, "completions", 400, "invalid_request"),
        ({"model": "m", "prompt": "x", "prompt_logprobs": -2}, "completions", 400, "invalid_request"),
    ],
)
def test_bad_requests_are_refused_with_a_status_and_code(body: Any, endpoint: str, status: int, code: str) -> None:
    error = refusal(body, endpoint)
    assert (error.status, error.code) == (status, code)
    assert error.message


def test_tenants_validate() -> None:
    policy = parse_policy(
        "engine_api: openai\nhttp:\n  tenants:\n    - {name: gold, tier: p0, api_keys: [k1]}\n"
        "    - {name: free, tier: p2, api_keys: [k2, k3]}\n"
    )
    assert isinstance(policy, MeshPolicy) and [t.tier for t in policy.http.tenants] == ["p0", "p2"]
    for bad in (
        "http: {tenants: [{name: a, tier: p0, api_keys: [k]}, {name: b, tier: p1, api_keys: [k]}]}",
        "http: {tenants: [{name: a, tier: p0}, {name: a, tier: p1}]}",
        "http: {tenants: [{name: a, tier: p0, api_keys: ['has space']}]}",
        "http: {tenants: [{name: a, tier: p5}]}",
        "engine_api: rest",
    ):
        with pytest.raises(PolicyError):
            parse_policy(bad)
