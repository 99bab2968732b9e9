"""The proxy as it is deployed: loopback by default, a token when asked, a body limit, calls that are
answered always recorded, and no web page able to inject a call (every backend)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import openai
import pytest

from lightning_sql.llm_proxy import LLMProxy
from lightning_sql.llm_proxy.spans import MAX_RECORDED_CHARS, PROXY_PREFIX
from lightning_sql.store.base import LightningStore
from tests.llm_proxy.conftest import MODEL, spans_of


async def _attempt(store: LightningStore) -> tuple[str, str]:
    attempted = await store.start_rollout({"q": 1})
    return attempted.rollout_id, attempted.attempt.attempt_id


def _chat(content: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


async def test_the_proxy_binds_loopback_by_default(make_proxy: Any) -> None:
    proxy: LLMProxy = await make_proxy()
    assert proxy.host == "127.0.0.1" and proxy.endpoint.startswith("http://127.0.0.1:")
    sockets = [sock for server in proxy._server.server.servers for sock in server.sockets]  # type: ignore[union-attr]
    assert sockets and {sock.getsockname()[0] for sock in sockets} == {"127.0.0.1"}


async def test_a_page_cannot_inject_a_call(make_proxy: Any, store: LightningStore) -> None:
    proxy: LLMProxy = await make_proxy()
    rollout_id, attempt_id = await _attempt(store)
    url = f"{proxy.endpoint}/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions"
    body = b'{"model": "policy", "messages": [{"role": "user", "content": "injected"}]}'
    async with httpx.AsyncClient(timeout=30) as http:
        text = await http.post(url, content=body, headers={"Content-Type": "text/plain"})
        assert text.status_code == 415
        foreign = await http.post(url, content=body, headers={"Content-Type": "application/json", "Origin": "http://evil.example"})
        assert foreign.status_code == 403
        rebound = await http.post(url, content=body, headers={"Content-Type": "application/json", "Host": "evil.example"})
        assert rebound.status_code == 421
        assert (await http.post(url, content=body, headers={"Content-Type": "application/json"})).status_code == 200
    assert len(await spans_of(store, rollout_id)) == 1


async def test_bodies_are_limited_and_an_answered_call_is_recorded_whole(make_proxy: Any, store: LightningStore) -> None:
    proxy: LLMProxy = await make_proxy(max_body_bytes=4 * 1024 * 1024)
    rollout_id, attempt_id = await _attempt(store)
    base = f"{proxy.endpoint}/rollout/{rollout_id}/attempt/{attempt_id}/v1"
    async with httpx.AsyncClient(timeout=60) as http:
        over = await http.post(base + "/chat/completions", json=_chat("x" * (5 * 1024 * 1024)))
        assert over.status_code == 413 and "limit" in over.text
        big = "y" * (3 * 1024 * 1024)  # under the body limit, over a recorded field's
        answered = await http.post(base + "/chat/completions", json=_chat(big))
        assert answered.status_code == 200
    (call,) = await spans_of(store, rollout_id)
    content = call.attributes["gen_ai.prompt.0.content"]
    assert content.startswith("y" * 1000) and len(content) < MAX_RECORDED_CHARS + 200
    assert "truncated" in content and str(len(big)) in content
    assert "gen_ai.prompt.0.content" in call.attributes[f"{PROXY_PREFIX}.truncated"]


async def test_a_token_is_required_when_set_and_a_public_bind_without_one_warns(
    make_proxy: Any, store: LightningStore, caplog: pytest.LogCaptureFixture
) -> None:
    proxy: LLMProxy = await make_proxy(token="s3cret")
    rollout_id, attempt_id = await _attempt(store)
    resource = proxy.as_resource(rollout_id, attempt_id)
    assert resource.api_key == "s3cret"
    denied = openai.AsyncOpenAI(base_url=resource.endpoint, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await denied.chat.completions.create(**_chat("hi"))
    await denied.close()
    allowed = openai.AsyncOpenAI(base_url=resource.endpoint, api_key=resource.api_key, max_retries=0)
    await allowed.chat.completions.create(**_chat("hi"))
    await allowed.close()
    assert len(await spans_of(store, rollout_id)) == 1
    assert httpx.get(proxy.endpoint + "/health", timeout=10).status_code == 200
    with caplog.at_level(logging.WARNING, logger="lightning_sql.llm_proxy.proxy"):
        public = await make_proxy(host="0.0.0.0")
    assert "without a token" in caplog.text and str(public.port) in caplog.text
