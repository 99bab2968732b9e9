"""Agent-Lightning 0.3's own ``LightningStoreClient`` against ``lightning-sql serve``.

The scenarios follow Agent-Lightning's client-server tests (end to end over every route, None vs
UNSET in updates, concurrent sequence ids, no retry on a 4xx), on SQLite files and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.server import ServerConfig
from tests.required import AGENTLIGHTNING, required_import
from tests.server.conftest import RUN, RunningServer, serve

agl_client = required_import("agentlightning.store.client_server", AGENTLIGHTNING)
agl_types = required_import("agentlightning.types", AGENTLIGHTNING)

from aiohttp import ClientResponseError  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.trace import SpanContext, TraceFlags  # noqa: E402

LightningStoreClient = agl_client.LightningStoreClient
UNSET = required_import("agentlightning.store.base", AGENTLIGHTNING).UNSET


def _client(server: RunningServer, **options: Any) -> Any:
    options.setdefault("retry_delays", (0.2,))
    options.setdefault("health_retry_delays", (0.1,))
    return LightningStoreClient(server.url, **options)


def _span(rollout_id: str, attempt_id: str, sequence_id: int, name: str) -> Any:
    return agl_types.Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=f"{sequence_id:032x}",
        span_id=f"{sequence_id:016x}",
        parent_id=None,
        name=name,
        status=agl_types.TraceStatus(status_code="OK"),
        attributes={"k": "v"},
        events=[],
        links=[],
        start_time=None,
        end_time=None,
        context=None,
        parent=None,
        resource=agl_types.OtelResource(attributes={}, schema_url=""),
    )


def _readable(index: int) -> ReadableSpan:
    context = SpanContext(trace_id=0xABC, span_id=0x100 + index, is_remote=False, trace_flags=TraceFlags(1))
    return ReadableSpan(
        name=f"otel-{index}",
        context=context,
        resource=Resource.create({"service.name": "agent"}),
        attributes={"gen_ai.request.model": "m"},
        start_time=1_000_000_000,
        end_time=2_000_000_000,
    )


async def test_client_end_to_end(server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]) -> None:
    server = server_factory()
    client = _client(server)
    try:
        llm = agl_types.LLM(endpoint="http://localhost:9000/v1", model="m1", sampling_parameters={"temperature": 0.5})
        prompt = agl_types.PromptTemplate(template="Hello {name}!", engine="f-string")
        added = await client.add_resources(cast(Any, {"main_llm": llm, "greeting": prompt}))
        assert added.resources_id.startswith("rs-")
        fetched = await client.get_resources_by_id(added.resources_id)
        assert fetched is not None and isinstance(fetched.resources["main_llm"], agl_types.LLM)
        assert fetched.resources["main_llm"].model == "m1"
        assert (await client.get_latest_resources()).resources_id == added.resources_id
        named = await client.update_resources("client-resources", {})
        assert named.resources == {}
        assert (await client.get_latest_resources()).resources_id == "client-resources"
        assert (await client.query_resources()).total == 2
        assert await client.get_resources_by_id("missing") is None

        config = agl_types.RolloutConfig(timeout_seconds=3.0, retry_condition=["timeout"])
        started = await client.start_rollout(input={"origin": "client"}, mode="train", config=config, metadata={"step": 0})
        assert started.config.timeout_seconds == 3.0 and started.attempt.sequence_id == 1

        enqueued = await client.enqueue_rollout(
            input={"origin": "queue"}, config=agl_types.RolloutConfig(unresponsive_seconds=6.0)
        )
        assert enqueued.status == "queuing"
        claimed = await client.dequeue_rollout(worker_id="worker-1")
        assert claimed is not None and claimed.rollout_id == enqueued.rollout_id
        assert await client.dequeue_rollout() is None
        retried = await client.start_attempt(claimed.rollout_id)
        assert retried.attempt.sequence_id == 2

        assert {r.rollout_id for r in await client.query_rollouts()} == {started.rollout_id, enqueued.rollout_id}
        assert [r.rollout_id for r in await client.query_rollouts(rollout_ids=[enqueued.rollout_id])] == [enqueued.rollout_id]
        preparing = await client.query_rollouts(status_in=["preparing"], sort_by="start_time", sort_order="desc")
        assert {r.rollout_id for r in preparing} == {started.rollout_id, enqueued.rollout_id}
        attempts = await client.query_attempts(claimed.rollout_id)
        assert [a.sequence_id for a in attempts] == [1, 2]
        latest = await client.get_latest_attempt(claimed.rollout_id)
        assert latest is not None and latest.attempt_id == retried.attempt.attempt_id
        stored = await client.get_rollout_by_id(claimed.rollout_id)
        assert stored is not None and stored.config.unresponsive_seconds == 6.0
        assert await client.get_rollout_by_id("ro-missing") is None

        attempt_id = retried.attempt.attempt_id
        span = await client.add_span(_span(claimed.rollout_id, attempt_id, 101, "client-span"))
        assert span is not None and span.name == "client-span"
        assert await client.get_next_span_sequence_id(claimed.rollout_id, attempt_id) == 102
        otel = await client.add_otel_span(claimed.rollout_id, attempt_id, _readable(1))
        assert otel is not None and otel.sequence_id == 103 and otel.name == "otel-1"
        spans = await client.query_spans(claimed.rollout_id)
        assert [s.name for s in spans] == ["client-span", "otel-1"]
        only = await client.query_spans(claimed.rollout_id, "latest", name_contains="otel")
        assert [s.span_id for s in only] == [otel.span_id]

        await client.update_rollout(claimed.rollout_id, mode="val", metadata={"step": 1})
        await client.update_attempt(claimed.rollout_id, attempt_id, worker_id="worker-2", metadata={"info": "started"})
        finished = await client.update_attempt(claimed.rollout_id, "latest", status="succeeded")
        assert finished.status == "succeeded" and finished.end_time is not None
        done = await client.wait_for_rollouts(rollout_ids=[claimed.rollout_id, started.rollout_id], timeout=0.05)
        assert [r.rollout_id for r in done] == [claimed.rollout_id]
        assert done[0].status == "succeeded"

        worker = await client.update_worker("worker-9", heartbeat_stats={"gpu": 0.5})
        assert worker.heartbeat_stats == {"gpu": 0.5}
        assert (await client.get_worker_by_id("worker-9")).worker_id == "worker-9"
        assert await client.get_worker_by_id("nobody") is None
        workers = await client.query_workers(worker_id_contains="worker")
        assert {w.worker_id for w in workers} >= {"worker-1", "worker-9"}

        stats = await client.statistics()
        assert stats["total_rollouts"] == 2 and stats["total_spans"] == 2
    finally:
        await client.close()

    # What the client saw is what the database holds.
    store = reader()
    assert (await store.get_rollout_by_id(claimed.rollout_id)).mode == "val"  # type: ignore[union-attr]
    assert [s.name for s in await store.query_spans(claimed.rollout_id)] == ["client-span", "otel-1"]


async def test_update_none_versus_unset(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory()
    client = _client(server)
    try:
        attempted = await client.start_rollout(input={"payload": True}, metadata={"keep": True})
        rollout_id, attempt_id = attempted.rollout_id, attempted.attempt.attempt_id
        await client.update_rollout(rollout_id, mode="train", metadata={"extra": 1})
        updated = await client.get_rollout_by_id(rollout_id)
        assert updated.mode == "train" and updated.metadata == {"extra": 1}
        await client.update_rollout(rollout_id, mode=None, metadata={"extra1": 2})
        cleared = await client.get_rollout_by_id(rollout_id)
        assert cleared.mode is None and cleared.metadata == {"extra1": 2}
        await client.update_rollout(rollout_id, mode=UNSET, metadata=UNSET, status="running")
        kept = await client.get_rollout_by_id(rollout_id)
        assert kept.mode is None and kept.metadata == {"extra1": 2} and kept.status == "running"

        await client.update_attempt(rollout_id, attempt_id, worker_id="worker-1", metadata={"stage": "init"})
        first = await client.get_latest_attempt(rollout_id)
        assert first.worker_id == "worker-1" and first.metadata == {"stage": "init"}
        await client.update_attempt(rollout_id, "latest", worker_id="", metadata={})
        emptied = await client.get_latest_attempt(rollout_id)
        assert emptied.worker_id == "" and emptied.metadata == {}
        await client.update_attempt(rollout_id, "latest", status="running", worker_id=UNSET, metadata=UNSET)
        preserved = await client.get_latest_attempt(rollout_id)
        assert preserved.worker_id == "" and preserved.metadata == {} and preserved.status == "running"
    finally:
        await client.close()


async def test_concurrent_otel_spans_get_distinct_sequence_ids(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory()
    client = _client(server)
    try:
        attempted = await client.start_rollout(input={"payload": True})
        spans = await asyncio.gather(
            *[client.add_otel_span(attempted.rollout_id, attempted.attempt.attempt_id, _readable(i)) for i in range(20)]
        )
        assert sorted(s.sequence_id for s in spans) == list(range(1, 21))
        assert len(await client.query_spans(attempted.rollout_id, attempt_id="latest")) == 20
    finally:
        await client.close()


async def test_bad_requests_are_4xx_and_not_retried(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory()
    # A retried call would first sleep 5 s: a quick answer proves it was not retried.
    client = _client(server, retry_delays=(5.0,))
    try:
        begun = time.monotonic()
        with pytest.raises(ClientResponseError) as caught:
            await client.update_rollout("ro-nonexistent", status="running")
        assert caught.value.status == 400
        with pytest.raises(ClientResponseError) as caught:
            await client.update_attempt("ro-nonexistent", "at-none", status="bogus")
        assert caught.value.status == 400
        with pytest.raises(ClientResponseError) as caught:
            await client.query_rollouts(sort_by="no_such_field")
        assert caught.value.status == 400
        assert time.monotonic() - begun < 4.0
    finally:
        await client.close()
    with httpx.Client(base_url=server.url + "/v1/agl", timeout=30) as http:
        cases = [
            ("/queues/rollouts/enqueue", b'{"rollouts": [{"input": 1}'),  # truncated JSON
            ("/queues/rollouts/enqueue", b'{"rollouts": 3}'),
            ("/rollouts", b"[]"),
            ("/rollouts/search", b'{"limit": 0}'),
            ("/rollouts/search", b'{"limit": "many"}'),
            ("/spans", b'{"rollout_id": "x"}'),
            ("/waits/rollouts", b'{"rollout_ids": "ro-1"}'),
            ("/resources", b'{"x": {"resource_type": "spaceship"}}'),
            ("/rollouts/ro-1", b'{"status": null}'),
        ]
        for path, body in cases:
            response = http.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400, (path, body, response.text)
            assert response.json()["detail"], (path, response.text)
            assert "Traceback" not in response.text
        assert http.get("/no/such/route").status_code == 404
        assert http.get("/queues/rollouts/enqueue").status_code == 405


async def test_run_header_picks_the_run(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    with httpx.Client(base_url=server.url + "/v1/agl", timeout=30) as http:
        mine = http.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": "default-run"}]})
        theirs = http.post(
            "/queues/rollouts/enqueue", json={"rollouts": [{"input": "other"}]}, headers={"X-Lightning-SQL-Run": "other"}
        )
        assert mine.status_code == theirs.status_code == 201
        assert http.get("/statistics", headers={"X-Lightning-SQL-Run": "other"}).json()["total_rollouts"] == 1
    assert [r.input for r in await reader(RUN).query_rollouts()] == ["default-run"]
    assert [r.input for r in await reader("other").query_rollouts()] == ["other"]


_CHILD = """
import asyncio, sys
from agentlightning.store.client_server import LightningStoreClient

