"""The server works database-wide: OTLP spans go to their rollout's run, ``/metrics`` covers the runs
with recent activity, and only a write that stores something creates a run (SQLite and PostgreSQL)."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable

import httpx

from lightning_sql import SqlLightningStore
from lightning_sql.server.stores import MAX_RUNS
from tests.conftest import PG_URL, BackendSpec
from tests.helpers import pg_execute
from tests.server.conftest import RUN, RunningServer
from tests.server.test_otlp import PROTOBUF, _proto_span, _request

RUN_HEADER = "X-Lightning-SQL-Run"


async def _trainer_run(mp_backend: BackendSpec, run: str) -> tuple[str, str]:
    """A rollout attempt made by a trainer on the database directly, in a run the server never served."""
    store = SqlLightningStore(mp_backend.url, **mp_backend.options(run=run))
    try:
        attempted = await store.start_rollout({"task": run})
        return attempted.rollout_id, attempted.attempt.attempt_id
    finally:
        await store.close()


async def test_spans_naming_only_their_rollout_go_to_its_run(
    server_factory: Callable[..., RunningServer], mp_backend: BackendSpec, reader: Callable[..., SqlLightningStore]
) -> None:
    rollout_id, attempt_id = await _trainer_run(mp_backend, "trainer-run")
    server = server_factory()  # --run is test-run
    ids = {"agentlightning.rollout_id": rollout_id, "agentlightning.attempt_id": attempt_id}
    spans = [_proto_span(i, **{k.replace(".", "__"): v for k, v in ids.items()}) for i in range(5)]
    answer = httpx.post(server.url + "/v1/traces", content=_request(spans).SerializeToString(), headers=PROTOBUF, timeout=30)
    assert answer.status_code == 200, answer.text
    stored = list(await reader("trainer-run").query_spans(rollout_id))
    assert sorted(s.name for s in stored) == [f"span-{i}" for i in range(5)]
    assert [r.name for r in await reader().list_runs()] == ["trainer-run"]  # --run was not created


async def test_an_ambiguous_rollout_goes_to_the_server_run_or_is_rejected(
    server_factory: Callable[..., RunningServer], mp_backend: BackendSpec, reader: Callable[..., SqlLightningStore]
) -> None:
    from lightning_sql.types import EnqueueRolloutRequest

    # The same rollout id in two runs (ids are random: made here by renaming one in SQL).
    rollout_id, attempt_id = await _trainer_run(mp_backend, "first")
    await _trainer_run(mp_backend, "second")
    copy = SqlLightningStore(mp_backend.url, **mp_backend.options(run="second"))
    try:
        duplicate = await copy.enqueue_many_rollouts([EnqueueRolloutRequest(input=1)])
    finally:
        await copy.close()
    other = duplicate[0].rollout_id
    if mp_backend.is_postgres:
        await pg_execute(PG_URL, f"UPDATE {mp_backend.schema}.rollouts SET rollout_id = '{rollout_id}' WHERE rollout_id = '{other}'")
    else:
        with sqlite3.connect(mp_backend.url.removeprefix("sqlite:///")) as conn:
            conn.execute("UPDATE rollouts SET rollout_id = ? WHERE rollout_id = ?", (rollout_id, other))
    body = _request([_proto_span(1, agentlightning__rollout_id=rollout_id, agentlightning__attempt_id=attempt_id)])
    elsewhere = server_factory(run="third")
    answer = httpx.post(elsewhere.url + "/v1/traces", content=body.SerializeToString(), headers=PROTOBUF, timeout=30)
    assert answer.status_code == 200
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    parsed = ExportTraceServiceResponse.FromString(answer.content)
    assert parsed.partial_success.rejected_spans == 1 and "'first', 'second'" in parsed.partial_success.error_message
    named = httpx.post(
        elsewhere.url + "/v1/traces", content=body.SerializeToString(), headers={**PROTOBUF, RUN_HEADER: "first"}, timeout=30
    )
    assert ExportTraceServiceResponse.FromString(named.content).partial_success.rejected_spans == 0
    assert len(await reader("first").query_spans(rollout_id)) == 1
    assert "third" not in [r.name for r in await reader().list_runs()]


async def test_metrics_cover_the_runs_with_recent_activity(
    server_factory: Callable[..., RunningServer], mp_backend: BackendSpec
) -> None:
    await _trainer_run(mp_backend, "quickstart")
    store = SqlLightningStore(mp_backend.url, **mp_backend.options(run="old-run", clock=lambda: 1_000_000.0, clock_sync=False))
    try:
        await store.enqueue_rollout(1)  # its only activity is decades old
    finally:
        await store.close()
    server = server_factory(read_only=True)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert server.metric(text, "lightning_sql_rollouts", run="quickstart", status="preparing") == 1
    assert server.metric(text, "lightning_sql_queue_depth", run="quickstart") == 0
    assert server.metric(text, "lightning_sql_queue_depth", run="old-run") is None


async def test_requests_naming_a_run_create_it_only_when_they_store_something(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for i in range(MAX_RUNS + 10):  # more than the runs one process serves: none is opened
            stats = http.get("/v1/agl/statistics", headers={RUN_HEADER: f"junk{i}"})
            assert stats.status_code == 200 and stats.json()["total_rollouts"] == 0
        header = {RUN_HEADER: "junk"}
        assert http.get("/v1/agl/rollouts", headers=header).json() == {"items": [], "limit": -1, "offset": 0, "total": 0}
        assert http.get("/v1/agl/rollouts/ro-x", headers=header).json() is None
        assert http.post("/v1/agl/queues/rollouts/dequeue", headers=header).json() == []
        assert http.post("/v1/agl/waits/rollouts", json={"rollout_ids": ["ro-x"], "timeout": 0}, headers=header).json() == []
        refused = http.post("/v1/agl/rollouts/ro-x", json={"status": "failed"}, headers=header)
        assert refused.status_code == 400 and "junk" in refused.json()["detail"]
        spans = _request([_proto_span(1, agentlightning__rollout_id="ro-x", agentlightning__attempt_id="at-x", lightning_sql__run="junk")])
        assert http.post("/v1/traces", content=spans.SerializeToString(), headers=PROTOBUF).status_code == 200
        assert await reader().list_runs() == []
        assert http.post("/v1/agl/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]}, headers=header).status_code == 201
    assert [r.name for r in await reader().list_runs()] == ["junk"]


async def test_the_run_limit_is_a_400(server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]) -> None:
    server = server_factory(run=RUN)
    body = {"rollouts": [{"input": 1}]}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for i in range(MAX_RUNS - 1):  # the server's own run is the 256th
            assert http.post("/v1/agl/queues/rollouts/enqueue", json=body, headers={RUN_HEADER: f"r{i}"}).status_code == 201
        over = http.post("/v1/agl/queues/rollouts/enqueue", json=body, headers={RUN_HEADER: "one-more"})
        assert over.status_code == 400 and str(MAX_RUNS) in over.json()["detail"]
        again = http.post("/v1/agl/queues/rollouts/enqueue", json=body, headers={RUN_HEADER: "r0"})
        assert again.status_code == 201  # the runs it serves still work
    assert len(await reader().list_runs()) == MAX_RUNS - 1


async def test_a_huge_span_name_makes_a_small_page(
    server_factory: Callable[..., RunningServer], mp_backend: BackendSpec
) -> None:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    from lightning_sql.server.dashboard.rendering import NAME_CHARS

    rollout_id, attempt_id = await _trainer_run(mp_backend, RUN)
    store = SqlLightningStore(mp_backend.url, **mp_backend.options(run=RUN))
    try:
        context = SpanContext(trace_id=1, span_id=2, is_remote=False, trace_flags=TraceFlags(1))
        await store.add_otel_span(rollout_id, attempt_id, ReadableSpan(name="n" * 10_000_000, context=context))
    finally:
        await store.close()
    server = server_factory(read_only=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        run_id = re.search(r'href="/runs/(\d+)"', http.get("/").text).group(1)  # type: ignore[union-attr]
        pages = [http.get(f"/runs/{run_id}/rollouts/{rollout_id}")]
        rows = pages[0].text.count("n" * (NAME_CHARS - 1) + "…")
        assert pages[0].status_code == 200 and rows >= 1, pages[0].text[-3000:]
        detail = [line for line in pages[0].text.split('href="') if "/spans/" in line]
        assert detail
        pages.append(http.get(detail[0].split('"', 1)[0]))
    for page in pages:
        assert page.status_code == 200 and len(page.content) < 200_000, len(page.content)
        assert "n" * NAME_CHARS not in page.text
