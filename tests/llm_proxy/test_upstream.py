"""What the upstream does (errors, retries, outages, balancing, slowness) and what the client and the store see.

These exercise the forwarding layer, so they run on one backend (SQLite file); the store-facing behaviour
runs on every backend in the other modules.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from lightning_sql.llm_proxy.testing import StandInModelServer
from lightning_sql.store.base import LightningStore
from tests.conftest import BackendSpec
from tests.llm_proxy.conftest import MODEL, closed_port_url, model_entry, spans_of

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def _aclient(base_url: str, timeout: float = 30.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)


async def _attempt(store: LightningStore) -> tuple[str, str]:
    rollout = await store.start_rollout(input={})
    return rollout.rollout_id, rollout.attempt.attempt_id


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[BackendSpec]:
    yield BackendSpec("sqlite_file", tmp_path)


async def test_an_upstream_error_reaches_the_client_with_its_status_and_body_and_is_recorded(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy()
    rid, aid = await _attempt(store)
    stand_in.stand_in.fail_status = 500
    client = _aclient(proxy.as_resource(rid, aid).endpoint)
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    assert caught.value.status_code == 500
    assert "stand-in failure 500" in str(caught.value.body)
    stand_in.stand_in.fail_status = 429
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True)  # type: ignore[arg-type]
    await client.close()
    first, second = await spans_of(store, rid)
    assert first.status.status_code == "ERROR" and first.attributes["error.type"] == "500"
    assert first.attributes["http.response.status_code"] == 500 and first.attributes["lightning_sql.proxy.tries"] == 1
    assert "stand-in failure 500" in first.attributes["lightning_sql.proxy.error"]
    assert second.attributes["error.type"] == "429" and second.attributes["lightning_sql.proxy.stream"] is True
    assert len(stand_in.stand_in.requests) == 2  # no retry without num_retries


async def test_5xx_is_retried_with_back_off_and_the_call_succeeds(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy(num_retries=2, retry_backoff=0.05)
    rid, aid = await _attempt(store)
    stand_in.stand_in.fail_next = 2
    client = _aclient(proxy.as_resource(rid, aid).endpoint)
    started = asyncio.get_running_loop().time()
    answer = await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    elapsed = asyncio.get_running_loop().time() - started
    await client.close()
    assert answer.choices[0].message.content == "The answer is 7"
    assert elapsed >= 0.05 + 0.1  # two back-offs: 0.05 s, then 0.1 s
    (span,) = await spans_of(store, rid)
    assert span.attributes["lightning_sql.proxy.tries"] == 3 and span.status.status_code == "OK"
    assert len(stand_in.stand_in.requests) == 3


async def test_an_upstream_that_is_down_gives_502_and_is_recorded(make_proxy: Any, store: LightningStore) -> None:
    proxy = await make_proxy(model_list=[model_entry(closed_port_url())], num_retries=1, retry_backoff=0.01)
    rid, aid = await _attempt(store)
    client = _aclient(proxy.as_resource(rid, aid).endpoint)
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    await client.close()
    assert caught.value.status_code == 502
    (span,) = await spans_of(store, rid)
    assert span.status.status_code == "ERROR" and span.attributes["error.type"] == "ConnectError"
    assert span.attributes["lightning_sql.proxy.tries"] == 2 and "http.response.status_code" not in span.attributes


async def test_a_retry_goes_to_another_upstream_of_the_same_name(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy(model_list=[model_entry(closed_port_url()), model_entry(stand_in.url)], num_retries=1,
                             retry_backoff=0.01)
    rid, aid = await _attempt(store)
    client = _aclient(proxy.as_resource(rid, aid).endpoint)
    for _ in range(4):  # whichever upstream is picked first, every call ends on the live one
        answer = await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
        assert answer.choices[0].message.content == "The answer is 7"
    await client.close()
    spans = await spans_of(store, rid)
    assert {s.attributes["lightning_sql.proxy.upstream"] for s in spans} == {f"{stand_in.url}#stand-in"}
    assert {s.attributes["lightning_sql.proxy.tries"] for s in spans} <= {1, 2}


async def test_several_upstreams_of_one_name_share_the_calls(make_proxy: Any, store: LightningStore) -> None:
    with StandInModelServer() as first, StandInModelServer() as second:
        proxy = await make_proxy(model_list=[model_entry(first.url), model_entry(second.url)])
        rid, aid = await _attempt(store)
        client = _aclient(proxy.as_resource(rid, aid).endpoint)
        await asyncio.gather(*(client.chat.completions.create(model=MODEL, messages=QUESTION) for _ in range(10)))  # type: ignore[arg-type]
        await client.close()
        assert len(first.stand_in.requests) + len(second.stand_in.requests) == 10
        assert len(first.stand_in.requests) >= 3 and len(second.stand_in.requests) >= 3


async def test_a_slow_upstream_is_awaited_and_a_too_slow_one_times_out_with_504(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy(request_timeout=1.0)
    rid, aid = await _attempt(store)
    client = _aclient(proxy.as_resource(rid, aid).endpoint)
    stand_in.stand_in.delay = 0.3
    answer = await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "The answer is 7"
    stand_in.stand_in.delay = 3.0
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    await client.close()
    assert caught.value.status_code == 504
    slow, too_slow = await spans_of(store, rid)
    assert slow.status.status_code == "OK" and slow.attributes["lightning_sql.proxy.latency_s"] >= 0.3
    assert too_slow.attributes["error.type"] == "ReadTimeout" and too_slow.status.status_code == "ERROR"