async def main():
    client = LightningStoreClient(sys.argv[1], retry_delays=(0.5,), health_retry_delays=(0.1,))
    try:
        claimed = await client.dequeue_rollout(worker_id="child")
        assert claimed is not None, "nothing to claim"
        await client.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="running")
        await client.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
        print(claimed.rollout_id)
    finally:
        await client.close()

asyncio.run(main())
"""


async def test_a_runner_in_another_process_with_the_token_in_its_url(tmp_path: Path) -> None:
    # One backend: the child's interpreter start (agentlightning's imports) is the slow part here.
    url = f"sqlite:///{tmp_path / 'runner.db'}"
    with serve(ServerConfig(url=url, run=RUN, token="s3cret-token")) as server:
        rollout_id, expected = await _claim_in_a_child(server)
    store = SqlLightningStore(url, run=RUN, read_only=True, create_run=False)
    try:
        stored = await store.get_rollout_by_id(rollout_id)
    finally:
        await store.close()
    assert rollout_id == expected
    assert stored is not None and stored.status == "succeeded"


async def _claim_in_a_child(server: RunningServer) -> tuple[str, str]:
    with httpx.Client(timeout=30, headers={"Authorization": "Bearer s3cret-token"}) as http:
        enqueued = http.post(server.url + "/v1/agl/queues/rollouts/enqueue", json={"rollouts": [{"input": 7}]})
        assert enqueued.status_code == 201
    # aiohttp sends a URL's user:password as HTTP Basic: the token goes in the password.
    address = server.url.replace("http://", "http://runner:s3cret-token@")
    child = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", _CHILD, address], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return child.stdout.strip().splitlines()[-1], enqueued.json()[0]["rollout_id"]


def test_the_get_query_routes(server_factory: Callable[..., RunningServer]) -> None:
    """The GET forms of the queries (query parameters, repeatable lists), as Agent-Lightning's dashboard uses them."""
    server = server_factory()
    with httpx.Client(base_url=server.url + "/v1/agl", timeout=30) as http:
        http.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": i} for i in range(3)]})
        claimed = http.post("/queues/rollouts/dequeue", json={"worker_id": "w"}).json()[0]
        rollout_id, attempt_id = claimed["rollout_id"], claimed["attempt"]["attempt_id"]
        page = http.get("/rollouts", params=[("status_in", "queuing"), ("status_in", "preparing"), ("limit", "2")]).json()
        assert page["total"] == 3 and len(page["items"]) == 2 and page["limit"] == 2
        assert "attempt" in next(i for i in http.get("/rollouts").json()["items"] if i["rollout_id"] == rollout_id)
        assert http.get("/rollouts", params={"status_in": "queuing"}).json()["total"] == 2
        attempts = http.get(f"/rollouts/{rollout_id}/attempts", params={"sort_order": "desc"}).json()
        assert [a["attempt_id"] for a in attempts["items"]] == [attempt_id]
        assert http.get("/workers", params={"status_in": "busy"}).json()["items"][0]["worker_id"] == "w"
        http.post("/resources/r1", json={})
        assert http.get("/resources", params={"resources_id_contains": "r"}).json()["total"] == 1
        assert http.get("/spans", params={"rollout_id": rollout_id, "attempt_id": "latest"}).json()["total"] == 0
        assert http.get("/spans").status_code == 400  # rollout_id is required
        assert http.get("/rollouts", params={"limit": "x"}).status_code == 400


