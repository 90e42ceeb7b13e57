"""Admission of one OpenAI-compatible request (`/v1/completions`, `/v1/chat/completions`): pure, no I/O.

The processor hands this module the whole JSON body (Envoy buffers it, up to
`http.max_body_bytes`); it answers what the request asks of the engine (prompt
tokens, new tokens over all `n` choices) or why it is refused before the engine
sees it, with the HTTP status and the OpenAI error code a client expects.

Prompt tokens are counted with the served model's tokenizer when the policy
names it, else as UTF-8 bytes: no byte-level tokenizer yields more tokens than
bytes, so the bound never undercounts. Chat messages are counted as the test
model's template renders them (`role: content` per line) plus a few tokens per
message for templates that say more.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sits_mesh.policy import HttpApi

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Template tokens a chat message may add beyond its role and content (markers, separators).
CHAT_TOKENS_PER_MESSAGE = 8
CHAT_TOKENS_PER_REQUEST = 8

TokenCounter = Callable[[str], int]


def byte_count(text: str) -> int:
    return len(text.encode())


def tokenizer_counter(path: str) -> TokenCounter:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count


@dataclass(frozen=True)
class OpenAIShape:
    model: str
    prompt_tokens: int
    # New tokens over all choices: max_tokens x n.
    max_tokens: int
    # -1: the whole vocabulary (vLLM's convention), 0: none.
    prompt_logprobs: int = 0


class OpenAIRequestError(ValueError):
    """A request refused before the engine: `status` and OpenAI error `code`, message in `args[0]`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])


def _bad(message: str, code: str = "invalid_request") -> OpenAIRequestError:
    return OpenAIRequestError(400, code, message)


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(f"'{name}' must be an integer >= {minimum}, not {json.dumps(value)[:40]}")
    return value


def _prompt_tokens(prompt: Any, count: TokenCounter) -> int:
    if isinstance(prompt, str):
        return count(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return sum(count(p) for p in prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return sum(len(p) for p in prompt)
    raise _bad("'prompt' must be a string, a list of strings, or token ids")


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _bad(f"messages[{index}].content parts must be objects with a 'type'")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{index}].content text parts need a string 'text'")
                parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{index}].content must be a string or a list of parts")


def _chat_tokens(messages: Any, count: TokenCounter) -> int:
    if not isinstance(messages, list) or not messages:
        raise _bad("missing field 'messages': a chat completion needs a non-empty list of messages", "missing_field")
    total = CHAT_TOKENS_PER_REQUEST
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{index}] must be an object with a string 'role'")
        text = f"{message['role']}: {_content_text(message.get('content'), index)}\n"
        total += count(text) + CHAT_TOKENS_PER_MESSAGE
    return total


def parse_openai(body: bytes, endpoint: Endpoint, http: HttpApi, count: TokenCounter = byte_count) -> OpenAIShape:
    """What one request asks of the engine, or OpenAIRequestError (400, 404) saying why not."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad(f"the request body is not valid JSON: {err}", "invalid_json") from None
    if not isinstance(data, dict):
        raise _bad("the request body must be a JSON object", "invalid_json")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("missing field 'model'", "missing_field")
    if http.models and model not in http.models:
        raise OpenAIRequestError(
            404, "model_not_found", f"the model '{model[:100]}' does not exist; served: {', '.join(http.models)}"
        )
    if endpoint == "chat":
        prompt_tokens = _chat_tokens(data.get("messages"), count)
    else:
        if "prompt" not in data:
            raise _bad("missing field 'prompt'", "missing_field")
        prompt_tokens = _prompt_tokens(data["prompt"], count)
    n = _int_field(data, "n", 1) or 1
    prompt_logprobs = _int_field(data, "prompt_logprobs", -1) or 0
    new_tokens = _int_field(data, "max_completion_tokens", 0)
    if new_tokens is None:
        new_tokens = _int_field(data, "max_tokens", 0)
    if new_tokens is None:
        # vLLM lets a request without a limit run to the model's length.
        new_tokens = max(0, http.max_model_len - prompt_tokens)
    return OpenAIShape(
        model=model, prompt_tokens=prompt_tokens, max_tokens=new_tokens * n, prompt_logprobs=prompt_logprobs
    )
