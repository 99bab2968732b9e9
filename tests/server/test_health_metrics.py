"""``/healthz`` (200 when the database answers, 503 otherwise) and ``/metrics`` (Prometheus text)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from lightning_sql import SqlLightningStore
from lightning_sql.server import ServerConfig
from tests.conftest import BackendSpec
from tests.server.conftest import RUN, RunningServer, serve


def test_healthz_answers_when_the_database_does(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory()
    response = httpx.get(server.url + "/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_healthz_is_503_when_the_database_is_unreachable() -> None:
    # Port 1 on loopback refuses connections at once: a PostgreSQL server that is down.
    config = ServerConfig(url="postgresql://postgres@127.0.0.1:1/postgres", run=RUN, connect_timeout=1.0)
    with serve(config) as server:
        response = httpx.get(server.url + "/healthz", timeout=30)
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "unavailable" and "database" in body["detail"]
        # An API call answers 503 too (the client retries), with a message and no traceback.
        api = httpx.post(server.url + "/v1/agl/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]}, timeout=60)
        assert api.status_code == 503, api.text
        assert "Traceback" not in api.text and api.json()["detail"]
        metrics = httpx.get(server.url + "/metrics", timeout=60).text
        errors = [line for line in metrics.splitlines() if line.startswith("lightning_sql_database_errors_total{")]
        assert errors and sum(float(line.rsplit(" ", 1)[1]) for line in errors) >= 1


def test_metrics_report_queue_rollouts_attempts_and_spans(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory()
    api = server.url + "/v1/agl"
    with httpx.Client(timeout=30) as client:
        enqueued = client.post(api + "/queues/rollouts/enqueue", json={"rollouts": [{"input": i} for i in range(3)]})
        assert enqueued.status_code == 201
        claimed = client.post(api + "/queues/rollouts/dequeue", json={"limit": 2, "worker_id": "w1"}).json()
        assert len(claimed) == 2
        first, second = claimed
        done = client.post(
            f"{api}/rollouts/{first['rollout_id']}/attempts/{first['attempt']['attempt_id']}", json={"status": "succeeded"}
        )
        assert done.status_code == 200 and done.json()["status"] == "succeeded"
        failed = client.post(
            f"{api}/rollouts/{second['rollout_id']}/attempts/{second['attempt']['attempt_id']}", json={"status": "failed"}
        )
        assert failed.status_code == 200
        span = {
            "rollout_id": first["rollout_id"], "attempt_id": first["attempt"]["attempt_id"], "sequence_id": 1,
            "trace_id": "1" * 32, "span_id": "2" * 16, "parent_id": None, "name": "llm", "status": {"status_code": "OK"},
            "attributes": {}, "events": [], "links": [], "start_time": 1.0, "end_time": 2.0, "context": None,
            "parent": None, "resource": {"attributes": {}, "schema_url": ""},
        }  # fmt: skip
        assert client.post(api + "/spans", json=span).status_code == 201
        page = client.get(server.url + "/metrics")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/plain")
    text = page.text
    assert server.metric(text, "lightning_sql_queue_depth", run=RUN) == 1
    assert server.metric(text, "lightning_sql_rollouts", run=RUN, status="queuing") == 1
    assert server.metric(text, "lightning_sql_rollouts", run=RUN, status="succeeded") == 1
    assert server.metric(text, "lightning_sql_rollouts", run=RUN, status="failed") == 1
    assert server.metric(text, "lightning_sql_rollouts", run=RUN, status="running") == 0
    assert server.metric(text, "lightning_sql_attempts_finished_total", run=RUN, status="succeeded") == 1
    assert server.metric(text, "lightning_sql_attempts_finished_total", run=RUN, status="failed") == 1
    assert server.metric(text, "lightning_sql_attempt_duration_seconds_count", run=RUN) == 2
    assert server.metric(text, "lightning_sql_claim_latency_seconds_count", run=RUN) == 2
    assert server.metric(text, "lightning_sql_spans_ingested_total", source="api") == 1
    assert "# TYPE lightning_sql_claim_latency_seconds histogram" in text


async def test_probes_and_scrapes_create_no_run(
    server_factory: Callable[..., RunningServer], mp_backend: BackendSpec
) -> None:
    server = server_factory()
    assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200
    page = httpx.get(server.url + "/metrics", timeout=30)
    assert page.status_code == 200 and server.metric(page.text, "lightning_sql_queue_depth", run=RUN) is None
    store = SqlLightningStore(mp_backend.url, **mp_backend.options(run=None, create_run=False, read_only=True))
    try:
        assert await store.list_runs() == []
    finally:
        await store.close()