_TRACER_CHILD = """
import asyncio, sys
from agentlightning.store.client_server import LightningStoreClient
from agentlightning.tracer.otel import OtelTracer

async def main():
    client = LightningStoreClient(sys.argv[1], retry_delays=(0.5,), health_retry_delays=(0.1,))
    try:
        attempted = await client.start_rollout(input={"task": "trace me"})
        tracer = OtelTracer()
        tracer.init_worker(0)
        async with tracer.trace_context(
            "rollout", store=client, rollout_id=attempted.rollout_id, attempt_id=attempted.attempt.attempt_id
        ) as otel:
            with otel.start_as_current_span("agent-step") as step:
                step.set_attribute("step", 1)
                with otel.start_as_current_span("llm-call"):
                    pass
        print(attempted.rollout_id)
    finally:
        await client.close()

asyncio.run(main())
"""


async def test_agent_lightnings_tracer_exports_to_the_server(tmp_path: Path) -> None:
    """Agent-Lightning's OtelTracer, given the client as its store, sends its spans over OTLP with the
    rollout and attempt as resource attributes.  Its exporter takes the endpoint from
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (docs/server.md).  In a child process: the tracer installs a
    global tracer provider."""
    url = f"sqlite:///{tmp_path / 'tracer.db'}"
    with serve(ServerConfig(url=url, run=RUN)) as server:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": server.url + "/v1/traces"}
        child = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", _TRACER_CHILD, server.url],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    rollout_id = child.stdout.strip().splitlines()[-1]
    store = SqlLightningStore(url, run=RUN, read_only=True, create_run=False)
    try:
        spans = list(await store.query_spans(rollout_id))
    finally:
        await store.close()
    assert [s.name for s in spans] == ["llm-call", "agent-step"]
    assert [s.sequence_id for s in spans] == [1, 2]
    assert spans[0].parent_id == spans[1].span_id and spans[1].attributes["step"] == 1
    assert server.metric(metrics, "lightning_sql_spans_ingested_total", source="otlp") == 2


async def test_a_paused_run_answers_claims_with_429_and_retry_after(
    server_factory: Callable[..., RunningServer], mp_backend: Any
) -> None:
    """docs/queue.md: while the run is paused a claim that finds nothing answers 429 with
    Retry-After, as Agent-Lightning v1's gateway does during a weight update; after resume_run the
    same claim gets the rollout."""
    server = server_factory()
    owner = mp_backend.open(run=RUN)
    try:
        with httpx.Client(base_url=server.url + "/v1/agl", timeout=30) as http:
            assert http.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]}).status_code == 201
            await owner.pause_run()
            paused = http.post("/queues/rollouts/dequeue", json={"worker_id": "w"})
            assert paused.status_code == 429, paused.text
            assert paused.headers["Retry-After"] == "1" and "paused" in paused.json()["detail"]
            await owner.resume_run()
            claimed = http.post("/queues/rollouts/dequeue", json={"worker_id": "w"})
            assert claimed.status_code == 200 and len(claimed.json()) == 1
            empty = http.post("/queues/rollouts/dequeue", json={"worker_id": "w"})
            assert empty.status_code == 200 and empty.json() == []  # an empty queue is not a pause
    finally:
        await owner.close()
