"""Live: the OpenAI-compatible HTTP path on a real vLLM CPU engine (SITS launcher), through the `openai` client.

One engine for this module (conftest `openai_engine`); the gRPC tests' engine is not running meanwhile.
"""

from __future__ import annotations

from typing import Any

import grpc
import openai
import pytest

from sits.runtime import engine_control as protocol
from sits.stack.vllm_engine import VllmOpenAIServer

pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.timeout(300)]

NO_EOS = {"ignore_eos": True}


def client(base_url: str, **kwargs: Any) -> openai.AsyncOpenAI:
    # No retries: every test looks at the first answer (the client retries 429 and 5xx by default).
    return openai.AsyncOpenAI(base_url=base_url, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)


async def engine_state(address: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        get = channel.unary_unary(
            protocol.GET_STATE, request_serializer=protocol.encode, response_deserializer=protocol.decode
        )
        state: dict[str, Any] = await get({}, timeout=30)
        return state


async def test_the_routed_tier_header_decides_the_tier_in_the_engine(openai_engine: VllmOpenAIServer) -> None:
    assert openai_engine.control_address is not None
    before = await engine_state(openai_engine.control_address)
    assert before["engine"]["policy"] == "priority"
    async with client(openai_engine.base_url) as api:
        # The client names P0 in its id; the tier header (what Envoy writes on each route) says P2.
        chat = await api.chat.completions.create(
            model=openai_engine.served_model_name,
            messages=[{"role": "user", "content": "the memory engine"}],
            max_tokens=4,
            extra_headers={"x-sits-priority": "p2", "X-Request-Id": "p0-claimed"},
            extra_body=NO_EOS,
        )
        assert chat.id.startswith("chatcmpl-p2-")
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        text = await api.completions.create(
            model=openai_engine.served_model_name,
            prompt="a text prompt the shipped tokenizer encodes",
            max_tokens=3,
            extra_headers={"x-sits-priority": "p0"},
            extra_body=NO_EOS,
        )
        assert text.id.startswith("cmpl-p0-") and text.usage is not None and text.usage.completion_tokens == 3
        assert text.usage.prompt_tokens > 0
        with pytest.raises(openai.BadRequestError, match="must be p0, p1 or p2"):
            await api.completions.create(
                model=openai_engine.served_model_name, prompt="x", max_tokens=1, extra_headers={"x-sits-priority": "p7"}
            )
    after = await engine_state(openai_engine.control_address)
    assert after["tiers"]["2"]["scheduled"] == before["tiers"]["2"]["scheduled"] + 1
    assert after["tiers"]["0"]["scheduled"] == before["tiers"]["0"]["scheduled"] + 1
