"""Calls through the proxy with the official ``openai`` SDK: what reaches the client, what is stored."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.llm_proxy import LLMProxy
from lightning_sql.llm_proxy.testing import StandInModelServer, reply, tokenize
from lightning_sql.runtime.adapter import TracerTraceToTriplet
from lightning_sql.store.base import LightningStore
from tests.llm_proxy.conftest import MODEL, model_entry, spans_of

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]
PROMPT_IDS = tokenize("<|user|> What is 3 + 4? <|assistant|>")


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def _aclient(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def test_sync_async_and_streamed_calls_are_recorded_with_token_ids(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy()
    rollout = await store.start_rollout(input={"task": 1})
    llm = proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id)

    def sync_calls() -> list[str]:
        client = _client(llm.endpoint)
        plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.5)  # type: ignore[arg-type]
        stream = client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True)  # type: ignore[arg-type]
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        client.close()
        return [plain.choices[0].message.content or "", streamed]

    sync_answers = await asyncio.to_thread(sync_calls)
    client = _aclient(llm.endpoint)
    plain = await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True)  # type: ignore[arg-type]
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    completion = await client.completions.create(model=MODEL, prompt="2 * 21 =")
    await client.close()

    answers = [*sync_answers, plain.choices[0].message.content, streamed]
    assert answers == ["The answer is 7"] * 4
    assert completion.choices[0].text == reply("2 * 21 =")
    # vLLM is asked for token ids; the client's model name became the upstream's
    assert all(body["return_token_ids"] is True and body["model"] == "stand-in" for body in stand_in.stand_in.requests)

    spans = await spans_of(store, rollout.rollout_id, rollout.attempt.attempt_id)
    assert [s.sequence_id for s in spans] == [1, 2, 3, 4, 5]
    assert [s.name for s in spans] == ["openai.chat.completion"] * 4 + ["openai.completion"]
    assert [s.attributes["lightning_sql.proxy.stream"] for s in spans] == [False, True, False, True, False]
    answer_ids = tokenize("The answer is 7")
    for span in spans[:4]:
        attrs = span.attributes
        assert attrs["prompt_token_ids"] == PROMPT_IDS
        assert attrs["response_token_ids"] == answer_ids
        assert attrs["gen_ai.prompt.0.role"] == "user" and attrs["gen_ai.prompt.0.content"] == "What is 3 + 4?"
        assert attrs["gen_ai.completion.0.content"] == "The answer is 7"
        assert attrs["gen_ai.completion.0.finish_reason"] == "stop"
        assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.response.model"] == "stand-in"
        assert attrs["gen_ai.system"] == "hosted_vllm" and attrs["http.response.status_code"] == 200
        assert attrs["lightning_sql.proxy.latency_s"] >= 0 and span.status.status_code == "OK"
        assert span.end_time is not None and span.start_time is not None and span.end_time >= span.start_time
    assert spans[0].attributes["gen_ai.request.temperature"] == 0.5
    assert spans[0].attributes["gen_ai.usage.input_tokens"] == len(PROMPT_IDS)
    assert spans[4].attributes["prompt_token_ids"] == tokenize("2 * 21 =")
    assert spans[4].attributes["response_token_ids"] == tokenize(reply("2 * 21 ="))
    assert spans[3].attributes["lightning_sql.proxy.time_to_first_chunk_s"] >= 0

    triplets = TracerTraceToTriplet().adapt(spans)
    assert len(triplets) == 4  # the default matches chat calls only
    assert all(t.prompt["token_ids"] == PROMPT_IDS and t.response["token_ids"] == answer_ids for t in triplets)


async def test_calls_of_many_attempts_land_in_their_own_attempt_in_order(
    make_proxy: Any, store: LightningStore
) -> None:
    proxy = await make_proxy()
    rollouts = [await store.start_rollout(input={"task": i}) for i in range(8)]
    retried = await store.start_attempt(rollouts[0].rollout_id)  # a second attempt of the first rollout

    async def agent(rollout_id: str, attempt_id: str, tag: int) -> None:
        client = _aclient(proxy.as_resource(rollout_id, attempt_id).endpoint)
        for turn in range(4):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"agent {tag} turn {turn}"}]
            )
        await client.close()

    targets = [(r.rollout_id, r.attempt.attempt_id) for r in rollouts] + [
        (retried.rollout_id, retried.attempt.attempt_id)
    ]
    await asyncio.gather(*(agent(rid, aid, i) for i, (rid, aid) in enumerate(targets)))

    for tag, (rid, aid) in enumerate(targets):
        spans = await spans_of(store, rid, aid)
        contents = [s.attributes["gen_ai.prompt.0.content"] for s in spans]
        assert contents == [f"agent {tag} turn {t}" for t in range(4)]
        sequence_ids = [s.sequence_id for s in spans]
        assert sequence_ids == sorted(sequence_ids) and len(set(sequence_ids)) == 4
    both = await spans_of(store, rollouts[0].rollout_id)
    assert sorted(s.sequence_id for s in both) == list(range(1, 9))  # one counter per rollout


async def test_a_malformed_request_gets_4xx_and_nothing_is_stored(make_proxy: Any, store: LightningStore) -> None:
    proxy = await make_proxy()
    rollout = await store.start_rollout(input={})
    base = proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id).endpoint
    bad_bodies: list[tuple[str, bytes, int]] = [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", b'["a list"]', 400),
        ("/v1/chat/completions", b'{"model": "policy"}', 400),
        ("/v1/chat/completions", b'{"model": "policy", "messages": []}', 400),
        ("/v1/chat/completions", b'{"model": "policy", "messages": [{"content": "no role"}]}', 400),
        ("/v1/chat/completions", b'{"model": 3, "messages": [{"role": "user", "content": "x"}]}', 400),
        ("/v1/chat/completions", b'{"model": "policy", "stream": "yes", "messages": [{"role": "user"}]}', 400),
        ("/v1/completions", b'{"model": "policy"}', 400),
        ("/v1/chat/completions", b'{"model": "unknown", "messages": [{"role": "user", "content": "x"}]}', 404),
    ]
    async with httpx.AsyncClient(trust_env=False) as client:
        for path, body, status in bad_bodies:
            response = await client.post(base + path, content=body, headers={"content-type": "application/json"})
            assert response.status_code == status, (path, body, response.text)
            assert "error" in response.json()
    assert await spans_of(store, rollout.rollout_id) == []
    # nothing reserved either: the next sequence id is the first
    assert await store.get_next_span_sequence_id(rollout.rollout_id, rollout.attempt.attempt_id) == 1


async def test_models_route_and_bare_routes_without_v1(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy(
        model_list=[
            {"model_name": MODEL, "litellm_params": {"model": "hosted_vllm/stand-in", "api_base": stand_in.url}},
            {"model_name": "other", "litellm_params": {"model": "openai/stand-in", "api_base": stand_in.url,
                                                       "api_key": "sk-test", "temperature": 0.25}},
        ]
    )
    rollout = await store.start_rollout(input={})
    endpoint = proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id, model="other").endpoint
    client = _aclient(endpoint)  # no /v1: Agent-Lightning's resources point at the bare prefix
    models = await client.models.list()
    assert sorted(m.id for m in models.data) == ["other", MODEL]
    answer = await client.chat.completions.create(model="other", messages=QUESTION)  # type: ignore[arg-type]
    await client.close()
    assert answer.choices[0].message.content == "The answer is 7"
    sent = stand_in.stand_in.requests[-1]
    assert sent["temperature"] == 0.25 and "return_token_ids" not in sent  # openai/: no vLLM extras
    (span,) = await spans_of(store, rollout.rollout_id)
    assert span.attributes["gen_ai.system"] == "openai" and "prompt_token_ids" not in span.attributes


async def test_logprobs_are_requested_and_recorded(
    make_proxy: Any, store: LightningStore, stand_in: StandInModelServer
) -> None:
    proxy = await make_proxy(callbacks=["return_token_ids", "opentelemetry", "logprobs"])
    rollout = await store.start_rollout(input={})
    client = _aclient(proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id).endpoint)
    for stream in (False, True):
        response = await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=stream)  # type: ignore[call-overload]
        if stream:
            [chunk async for chunk in response]
    await client.close()
    assert [body["logprobs"] for body in stand_in.stand_in.requests] == [True, True]
    spans = await spans_of(store, rollout.rollout_id)
    assert len(spans) == 2
    for span in spans:
        assert "gen_ai.request.logprobs" not in span.attributes  # request parameters as the client sent them
        tokens = [entry["token"] for entry in json.loads(span.attributes["logprobs.content"])]
        assert tokens == ["The", "answer", "is", "7"]


async def _one_call_through(proxy: Any, store: LightningStore) -> None:
    await proxy.start()
    try:
        assert proxy.is_running()
        rollout = await store.start_rollout(input={})
        client = _aclient(proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id).endpoint)
        response = await client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
        await client.close()
        assert response.choices[0].message.content == "The answer is 7"
        (span,) = await spans_of(store, rollout.rollout_id)
        assert span.attributes["prompt_token_ids"] == PROMPT_IDS
    finally:
        await proxy.stop()
    assert not proxy.is_running()


async def test_asyncio_launch_mode_serves_from_the_callers_loop(
    stand_in: StandInModelServer, store: LightningStore
) -> None:
    await _one_call_through(LLMProxy(model_list=[model_entry(stand_in.url)], store=store, launch_mode="asyncio"), store)


async def test_mp_launch_mode_serves_from_a_child_process(stand_in: StandInModelServer, tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'mp.db'}", run="mp")
    try:
        await _one_call_through(LLMProxy(model_list=[model_entry(stand_in.url)], store=store, launch_mode="mp"), store)
    finally:
        await store.close()


async def test_a_store_that_cannot_be_shared_is_refused_by_mp_mode(stand_in: StandInModelServer) -> None:
    store = SqlLightningStore("sqlite://", run="memory")
    try:
        proxy = LLMProxy(model_list=[model_entry(stand_in.url)], store=store, launch_mode="mp")
        with pytest.raises(RuntimeError, match="zero_copy"):
            await proxy.start()
        assert not proxy.is_running()
    finally:
        await store.close()
