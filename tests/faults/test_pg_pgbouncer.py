"""The store behind PgBouncer in transaction pooling mode (Debian's pgbouncer, started by the test).

In transaction mode a server connection serves a client for one transaction only: prepared statements,
SET and LISTEN do not carry over.  So the store either LISTENs on a direct connection
(``listen_url=``, the cluster itself) or polls (``listen=False``), and runs everything else through
the bouncer.  PgBouncer here has 2 server connections per database and user, so the store's
concurrent units share them transaction by transaction.

Guarantees, for both ways of waiting:
* enqueue, claim, span writes (single and batched), sequence ids, heartbeats, attempt reports, reads
  and waits (``wait_for_rollouts`` and ``wait_for_queue``) all work through the bouncer, from two
  store instances at once, and the run is consistent afterwards;
* the store goes round the bouncer only to LISTEN: at most one direct connection per store with
  ``listen_url=``, none with ``listen=False`` (counted from this process's TCP connections).

Size knob: LIGHTNING_SQL_FAULT_BOUNCER_ROLLOUTS (CI 40, full 500).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import psutil
import pytest

from lightning_sql import SqlLightningStore
from tests.faults.servers import PgBouncer, ThrowawayPostgres, sample_max
from tests.faults.support import assert_consistent, make_span, sized

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

BOUNCER_USERS = ("postgres", "bounced")
BOUNCER_POOL_SIZE = 2
ROLE = "bounced"
N_RUNNERS = 8
WAIT_TIMEOUT_S = 60.0  # generous: a waiter wakes on NOTIFY, or at its next poll

T = TypeVar("T")


@pytest.fixture(scope="module")
def role_database(throwaway_pg: ThrowawayPostgres) -> str:
    """The role's direct URL of its own database (the bouncer forwards the same role and database)."""
    return asyncio.run(throwaway_pg.role_with_database(ROLE))


def direct_connections(server_port: int) -> int:
    """This process's open TCP connections to the cluster itself (not to the bouncer)."""
    process = psutil.Process()
    listing = getattr(process, "net_connections", None) or process.connections  # psutil < 6: connections()
    return sum(
        1
        for conn in listing(kind="tcp")
        if conn.raddr and conn.raddr.port == server_port and conn.status == psutil.CONN_ESTABLISHED
    )


async def _through_the_bouncer(producer: SqlLightningStore, consumer: SqlLightningStore) -> None:
    n_rollouts = int(sized("LIGHTNING_SQL_FAULT_BOUNCER_ROLLOUTS", 40, 500))
    waiters: list[asyncio.Task[Any]] = []
    try:
        finished = await _enqueue_claim_and_wait(producer, consumer, n_rollouts, waiters)
    finally:
        for task in waiters:  # a failure above leaves a waiter behind: end it with the test
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
    ids = [r.rollout_id for r in finished]
    for rid in ids[:5]:
        assert [s.sequence_id for s in await producer.query_spans(rid)] == [1, 2, 3]
    stats = await producer.statistics()
    assert stats["total_rollouts"] == n_rollouts and stats["total_spans"] == 3 * n_rollouts
    await assert_consistent(producer)


async def _enqueue_claim_and_wait(
    producer: SqlLightningStore, consumer: SqlLightningStore, n_rollouts: int, waiters: list[asyncio.Task[Any]]
) -> list[Any]:
    queue_woke = asyncio.create_task(consumer.wait_for_queue(WAIT_TIMEOUT_S))
    waiters.append(queue_woke)
    await asyncio.sleep(0.2)  # the waiter is waiting before the work arrives
    first = await producer.enqueue_rollout({"i": 0})
    rest = await producer.enqueue_many_rollouts([{"input": {"i": i}} for i in range(1, n_rollouts)])
    ids = [first.rollout_id, *(r.rollout_id for r in rest)]
    assert await asyncio.wait_for(queue_woke, WAIT_TIMEOUT_S + 5) is True
    all_done = asyncio.create_task(producer.wait_for_rollouts(rollout_ids=ids, timeout=WAIT_TIMEOUT_S))
    waiters.append(all_done)

    async def runner(n: int) -> None:
        while (claimed := await consumer.dequeue_rollout(worker_id=f"bounced-{n}")) is not None:
            rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
            await consumer.add_span(make_span(rid, aid, 1))
            await consumer.touch_attempt(rid, aid)
            await consumer.add_many_spans([make_span(rid, aid, k) for k in (2, 3)])
            assert await consumer.get_next_span_sequence_id(rid, aid) == 4
            await consumer.update_attempt(rid, aid, status="succeeded")

    await asyncio.gather(*(runner(n) for n in range(N_RUNNERS)))
    finished = list(await asyncio.wait_for(all_done, WAIT_TIMEOUT_S + 5))
    assert sorted(r.rollout_id for r in finished) == sorted(ids), "the waiter returned before every rollout ended"
    assert {r.status for r in finished} == {"succeeded"}
    return finished


async def _watch_direct(server_port: int, work: Awaitable[T]) -> tuple[T, int]:
    stop = asyncio.Event()

    async def probe() -> int:
        return direct_connections(server_port)

    sampler = asyncio.create_task(sample_max(probe, stop))
    try:
        result = await work
    finally:
        stop.set()
        peak = await sampler
    return result, peak


async def _scenario(throwaway_pg: ThrowawayPostgres, pgbouncer: PgBouncer, run: str, **options: Any) -> int:
    bouncer_url = pgbouncer.url(user=ROLE, database=ROLE)
    producer = SqlLightningStore(bouncer_url, run=run, **options)
    consumer = SqlLightningStore(bouncer_url, run=run, **options)
    try:
        _, peak = await _watch_direct(throwaway_pg.port, _through_the_bouncer(producer, consumer))
    finally:
        await producer.close()
        await consumer.close()
    print(f"\n[pgbouncer] run {run}: at most {peak} direct connection(s); bouncer log tail:\n"
          + "\n".join(pgbouncer.log_text().splitlines()[-3:]))
    return peak


async def test_store_through_pgbouncer_listens_on_a_direct_connection(
    throwaway_pg: ThrowawayPostgres, pgbouncer: PgBouncer, role_database: str
) -> None:
    peak = await _scenario(throwaway_pg, pgbouncer, "listen-direct", listen_url=role_database)
    assert peak <= 2, f"{peak} direct connections: only the two stores' LISTEN connections may bypass the bouncer"


async def test_store_through_pgbouncer_polls_when_told_not_to_listen(
    throwaway_pg: ThrowawayPostgres, pgbouncer: PgBouncer, role_database: str
) -> None:
    peak = await _scenario(throwaway_pg, pgbouncer, "polling", listen=False)
    assert peak == 0, f"{peak} direct connections with listen=False: everything must go through the bouncer"
