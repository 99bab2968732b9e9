"""The invariant checker itself: silent on consistent runs, loud on every kind of corruption.

Corruption is written with the database's own driver behind the store's back (foreign keys off), as
a bug, a manual edit or a broken restore would leave it.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable

import asyncpg
import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.checker import INVARIANTS, check_invariants, check_url
from tests.conftest import PG_URL, BackendSpec
from tests.faults.support import assert_consistent, make_span


async def _populate(store: SqlLightningStore) -> dict[str, str]:
    """A small run touching every table: queued, claimed, running with spans, succeeded, resources."""
    await store.add_resources({})
    await store.update_resources("res-a", {})
    await store.update_resources("res-a", {})
    claimed, running, done, queued = await store.enqueue_many_rollouts([{"input": i} for i in range(4)])
    ids = {"queued": queued.rollout_id, "claimed": claimed.rollout_id}
    assert [c.rollout_id for c in await store.dequeue_many_rollouts(limit=3, worker_id="w-1")] == [
        claimed.rollout_id,
        running.rollout_id,
        done.rollout_id,
    ]
    run_att = (await store.get_latest_attempt(running.rollout_id)).attempt_id  # type: ignore[union-attr]
    await store.add_many_spans([make_span(running.rollout_id, run_att, k) for k in (1, 2, 3)])
    done_att = (await store.get_latest_attempt(done.rollout_id)).attempt_id  # type: ignore[union-attr]
    await store.update_attempt(done.rollout_id, done_att, status="succeeded", worker_id="w-2")
    ids.update(running=running.rollout_id, running_attempt=run_att, done=done.rollout_id)
    return ids


async def _corrupt(backend: BackendSpec, run: str, statements: list[str]) -> None:
    """Run raw SQL on the backend's database with foreign keys off (``:run`` = the run's id)."""
    if backend.is_postgres:
        conn = await asyncpg.connect(PG_URL)
        try:
            await conn.execute(f'SET search_path TO "{backend.schema}"')
            await conn.execute("SET session_replication_role = replica")  # no FK triggers
            run_id = await conn.fetchval("SELECT run_id FROM runs WHERE name = $1", run)
            for sql in statements:
                await conn.execute(sql.replace(":run", str(run_id)))
        finally:
            await conn.close()
    else:
        path = backend.url.split("///", 1)[1]
        db = sqlite3.connect(path, isolation_level=None)  # foreign keys are off by default
        try:
            (run_id,) = db.execute("SELECT run_id FROM runs WHERE name = ?", (run,)).fetchone()
            for sql in statements:
                db.execute(sql.replace(":run", str(run_id)))
        finally:
            db.close()


CORRUPTIONS: dict[str, tuple[Callable[[dict[str, str]], list[str]], str]] = {
    "queued-without-position": (
        lambda ids: [f"UPDATE rollouts SET queue_seq = NULL WHERE run_id = :run AND rollout_id = '{ids['queued']}'"],
        "queue_seq is set iff status is queuing/requeuing",
    ),
    "claimed-still-in-queue": (
        lambda ids: [f"UPDATE rollouts SET queue_seq = 999999 WHERE run_id = :run AND rollout_id = '{ids['claimed']}'"],
        "queue_seq is set iff status is queuing/requeuing",
    ),
    "duplicate-queue-position": (
        lambda ids: [
            f"UPDATE rollouts SET status = 'queuing', queue_seq = "
            f"(SELECT queue_seq FROM rollouts WHERE run_id = :run AND rollout_id = '{ids['queued']}'), attempt_count = 0 "
            f"WHERE run_id = :run AND rollout_id = '{ids['claimed']}'",
            f"DELETE FROM attempts WHERE run_id = :run AND rollout_id = '{ids['claimed']}'",
        ],
        "queue_seq is unique within the run",
    ),
    "finished-without-end-time": (
        lambda ids: [f"UPDATE rollouts SET end_time = NULL WHERE run_id = :run AND rollout_id = '{ids['done']}'"],
        "finished rollouts have an end_time",
    ),
    "attempt-count-ahead": (
        lambda ids: [f"UPDATE rollouts SET attempt_count = 2 WHERE run_id = :run AND rollout_id = '{ids['claimed']}'"],
        "attempt_count = number of attempts",
    ),
    "sequence-gap": (
        lambda ids: [
            f"UPDATE attempts SET sequence_id = 2 WHERE run_id = :run AND rollout_id = '{ids['claimed']}'",
            f"UPDATE rollouts SET attempt_count = 2 WHERE run_id = :run AND rollout_id = '{ids['claimed']}'",
        ],
        "sequence ids contiguous from 1",
    ),
    "span-counter-behind": (
        lambda ids: [f"UPDATE rollouts SET span_seq = 1 WHERE run_id = :run AND rollout_id = '{ids['running']}'"],
        "span_seq >= the highest span sequence_id",
    ),
    "succeeded-attempt-without-end-time": (
        lambda ids: [f"UPDATE attempts SET end_time = NULL WHERE run_id = :run AND rollout_id = '{ids['done']}'"],
        "succeeded/failed attempts have an end_time",
    ),
    "orphan-attempt": (
        lambda ids: [f"DELETE FROM rollouts WHERE run_id = :run AND rollout_id = '{ids['claimed']}'"],
        "every attempt belongs to an existing rollout",
    ),
    "orphan-span": (
        lambda ids: [f"DELETE FROM attempts WHERE run_id = :run AND attempt_id = '{ids['running_attempt']}'"],
        "every span belongs to an existing attempt",
    ),
    "worker-points-nowhere": (
        lambda ids: ["UPDATE workers SET current_attempt_id = 'at-missing0' WHERE run_id = :run AND worker_id = 'w-1'"],
        "worker current ids name an existing attempt",
    ),
    "busy-worker-without-attempt": (
        lambda ids: [
            "UPDATE workers SET status = 'busy', current_rollout_id = NULL, current_attempt_id = NULL "
            "WHERE run_id = :run AND worker_id = 'w-2'"
        ],
        "a busy worker has one",
    ),
    "bad-status-literal": (
        lambda ids: [f"UPDATE rollouts SET status = 'zombie' WHERE run_id = :run AND rollout_id = '{ids['done']}'"],
        "rollout status is a valid literal",
    ),
    "bad-attempt-status": (
        lambda ids: [f"UPDATE attempts SET status = 'limbo' WHERE run_id = :run AND rollout_id = '{ids['done']}'"],
        "attempt status is a valid literal",
    ),
    "bad-worker-status": (
        lambda ids: ["UPDATE workers SET status = 'asleep' WHERE run_id = :run AND worker_id = 'w-2'"],
        "worker status is a valid literal",
    ),
    "duplicate-create-seq": (
        lambda ids: [
            f"UPDATE rollouts SET create_seq = (SELECT create_seq FROM rollouts WHERE run_id = :run AND rollout_id = '{ids['queued']}') "
            f"WHERE run_id = :run AND rollout_id = '{ids['done']}'"
        ],
        "rollout create_seq is unique within the run",
    ),
    "duplicate-touch-seq": (
        lambda ids: ["UPDATE resources SET touch_seq = (SELECT MIN(touch_seq) FROM resources WHERE run_id = :run) WHERE run_id = :run"],
        "resources touch_seq is unique within the run",
    ),
    "resources-history-lost": (
        lambda ids: ["DELETE FROM resource_versions WHERE run_id = :run AND resources_id = 'res-a' AND version = 1"],
        "resources history holds versions 1..version",
    ),
    "resources-history-orphan": (
        lambda ids: ["DELETE FROM resources WHERE run_id = :run AND resources_id = 'res-a'"],
        "every resources version belongs to existing resources",
    ),
    "rollout-running-attempt-preparing": (
        lambda ids: [f"UPDATE rollouts SET status = 'running' WHERE run_id = :run AND rollout_id = '{ids['claimed']}'"],
        "a preparing/running rollout's latest attempt has the same status",
    ),
    "succeeded-rollout-running-attempt": (
        lambda ids: [f"UPDATE rollouts SET status = 'succeeded', end_time = 1 WHERE run_id = :run AND rollout_id = '{ids['running']}'"],
        "a succeeded rollout's latest attempt succeeded",
    ),
    "queuing-rollout-in-back-off": (
        lambda ids: [f"UPDATE rollouts SET not_before = 5 WHERE run_id = :run AND rollout_id = '{ids['queued']}'"],
        "a rollout in back-off (not_before set, queued) is requeuing",
    ),
    "cancelled-rollout-running-attempt": (
        lambda ids: [f"UPDATE rollouts SET status = 'cancelled', end_time = 1 WHERE run_id = :run AND rollout_id = '{ids['running']}'"],
        "a cancelled rollout has no attempt in flight",
    ),
}


async def test_checker_reports_each_corruption(
    mp_backend: BackendSpec, mp_store_factory: Callable[..., SqlLightningStore]
) -> None:
    """One run per corruption (one database per backend): each is reported, and only in its own run."""
    stores = {}
    for corruption in sorted(CORRUPTIONS):
        store = stores[corruption] = mp_store_factory(run=f"corrupt-{corruption}")
        ids = await _populate(store)
        assert await check_invariants(store) == [], corruption
        statements, _ = CORRUPTIONS[corruption]
        await _corrupt(mp_backend, f"corrupt-{corruption}", statements(ids))
    for corruption, store in stores.items():
        violations = await check_invariants(store)
        assert any(CORRUPTIONS[corruption][1] in v for v in violations), (corruption, violations)
    clean = mp_store_factory(run="clean")
    await _populate(clean)
    assert await check_invariants(clean) == []


def test_every_invariant_has_a_corruption_test() -> None:
    covered = {expected for _, expected in CORRUPTIONS.values()}
    for inv in INVARIANTS:
        if inv.name in {
            "a queuing rollout has no attempt",
            "a requeuing rollout's latest attempt failed, timed out or became unresponsive",
        }:
            continue  # exercised by test_lifecycle_family_is_optional through update_rollout(status=...)
        assert any(exp in inv.name for exp in covered), inv.name


async def test_lifecycle_family_is_optional(store_factory: Callable[..., SqlLightningStore]) -> None:
    """``update_rollout(status=...)`` may set any status: only the lifecycle family objects (every backend)."""
    store = store_factory()
    claimed, fresh = await store.enqueue_many_rollouts([{"input": 1}, {"input": 2}])
    assert (await store.dequeue_rollout()).rollout_id == claimed.rollout_id  # type: ignore[union-attr]
    await store.update_rollout(fresh.rollout_id, status="running")  # no attempt at all
    await store.update_rollout(claimed.rollout_id, status="queuing")  # has an attempt
    violations = await check_invariants(store)
    assert any("a preparing/running rollout's latest attempt" in v and fresh.rollout_id in v for v in violations)
    assert any("a queuing rollout has no attempt" in v and claimed.rollout_id in v for v in violations)
    await store.update_rollout(claimed.rollout_id, status="requeuing")
    assert any("a requeuing rollout's latest attempt" in v for v in await check_invariants(store))
    assert await check_invariants(store, lifecycle=False) == []


async def test_check_url_reads_without_writing(
    mp_backend: BackendSpec, mp_store_factory: Callable[..., SqlLightningStore]
) -> None:
    store = mp_store_factory()
    await _populate(store)
    opts = mp_backend.options()
    assert await check_url(mp_backend.url, "test-run", **opts) == []
    with pytest.raises(ValueError, match="'nope' does not exist"):
        await check_url(mp_backend.url, "nope", **opts)
    assert [r.name for r in await store.list_runs()] == ["test-run"]  # nothing created


async def test_check_is_one_snapshot_under_concurrent_writes(mp_backend: BackendSpec) -> None:
    """Checking a live run never reports a violation made up of two different moments."""
    store = mp_backend.open(run="live", clock_sync=False, scan_debounce_seconds=0)
    try:
        await store.enqueue_many_rollouts([{"input": i} for i in range(60)])
        stop = asyncio.Event()

        async def runner(n: int) -> None:
            while not stop.is_set():
                claimed = await store.dequeue_rollout(worker_id=f"w{n}")
                if claimed is None:
                    return
                rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
                await store.add_many_spans([make_span(rid, aid, k) for k in (1, 2)])
                await store.update_attempt(rid, aid, status="succeeded")

        tasks = [asyncio.create_task(runner(n)) for n in range(4)]
        checks = 0
        while not all(t.done() for t in tasks):
            await assert_consistent(store, when=f"during the run (check {checks})")
            checks += 1
        stop.set()
        await asyncio.gather(*tasks)
        await assert_consistent(store)
        assert checks >= 2
    finally:
        await store.close()
