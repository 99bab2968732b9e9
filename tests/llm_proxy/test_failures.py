"""Upstream failures, clients that leave, unknown attempts and restarts: served or refused, always recorded."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from lightning_sql.llm_proxy.recorder import UNATTRIBUTED_METADATA_KEY
from lightning_sql.llm_proxy.testing import StandInModelServer
from lightning_sql.store.base import LightningStore
from tests.llm_proxy.conftest import MODEL, spans_of, wait_for_spans

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def _aclient(base_url: str, timeout: float = 30.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)


async def _attempt(store: LightningStore) -> tuple[str, str]:
    rollout = await store.start_rollout(input={})
    return rollout.rollout_id, rollout.attempt.attempt_id


async def test_a_client_that_leaves_mid_stream_still_gets_its_call_recorded_as_cancelled(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy()
    rid, aid = await _attempt(store)
    stand_in.stand_in.chunk_delay = 0.2
    url = proxy.as_resource(rid, aid).endpoint + "/v1/chat/completions"
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "one two three four five six"}]}
    async with httpx.AsyncClient(trust_env=False) as client:
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if '"content":"echo:"' in line.replace(" ", ""):
                    break  # the first word arrived: leave
    (span,) = await wait_for_spans(store, rid, 1)
    assert span.attributes["lightning_sql.proxy.cancelled"] is True
    assert span.status.status_code == "ERROR" and span.attributes["error.type"] == "cancelled"
    assert span.attributes["gen_ai.completion.0.content"].startswith("echo:")
    assert span.attributes["gen_ai.completion.0.content"] != "echo: <|user|> one two three four five six <|assistant|>"
    assert span.attributes["prompt_token_ids"]  # the first chunk carried them


async def test_unknown_rollout_attempts_are_recorded_as_unattributed(
    make_proxy: Any, store: LightningStore
) -> None:
    proxy = await make_proxy()
    rid, aid = await _attempt(store)
    calls = [
        proxy.as_resource("ro-nope", "at-nope").endpoint,  # unknown rollout
        proxy.as_resource(rid, "at-nope").endpoint,  # known rollout, unknown attempt
        proxy.endpoint,  # no rollout at all
    ]
    for endpoint in calls:
        client = _aclient(endpoint)
        answer = await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
        assert answer.choices[0].message.content == "The answer is 7"
        await client.close()
    assert await spans_of(store, rid) == []
    holders = [r for r in await store.query_rollouts() if (r.metadata or {}).get(UNATTRIBUTED_METADATA_KEY)]
    assert len(holders) == 1 and holders[0].rollout_id != rid
    spans = await spans_of(store, holders[0].rollout_id)
    assert [s.sequence_id for s in spans] == [1, 2, 3]
    assert all(s.attributes["lightning_sql.proxy.unattributed"] is True for s in spans)
    requested = [
        (s.attributes.get("lightning_sql.proxy.requested_rollout_id"),
         s.attributes.get("lightning_sql.proxy.requested_attempt_id"))
        for s in spans
    ]
    assert requested == [("ro-nope", "at-nope"), (rid, "at-nope"), (None, None)]
    await proxy.stop()
    assert (await store.get_rollout_by_id(holders[0].rollout_id)).status == "succeeded"  # type: ignore[union-attr]


async def test_unknown_rollout_attempts_are_refused_when_configured(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy(unattributed="refuse")
    rid, aid = await _attempt(store)
    for endpoint in (proxy.as_resource("ro-nope", "at-nope").endpoint, proxy.as_resource(rid, "at-nope").endpoint,
                     proxy.endpoint):
        client = _aclient(endpoint)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
        await client.close()
    assert stand_in.stand_in.requests == []  # refused before forwarding
    client = _aclient(proxy.as_resource(rid, aid).endpoint)
    await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    await client.close()
    assert len(await spans_of(store, rid)) == 1
    assert len(await store.query_rollouts()) == 1  # no unattributed rollout


async def test_the_proxy_restarted_mid_run_keeps_recording_in_order(make_proxy: Any, store: LightningStore) -> None:
    proxy = await make_proxy()
    rid, aid = await _attempt(store)
    endpoint = proxy.as_resource(rid, aid).endpoint
    client = _aclient(endpoint, timeout=5.0)
    await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    await proxy.stop()
    assert not proxy.is_running()
    with pytest.raises(openai.APIConnectionError):
        await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    await proxy.restart()
    assert proxy.is_running() and proxy.as_resource(rid, aid).endpoint == endpoint  # same port
    await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    await proxy.restart()  # while running
    await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True)  # type: ignore[arg-type]
    await client.close()
    spans = await wait_for_spans(store, rid, 3)
    assert [s.sequence_id for s in spans] == [1, 2, 3]
