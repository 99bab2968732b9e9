"""Contract §2.14 (update_worker, get_worker_by_id, query_workers) and §2.16 (misc) on every backend."""

from __future__ import annotations

import time

import pytest

from lightning_sql import Worker
from tests.conftest import PERSISTENT_BACKENDS


async def test_update_worker_upserts_a_heartbeat(store, clock):
    w = await store.update_worker("Worker-0")
    assert isinstance(w, Worker)
    assert w == Worker(worker_id="Worker-0", status="unknown", last_heartbeat_time=clock())
    clock.advance(5)
    stats = {"cpu": 0.5, "gpus": [{"mem": 1}]}
    w = await store.update_worker("Worker-0", heartbeat_stats=stats)
    assert w.heartbeat_stats == stats and w.last_heartbeat_time == clock()
    stats["cpu"] = 99  # a copy was stored
    assert (await store.get_worker_by_id("Worker-0")).heartbeat_stats == {"cpu": 0.5, "gpus": [{"mem": 1}]}
    clock.advance(5)
    w = await store.update_worker("Worker-0")  # stats not given: kept
    assert w.heartbeat_stats == {"cpu": 0.5, "gpus": [{"mem": 1}]} and w.last_heartbeat_time == clock()
    w = await store.update_worker("Worker-0", heartbeat_stats={})  # replaced wholesale, {} kept as {}
    assert w.heartbeat_stats == {}


async def test_update_worker_never_changes_status_or_assignment(store, clock):
    r = await store.enqueue_rollout(1)
    ar = await store.dequeue_rollout(worker_id="w")
    busy = await store.get_worker_by_id("w")
    assert busy.status == "busy" and busy.current_rollout_id == r.rollout_id
    clock.advance(3)
    w = await store.update_worker("w", heartbeat_stats={"x": 1})
    assert w.status == "busy"
    assert (w.current_rollout_id, w.current_attempt_id) == (r.rollout_id, ar.attempt.attempt_id)
    assert (w.last_dequeue_time, w.last_busy_time, w.last_idle_time) == (
        busy.last_dequeue_time,
        busy.last_busy_time,
        busy.last_idle_time,
    )
    assert w.last_heartbeat_time == clock()
    # Worker sync from attempts keeps heartbeat fields.
    clock.advance(3)
    await store.update_attempt(r.rollout_id, ar.attempt.attempt_id, status="succeeded")
    w = await store.get_worker_by_id("w")
    assert w.status == "idle" and w.heartbeat_stats == {"x": 1} and w.last_heartbeat_time == clock() - 3
    assert w.current_rollout_id is None and w.last_idle_time == clock()


async def test_update_worker_heartbeat_stats_none_is_a_type_error(store):
    with pytest.raises(TypeError, match="heartbeat_stats"):
        await store.update_worker("w", heartbeat_stats=None)
    assert await store.get_worker_by_id("w") is None
    with pytest.raises(TypeError, match="heartbeat_stats"):
        await store.update_worker("w", heartbeat_stats={"s": {1, 2}})
    with pytest.raises(TypeError, match="heartbeat_stats"):
        await store.update_worker("w", heartbeat_stats=[1, 2])
    assert (await store.statistics())["total_workers"] == 0


async def test_get_worker_by_id(store):
    assert await store.get_worker_by_id("nobody") is None
    await store.update_worker("")  # any str is a worker id
    assert (await store.get_worker_by_id("")).worker_id == ""


async def test_query_workers_filters(store):
    await store.update_worker("alpha-1")  # unknown
    await store.dequeue_rollout(worker_id="beta-1")  # idle (empty queue)
    await store.enqueue_rollout(1)
    await store.dequeue_rollout(worker_id="alpha-2")  # busy
    await store.update_worker("Alpha-3")  # unknown

    def wids(result):
        return [w.worker_id for w in result]

    assert wids(await store.query_workers()) == ["alpha-1", "beta-1", "alpha-2", "Alpha-3"]  # creation order
    assert wids(await store.query_workers(filter_logic="or")) == ["alpha-1", "beta-1", "alpha-2", "Alpha-3"]
    assert wids(await store.query_workers(status_in=["unknown"])) == ["alpha-1", "Alpha-3"]
    assert wids(await store.query_workers(status_in=["idle", "busy"])) == ["beta-1", "alpha-2"]
    assert wids(await store.query_workers(status_in=[])) == []
    assert wids(await store.query_workers(worker_id_contains="alpha")) == ["alpha-1", "alpha-2"]
    assert wids(await store.query_workers(worker_id_contains="alpha", status_in=["busy"])) == ["alpha-2"]
    got = await store.query_workers(worker_id_contains="beta", status_in=["busy"], filter_logic="or")
    assert wids(got) == ["beta-1", "alpha-2"]
    assert wids(await store.query_workers(status_in=[], worker_id_contains="Alpha", filter_logic="or")) == [
        "Alpha-3"
    ]
    page = await store.query_workers(sort_by="worker_id", limit=2, offset=1)
    assert wids(page) == ["alpha-1", "alpha-2"] and page.total == 4


# --- §2.16 misc ------------------------------------------------------------------------------------


async def test_statistics(store):
    stats = await store.statistics()
    assert stats["name"] == "SqlLightningStore"
    for key in (
        "total_rollouts",
        "total_attempts",
        "total_spans",
        "total_resources",
        "total_workers",
        "queue_depth",
    ):
        assert stats[key] == 0, key
    assert stats["uptime"] >= 0
    await store.enqueue_rollout(1)
    await store.enqueue_rollout(2)
    ar = await store.start_rollout(3, worker_id="w")
    await store.start_attempt(ar.rollout_id)
    await store.update_resources("r", {})
    await store.update_resources("r", {})
    stats = await store.statistics()
    assert (stats["total_rollouts"], stats["total_attempts"], stats["total_resources"]) == (3, 2, 1)
    assert (stats["total_workers"], stats["queue_depth"]) == (1, 2)
    before = stats["uptime"]
    time.sleep(0.01)
    assert (await store.statistics())["uptime"] > before


# Two runs in one database: an in-memory database belongs to one store instance (one run).
@pytest.mark.parametrize("backend", PERSISTENT_BACKENDS, indirect=True)
async def test_statistics_are_scoped_to_the_run(store_factory):
    a = store_factory(run="run-a")
    b = store_factory(run="run-b")
    await a.enqueue_rollout(1)
    await a.update_worker("w")
    stats = await b.statistics()
    assert (stats["total_rollouts"], stats["total_workers"], stats["queue_depth"]) == (0, 0, 0)
    await b.start_rollout(2, worker_id="w")
    await b.enqueue_rollout(3)
    stats = await a.statistics()
    assert (stats["total_rollouts"], stats["total_attempts"], stats["total_workers"], stats["queue_depth"]) == (1, 0, 1, 1)
    stats = await b.statistics()
    assert (stats["total_rollouts"], stats["total_attempts"], stats["total_workers"], stats["queue_depth"]) == (2, 1, 1, 1)


