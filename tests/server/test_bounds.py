"""Every count, limit and integer a request carries is bounded: a 400 naming the field and value from
the API, a ``ValueError`` from the store, and nothing changed (SQLite files and PostgreSQL)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.store.sql.filters import MAX_CLAIM_LIMIT
from lightning_sql.types import MAX_INT64
from tests.server.conftest import RUN, RunningServer

API = "/v1/agl"
JSON = {"Content-Type": "application/json"}


def _post(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(API + path, content=body, headers=JSON)


async def test_a_huge_claim_limit_is_refused_at_once(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert _post(http, "/queues/rollouts/enqueue", b'{"rollouts": [{"input": 1}]}').status_code == 201
        for body, shown in [
            (b'{"limit": 4000000}', "4000000"),
            (b'{"limit": 1e9}', "1000000000.0"),
            (b'{"limit": 99999999999999999999999}', "99999999999999999999999"),
        ]:
            started = time.monotonic()
            answer = _post(http, "/queues/rollouts/dequeue", body)
            # Generous: the refusal comes before any claim; building 4 million attempts took seconds.
            assert time.monotonic() - started < 2.0
            assert answer.status_code == 400, answer.text
            assert "limit" in answer.json()["detail"] and shown in answer.json()["detail"]
        assert http.get("/healthz").status_code == 200
        claimed = _post(http, "/queues/rollouts/dequeue", f'{{"limit": {MAX_CLAIM_LIMIT}}}'.encode())
        assert claimed.status_code == 200 and len(claimed.json()) == 1
    assert (await reader().statistics())["queue_depth"] == 0


@pytest.mark.parametrize("name", ["limit", "offset"])
def test_page_integers_past_64_bits_are_a_400(server_factory: Callable[..., RunningServer], name: str) -> None:
    server = server_factory()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert _post(http, "/queues/rollouts/enqueue", b'{"rollouts": [{"input": 1}]}').status_code == 201
        before = http.get("/metrics").text
        for value in ["99999999999999999999999", str(MAX_INT64 + 1)]:
            answer = http.get(API + "/rollouts", params={name: value})
            assert answer.status_code == 400, answer.text
            assert name in answer.json()["detail"] and value in answer.json()["detail"]
            searched = _post(http, "/rollouts/search", f'{{"{name}": {value}}}'.encode())
            assert searched.status_code == 400 and name in searched.json()["detail"]
        assert http.get(API + "/rollouts", params={name: str(MAX_INT64 if name == "offset" else 5)}).status_code == 200
        after = http.get("/metrics").text
    assert server.metric(after, "lightning_sql_database_errors_total", error="DBAPIError") is None
    assert "lightning_sql_database_errors_total{" not in before + after


async def test_integers_past_64_bits_in_values_are_a_400_and_nothing_is_stored(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    big = 2**70
    with httpx.Client(base_url=server.url, timeout=60) as http:
        answer = _post(http, "/queues/rollouts/enqueue", f'{{"rollouts": [{{"input": 1}}, {{"input": {big}}}]}}'.encode())
        assert answer.status_code == 400, answer.text
        assert "input" in answer.json()["detail"] and str(big) in answer.json()["detail"]
        config = _post(http, "/rollouts", f'{{"input": 1, "config": {{"max_attempts": {big}}}}}'.encode())
        assert config.status_code == 400 and "max_attempts" in config.json()["detail"]
        exact = _post(http, "/queues/rollouts/enqueue", f'{{"rollouts": [{{"input": {MAX_INT64}}}]}}'.encode())
        assert exact.status_code == 201
    assert [r.input for r in await reader().query_rollouts()] == [MAX_INT64]


async def test_the_store_refuses_out_of_range_limits_and_values(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory()
    await store.enqueue_rollout(1)
    with pytest.raises(ValueError, match=f"at most {MAX_CLAIM_LIMIT}.*{MAX_CLAIM_LIMIT + 1}"):
        await store.dequeue_many_rollouts(limit=MAX_CLAIM_LIMIT + 1)
    with pytest.raises(ValueError, match="limit"):
        await store.query_rollouts(limit=MAX_INT64 + 1)
    with pytest.raises(ValueError, match="offset"):
        await store.query_spans("ro-x", offset=2**64)
    with pytest.raises(ValueError, match=r"input\['n'\]: integer 1180591620717411303424 is outside"):
        await store.enqueue_rollout({"n": 2**70})
    assert (await store.statistics())["total_rollouts"] == 1 and (await store.statistics())["queue_depth"] == 1


def test_request_lists_are_bounded(server_factory: Callable[..., RunningServer]) -> None:
    from lightning_sql.server.agl_api import MAX_ITEMS_PER_REQUEST

    server = server_factory(run=RUN)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        many = b'{"rollouts": [' + b",".join([b'{"input": 1}'] * (MAX_ITEMS_PER_REQUEST + 1)) + b"]}"
        answer = _post(http, "/queues/rollouts/enqueue", many)
        assert answer.status_code == 400 and str(MAX_ITEMS_PER_REQUEST) in answer.json()["detail"]
        assert http.get(API + "/statistics").json()["total_rollouts"] == 0
