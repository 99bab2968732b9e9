"""Round trips per store call on PostgreSQL, counted on the wire.

The store reaches PostgreSQL through a TCP proxy (``WireCounter``) that forwards every byte unchanged
and parses the frontend/backend protocol on the way: a round trip is one ``ReadyForQuery`` message
from the server (the end of every simple query and of every extended-protocol ``Sync``; a client
waits for it before it goes on).  The LISTEN connection is left out (its keep-alive is not a call's
cost).  Nothing is mocked: the database answers every message.

Guarantees:
* a read unit costs the pool's pre-ping plus its statements: no BEGIN/COMMIT (autocommit under READ
  COMMITTED sees what a READ COMMITTED transaction would: every statement takes its own snapshot);
* the pre-ping is one round trip, also before a write unit (not BEGIN + ping + ROLLBACK);
* a write unit is one transaction: BEGIN, its statements, its notifications in one statement, COMMIT;
  except the claim, a one-rollout sequence-id reservation and spans of one attempt, which are
  one statement each without BEGIN/COMMIT (concurrent span adds of one attempt each: one for all;
  concurrent claims of distinct workers: one for all, their worker rows included);
  ``enqueue_many_rollouts`` inserts all its rollouts with one statement; ``update_attempt`` is
  BEGIN, one statement locking its rows, one writing them (with the notification), COMMIT; an
  update of a concrete attempt to a status its rollout's follows one to one (preparing, running,
  succeeded) is one statement without BEGIN/COMMIT, awaited alone, and so are such updates of
  distinct rollouts issued in the same loop turn, all in one;
* the invariant checker still reads in one REPEATABLE READ READ ONLY transaction.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import make_url, text

from lightning_sql import EnqueueRolloutRequest, RolloutConfig, SqlLightningStore
from lightning_sql.store.sql import engine as engine_module
from lightning_sql.store.sql.check import check_invariants
from lightning_sql.store.sql.engine import UnitContext, notify_channel
from tests.conftest import PG_URL, BackendSpec
from tests.contract.test_spans import make_span
from tests.helpers import FakeClock, pg_execute

pytestmark = pytest.mark.postgres

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


def _take_message(buf: bytearray) -> tuple[str, bytes] | None:
    """Remove one complete protocol message (type byte, length, body) from ``buf``; None if incomplete."""
    if len(buf) < 5:
        return None
    (length,) = struct.unpack("!I", buf[1:5])
    if len(buf) < 1 + length:
        return None
    kind, body = chr(buf[0]), bytes(buf[5 : 1 + length])
    del buf[: 1 + length]
    return kind, body


@dataclass(eq=False)
class WireConn:
    """One client connection: is it past its startup message, is it the LISTEN connection, the text
    of its prepared statements, and its two sockets."""

    started_up: bool = False
    listener: bool = False
    prepared: dict[str, str] = field(default_factory=dict)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


@dataclass
class WireCounts:
    """What the pool's connections sent and waited for (in wire order, over all of them)."""

    ready: int = 0  # ReadyForQuery messages from the server = round trips
    queries: list[str] = field(default_factory=list)  # simple-protocol Query texts (BEGIN, COMMIT, ...)
    parses: list[str] = field(default_factory=list)  # extended-protocol Parse texts (statements prepared)
    statements: list[str] = field(default_factory=list)  # extended-protocol Bind: the statements run


class WireCounter:
    """A TCP proxy in front of PostgreSQL that counts round trips per client connection."""

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._lock = threading.Lock()
        # (connection, message kind, text) in wire order: "Q" query, "P" parse, "B" bind, "Z" ready.
        self.log: list[tuple[WireConn, str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._main, name="wire-counter", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the wire counter did not start")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._listen())
        self._started.set()
        self._loop.run_forever()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def mark(self) -> int:
        with self._lock:
            return len(self.log)

    def since(self, mark: int) -> WireCounts:
        """What every connection but the LISTEN one sent and waited for since ``mark``."""
        out = WireCounts()
        with self._lock:
            entries = self.log[mark:]
        for conn, kind, what in entries:
            if conn.listener:
                continue
            if kind == "Z":
                out.ready += 1
            elif kind == "Q":
                out.queries.append(what)
            elif kind == "P":
                out.parses.append(what)
            elif kind == "B":
                out.statements.append(what)
        return out

    def drop_all(self) -> None:
        """Cut every connection open now, as a network failure or a server restart would."""

        async def drop() -> None:
            with self._lock:
                conns = {conn for conn, _, _ in self.log}
            for conn in conns:
                for writer in conn.writers:
                    writer.transport.abort()

        asyncio.run_coroutine_threadsafe(drop(), self._loop).result(5)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_w.close()
            return
        stats = WireConn(writers=[client_w, server_w])
        with self._lock:
            self.log.append((stats, "C", ""))  # connected
        single_byte_replies = [0]  # SSL/GSS requests the server answers with one untyped byte
        await asyncio.gather(
            self._pump(client_r, server_w, lambda buf: self._from_client(buf, stats, single_byte_replies)),
            self._pump(server_r, client_w, lambda buf: self._from_server(buf, stats, single_byte_replies)),
            return_exceptions=True,
        )

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, parse: Any) -> None:
        buf = bytearray()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
                parse(buf)  # before forwarding: a reply cannot overtake its request's bookkeeping
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def _from_client(self, buf: bytearray, stats: WireConn, single: list[int]) -> None:
        while True:
            if not stats.started_up:
                if len(buf) < 8:
                    return
                (length,) = struct.unpack("!I", buf[:4])
                if len(buf) < length:
                    return
                (code,) = struct.unpack("!I", buf[4:8])
                del buf[:length]
                if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                    single[0] += 1
                else:
                    stats.started_up = True
                continue
            message = _take_message(buf)
            if message is None:
                return
            kind, body = message
            if kind in "QPB":
                if kind == "Q":
                    text = body.split(b"\0", 1)[0].decode()
                elif kind == "P":
                    name, text = (part.decode() for part in body.split(b"\0")[:2])
                    stats.prepared[name] = text
                else:
                    text = stats.prepared.get(body.split(b"\0")[1].decode(), "?")
                if text.lstrip().upper().startswith("LISTEN"):
                    stats.listener = True
                with self._lock:
                    self.log.append((stats, kind, text))

    def _from_server(self, buf: bytearray, stats: WireConn, single: list[int]) -> None:
        while True:
            if single[0]:
                if not buf:
                    return
                assert buf[0:1] == b"N", "the wire counter cannot read an encrypted stream"
                del buf[:1]
                single[0] -= 1
                continue
            message = _take_message(buf)
            if message is None:
                return
            kind, _body = message
            if kind == "Z":
                with self._lock:
                    self.log.append((stats, "Z", ""))


@pytest.fixture
def wire(pg_backend: BackendSpec) -> Iterator[tuple[WireCounter, str, str]]:
    """(counter, proxied URL, schema): the test's PostgreSQL schema reached through the counter."""
    url = make_url(PG_URL)
    counter = WireCounter(url.host or "127.0.0.1", url.port or 5432)
    try:
        assert pg_backend.schema is not None
        yield counter, url.set(host="127.0.0.1", port=counter.port).render_as_string(False), pg_backend.schema
    finally:
        counter.close()


@pytest.fixture
def wire_own_database(wire: tuple[WireCounter, str, str]) -> Iterator[tuple[WireCounter, str, str]]:
    """``wire`` on a database of its own: NOTIFY is per database, and a test that counts
    notifications must not hear other stores (another test run, a benchmark) on the shared one."""
    counter, url, schema = wire
    name = f"lsql_notify_{uuid.uuid4().hex[:10]}"
    asyncio.run(pg_execute(PG_URL, f'CREATE DATABASE "{name}"'))
    try:
        yield counter, make_url(url).set(database=name).render_as_string(False), schema
    finally:
        asyncio.run(pg_execute(PG_URL, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _listen_url(store_url: str) -> str:
    """The database of ``store_url``, reached directly (not through the counter)."""
    return (
        make_url(PG_URL)
        .set(drivername="postgresql", database=make_url(store_url).database)
        .render_as_string(False)
    )


async def _measure(counter: WireCounter, call: Any, n: int) -> tuple[float, WireCounts]:
    """Round trips per call of ``n`` sequential calls, and what they sent."""
    mark = counter.mark()
    for i in range(n):
        await call(i)
    delta = counter.since(mark)
    return delta.ready / n, delta


def _open(url: str, schema: str, **kwargs: Any) -> SqlLightningStore:
    kwargs.setdefault("clock_sync", False)
    kwargs.setdefault("scan_debounce_seconds", 3600)  # no lazy sweep inside a measured call
    return SqlLightningStore(url, run="round-trips", schema=schema, **kwargs)


async def _listening(url: str, schema: str, payloads: list[str]) -> Any:
    """A LISTEN connection of its own on the store's channel, appending each payload to ``payloads``."""
    import asyncpg

    listener = await asyncpg.connect(_listen_url(url))
    try:
        await listener.add_listener(notify_channel(schema), lambda *args: payloads.append(args[3]))
    except BaseException:
        await listener.close()
        raise
    return listener


def _is_ping(statement: str) -> bool:
    return statement.strip() == ";"  # SQLAlchemy's asyncpg pre-ping


async def test_a_read_is_its_statements_with_a_ping_only_after_a_rest(
    wire: tuple[WireCounter, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        await store.update_worker("w1")
        for _ in range(3):  # warm: the pool's connection has prepared the statements
            assert await store.get_worker_by_id("w1") is not None
        per_call, seen = await _measure(counter, lambda i: store.get_worker_by_id("w1"), 20)
        # No BEGIN/COMMIT (nor the BEGIN/ROLLBACK a pre-ping costs outside autocommit), and no ping
        # for a connection back in the pool a moment ago: the SELECT, one round trip.
        assert seen.queries == []
        assert seen.parses == []
        assert not any(_is_ping(st) for st in seen.statements)
        assert per_call == 1, seen
        # A connection that rested longer than PG_PRE_PING_IDLE_S is pinged first (one round trip).
        monkeypatch.setattr(engine_module, "PG_PRE_PING_IDLE_S", 0.0)
        per_call, seen = await _measure(counter, lambda i: store.get_worker_by_id("w1"), 20)
        assert seen.queries == []
        assert [_is_ping(st) for st in seen.statements] == [True, False] * 20
        assert per_call == 2, seen
    finally:
        await store.close()


async def test_a_span_query_is_one_statement_on_the_kept_connection_pinged_after_a_rest(
    wire: tuple[WireCounter, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``query_spans`` without pagination runs on the home engine's kept connection (ADR 0005
    decision 14): its statement, one round trip; after a rest over ``PG_PRE_PING_IDLE_S`` the
    ping a checkout would send first; on a connection the network dropped, the read's unit answers
    (it checks out another connection) and the next read keeps a new one."""
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        ar = await store.start_rollout({"i": 1})
        await store.add_many_spans([make_span(ar.rollout_id, ar.attempt.attempt_id, i) for i in (1, 2, 3)])
        for _ in range(3):
            assert len(await store.query_spans(ar.rollout_id)) == 3
        per_call, seen = await _measure(counter, lambda i: store.query_spans(ar.rollout_id), 20)
        assert seen.queries == [] and seen.parses == []
        assert not any(_is_ping(st) for st in seen.statements)
        assert per_call == 1, seen
        monkeypatch.setattr(engine_module, "PG_PRE_PING_IDLE_S", 0.0)
        per_call, seen = await _measure(counter, lambda i: store.query_spans(ar.rollout_id), 20)
        assert [_is_ping(st) for st in seen.statements] == [True, False] * 20
        assert per_call == 2, seen
        monkeypatch.setattr(engine_module, "PG_PRE_PING_IDLE_S", 3600.0)
        for _ in range(3):
            counter.drop_all()
            await asyncio.sleep(0.05)
            assert [s.sequence_id for s in await store.query_spans(ar.rollout_id)] == [1, 2, 3]
            assert [s.sequence_id for s in await store.query_spans(ar.rollout_id, "latest")] == [1, 2, 3]
    finally:
        await store.close()


async def test_a_write_is_one_transaction(wire: tuple[WireCounter, str, str]) -> None:
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        for _ in range(3):
            await store.update_worker("w1")
        per_call, seen = await _measure(counter, lambda i: store.update_worker("w1"), 20)
        begins = [q for q in seen.queries if q.upper().startswith("BEGIN")]
        assert len(begins) == 20 and all("READ ONLY" not in q.upper() for q in begins), seen.queries
        assert [q for q in seen.queries if not q.upper().startswith("BEGIN")] == ["COMMIT;"] * 20
        assert not any(_is_ping(st) for st in seen.statements)  # the connection rested a moment only
        # Round trips: BEGIN, the unit's statements, COMMIT; nothing else.
        assert seen.ready == len(seen.statements) + 2 * 20, seen
        assert per_call == 2 + len(seen.statements) / 20  # BEGIN, COMMIT + statements
    finally:
        await store.close()


async def test_enqueueing_many_rollouts_costs_the_round_trips_of_one(wire: tuple[WireCounter, str, str]) -> None:
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"warm": True})])
        mark = counter.mark()
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"task": 0})])
        one = counter.since(mark)
        mark = counter.mark()
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"task": i}) for i in range(500)])
        many = counter.since(mark)
        # One INSERT for all 500 (not one per row): the same round trips as a call of one.
        assert many.ready == one.ready, (one, many)
        assert len([st for st in many.statements if st.lstrip().upper().startswith("INSERT")]) == 1, many
        # With idempotency keys, repeated and not: each repeat gets the rollout of its first request,
        # and what came back is what is stored.
        requests = [
            EnqueueRolloutRequest(input={"task": i}, idempotency_key=f"k{i % 400}" if i % 2 else None)
            for i in range(500)
        ]
        created = await store.enqueue_many_rollouts(requests)
        assert created[401].rollout_id == created[1].rollout_id and created[403].rollout_id == created[3].rollout_id
        assert (await store.enqueue_many_rollouts(requests[1:2]))[0].rollout_id == created[1].rollout_id
        stored = {r.rollout_id: r for r in await store.query_rollouts()}
        assert len(stored) == 2 + 500 + 250 + 200
        for request, rollout in zip(requests, created, strict=True):
            assert stored[rollout.rollout_id] == rollout
            assert rollout.idempotency_key == request.idempotency_key
            assert rollout.input == request.input or request.idempotency_key is not None
    finally:
        await store.close()


async def test_reserving_sequence_ids_of_one_rollout_is_one_statement(
    wire: tuple[WireCounter, str, str],
) -> None:
    """The tracer's reservation (one rollout): one UPDATE ... RETURNING, no BEGIN or COMMIT; pairs
    of several rollouts stay one transaction (an unknown rollout among them changes nothing)."""
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(2)])
        first = await store.dequeue_rollout(worker_id="w1")
        second = await store.dequeue_rollout(worker_id="w1")
        assert first is not None and second is not None
        one = (first.rollout_id, first.attempt.attempt_id)
        for _ in range(3):
            await store.get_many_span_sequence_ids([one] * 4)
        per_call, seen = await _measure(counter, lambda i: store.get_many_span_sequence_ids([one] * 4), 10)
        assert seen.queries == [] and per_call == 1, seen
        assert list(await store.get_many_span_sequence_ids([one] * 2)) == [
            53,
            54,
        ]  # (3 + 10) * 4 reserved before
        two = (second.rollout_id, second.attempt.attempt_id)
        per_call, seen = await _measure(counter, lambda i: store.get_many_span_sequence_ids([one, two]), 1)
        assert [q.split()[0] for q in seen.queries] == ["BEGIN", "COMMIT;"], seen.queries
        with pytest.raises(ValueError, match="not found"):
            await store.get_many_span_sequence_ids([two, ("missing", "a")])
        assert list(await store.get_many_span_sequence_ids([two])) == [2]  # the failed call reserved nothing
    finally:
        await store.close()


async def test_spans_of_one_attempt_are_one_statement(wire: tuple[WireCounter, str, str]) -> None:
    """add_span / add_many_spans for one attempt: ONE statement (locks, insert, heartbeat, counter and
    promotion together), no BEGIN or COMMIT, with the plain path's outcome; several attempts stay
    one transaction, and a missing rollout or attempt writes nothing."""
    counter, url, schema = wire
    clock = FakeClock(1000.0)
    store = _open(url, schema, clock=clock)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(2)])
        first = await store.dequeue_rollout(worker_id="w1")
        second = await store.dequeue_rollout(worker_id="w1")
        assert first is not None and second is not None
        rid, aid = first.rollout_id, first.attempt.attempt_id
        await store.add_span(make_span(rid, aid, 1))  # warm: the connection prepares the statement
        clock.advance(5.0)
        batches = [[make_span(rid, aid, 2 + 10 * i + k) for k in range(10)] for i in range(5)]
        per_call, seen = await _measure(counter, lambda i: store.add_many_spans(batches[i]), 5)
        assert seen.queries == [] and seen.parses == [], seen
        assert per_call == 1, seen
        stored = await store.query_spans(rid, aid)
        assert [sp.sequence_id for sp in stored] == list(range(1, 52))
        assert stored[5].attributes == batches[0][4].attributes
        attempt = await store.get_latest_attempt(rid)
        assert attempt is not None and attempt.status == "running" and attempt.last_heartbeat_time == 1005.0
        assert (await store.get_rollout_by_id(rid)).status == "running"  # type: ignore[union-attr]
        # Explicit sequence ids past the counter move it; repeats (in the batch or stored) are skipped.
        again = make_span(rid, aid, 80)
        per_call, seen = await _measure(
            counter, lambda i: store.add_many_spans([again, batches[0][0], again, make_span(rid, aid, 90)]), 1
        )
        assert seen.queries == [] and per_call == 1, seen
        assert [sp.sequence_id for sp in await store.query_spans(rid, aid)][-2:] == [80, 90]
        assert await store.get_next_span_sequence_id(rid, aid) == 91
        # Missing rollout / attempt: the plain path's errors, nothing written, still one statement.
        with pytest.raises(ValueError, match="Rollout missing not found"):
            await store.add_span(make_span("missing", aid, 1))
        with pytest.raises(ValueError, match=f"Attempt missing not found for rollout {rid}"):
            await store.add_span(make_span(rid, "missing", 1))
        assert len(await store.query_spans(rid, None)) == 53
        # Two attempts in one call: one transaction, as before.
        both = [make_span(rid, aid, 100), make_span(second.rollout_id, second.attempt.attempt_id, 1)]
        per_call, seen = await _measure(counter, lambda i: store.add_many_spans(both), 1)
        assert [q.split()[0] for q in seen.queries] == ["BEGIN", "COMMIT;"], seen.queries
        rollout = await store.get_rollout_by_id(second.rollout_id)
        assert rollout is not None and rollout.status == "running"
    finally:
        await store.close()
        clock.remove()


async def test_concurrent_spans_of_several_attempts_are_one_statement(wire: tuple[WireCounter, str, str]) -> None:
    """Span adds of one attempt each issued in the same loop turn (runners streaming spans, or
    writing a rollout's spans at once): ONE statement for them all, no BEGIN or COMMIT
    (``spans.add_spans_batch``)."""
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(8)])
        claimed = [await store.dequeue_rollout(worker_id=f"w{i}") for i in range(8)]
        pairs = [(ar.rollout_id, ar.attempt.attempt_id) for ar in claimed if ar is not None]
        assert len(pairs) == 8
        for seq in (1, 2):  # warm: the connection prepares the statement
            await asyncio.gather(*(store.add_span(make_span(rid, aid, seq)) for rid, aid in pairs))
        mark = counter.mark()
        added = await asyncio.gather(*(store.add_span(make_span(rid, aid, 3)) for rid, aid in pairs))
        seen = counter.since(mark)
        assert all(span is not None for span in added)
        assert seen.queries == [] and seen.parses == [], seen
        assert seen.ready == 1 and len(seen.statements) == 1, seen
        for rid, aid in pairs:
            assert [sp.sequence_id for sp in await store.query_spans(rid, aid)] == [1, 2, 3]
        # add_many_spans of one attempt each (runners writing a rollout's spans at once): one too.
        mark = counter.mark()
        added = await asyncio.gather(
            *(store.add_many_spans([make_span(rid, aid, seq) for seq in (4, 5, 6)]) for rid, aid in pairs)
        )
        seen = counter.since(mark)
        assert [len(spans) for spans in added] == [3] * 8
        assert seen.queries == [] and seen.ready == len(seen.parses) + 1 and len(seen.statements) == 1, seen
        for rid, aid in pairs:
            assert [sp.sequence_id for sp in await store.query_spans(rid, aid)] == [1, 2, 3, 4, 5, 6]
    finally:
        await store.close()


async def test_spans_of_several_attempts_in_one_call_insert_in_one_round_trip(
    wire: tuple[WireCounter, str, str],
) -> None:
    """``add_many_spans`` of spans of several attempts (a transaction: locks, counters, the insert,
    heartbeats): its INSERT ... RETURNING of N rows is one round trip (SQLAlchemy's multi-row
    batching, which ``fastexec`` leaves many-row statements to on PostgreSQL), not one per row."""
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(3)])
        claimed = [await store.dequeue_rollout(worker_id=f"w{i}") for i in range(3)]
        pairs = [(ar.rollout_id, ar.attempt.attempt_id) for ar in claimed if ar is not None]

        def spans(first: int, n: int) -> list[Any]:
            return [make_span(rid, aid, seq) for rid, aid in pairs for seq in range(first, first + n)]

        await store.add_many_spans(spans(1, 2))  # warm: the connection prepares the statements
        mark = counter.mark()
        await store.add_many_spans(spans(3, 1))
        few = counter.since(mark)
        mark = counter.mark()
        added = await store.add_many_spans(spans(4, 20))
        many = counter.since(mark)
        assert len(added) == 60
        assert many.ready == few.ready, (few, many)  # 60 rows cost what 3 do
        for rid, aid in pairs:
            assert [sp.sequence_id for sp in await store.query_spans(rid, aid)] == list(range(1, 24))
    finally:
        await store.close()


def test_the_span_batch_locks_in_the_id_columns_order() -> None:
    """The batch statement sorts the rollout ids, and the (rollout, attempt) pairs, it locks as the
    id columns do (COLLATE "C"), not in the database's default collation: every statement that
    locks several rollouts must take them in one order, or two of them can deadlock."""
    from sqlalchemy.dialects import postgresql

    from lightning_sql.store.sql import dialect as d

    sql = " ".join(str(d._span_ingest_many_statement().compile(dialect=postgresql.asyncpg.dialect())).split())
    assert 'SELECT DISTINCT wanted.rollout_id COLLATE "C" AS rollout_id FROM wanted ORDER BY rollout_id' in sql
    assert 'ORDER BY wanted.rollout_id COLLATE "C", wanted.attempt_id COLLATE "C"' in sql
    assert sql.count("FOR UPDATE") == 2 and sql.count("LIMIT") >= 2  # one keyed look-up per lock


async def test_a_claim_is_one_statement_without_a_transaction(wire: tuple[WireCounter, str, str]) -> None:
    """dequeue: ONE statement (rollout, attempt and worker row together), no BEGIN or COMMIT; on an
    empty queue the idle marking is in that statement too (the direct write of the home loop, ADR
    0005 decision 15), or a second one, also without a transaction (the claim's unit)."""
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(23)])
        for _ in range(3):
            assert await store.dequeue_rollout(worker_id="w1") is not None
        per_call, seen = await _measure(counter, lambda i: store.dequeue_rollout(worker_id="w1"), 20)
        assert seen.queries == [] and seen.parses == [], seen
        assert not any(_is_ping(st) for st in seen.statements)
        assert per_call == 1, seen
        worker = await store.get_worker_by_id("w1")
        assert worker is not None and worker.status == "busy" and worker.current_rollout_id is not None
        latest = await store.get_latest_attempt(worker.current_rollout_id)
        assert latest is not None and latest.attempt_id == worker.current_attempt_id
        assert await store.dequeue_rollout(worker_id="w1") is None
        home = store._worker._home  # type: ignore[union-attr]
        for direct in (True, False):
            writer = home.writer
            if not direct:
                home.writer = None  # as LIGHTNING_SQL_PG_DIRECT_WRITES=0
            try:
                await store.enqueue_rollout({"last": direct})
                assert await store.dequeue_rollout(worker_id="w1") is not None  # w1 busy again
                per_call, seen = await _measure(counter, lambda i: store.dequeue_rollout(worker_id="w1"), 5)
            finally:
                home.writer = writer
            # The claim (nothing) with the idle marking; the unit: the claim, then the marking.
            assert seen.queries == [] and per_call == (1 if direct else 2), (direct, seen)
            assert (await store.get_worker_by_id("w1")).status == "idle"  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_concurrent_claims_of_distinct_workers_are_one_statement(wire: tuple[WireCounter, str, str]) -> None:
    """dequeue calls of distinct workers in one loop turn: ONE statement for all of them, worker rows
    (busy, or idle on an empty queue) included, no BEGIN or COMMIT; a worker named twice: one
    transaction (BEGIN, the claim, the worker rows, COMMIT)."""
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(30)])

        async def turn(workers: list[str]) -> list[Any]:
            return list(await asyncio.gather(*(store.dequeue_rollout(worker_id=w) for w in workers)))

        await turn(["w0", "w1"])  # warm: the connection prepares the statement
        mark = counter.mark()
        claimed = await turn([f"w{i}" for i in range(8)])
        seen = counter.since(mark)
        assert all(ar is not None for ar in claimed)
        assert seen.queries == [] and seen.ready == 1, seen
        workers = {w.worker_id: w for w in await store.query_workers()}
        for i, ar in enumerate(claimed):
            assert workers[f"w{i}"].status == "busy" and workers[f"w{i}"].current_attempt_id == ar.attempt.attempt_id

        mark = counter.mark()
        await turn(["w0", "w1", "w0"])
        seen = counter.since(mark)
        assert [q.split()[0] for q in seen.queries] == ["BEGIN", "COMMIT;"], seen

        await turn([f"w{i}" for i in range(20)])  # 17 left: this turn empties the queue
        mark = counter.mark()
        assert await turn(["w0", "w1", "w2"]) == [None, None, None]
        seen = counter.since(mark)
        assert seen.queries == [] and seen.ready == 1, seen  # the idle markings are in the statement
        assert {w.status for w in await store.query_workers() if w.worker_id in ("w0", "w1", "w2")} == {"idle"}
    finally:
        await store.close()


async def test_a_units_notifications_are_one_statement(
    wire_own_database: tuple[WireCounter, str, str], clock: FakeClock
) -> None:
    counter, url, schema = wire_own_database
    store = _open(url, schema, clock=clock)
    payloads: list[str] = []
    listener = await _listening(url, schema, payloads)
    try:
        retried = await store.start_rollout(
            1, config=RolloutConfig(timeout_seconds=10, max_attempts=2, retry_condition=["timeout"])
        )
        failed = await store.start_rollout(2, config=RolloutConfig(timeout_seconds=10, max_attempts=1))
        clock.advance(11)
        mark = counter.mark()
        assert await store.sweep() == 2  # one requeue ("queued") and one failure ("finished")
        seen = counter.since(mark)
        notifies = [st for st in seen.statements if "pg_notify" in st]
        assert len(notifies) == 1, notifies
        deadline = asyncio.get_running_loop().time() + 5
        while len(payloads) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        run_ids = {p.split(":", 1)[0] for p in payloads}
        assert len(run_ids) == 1 and sorted(p.split(":", 1)[1] for p in payloads) == ["finished", "queued"]
        assert (await store.get_rollout_by_id(retried.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
        assert (await store.get_rollout_by_id(failed.rollout_id)).status == "failed"  # type: ignore[union-attr]
    finally:
        await listener.close()
        await store.close()


async def test_an_attempt_update_locks_in_one_statement_and_writes_in_one(
    wire_own_database: tuple[WireCounter, str, str],
) -> None:
    """update_attempt: BEGIN, ONE statement locking the rollout and then its attempt, ONE statement
    writing the attempt, the rollout, the worker row and the notification, COMMIT; the notification
    is delivered once, and a requeue (which also takes a queue position) still notifies."""
    counter, url, schema = wire_own_database
    store = _open(url, schema)
    payloads: list[str] = []
    listener = await _listening(url, schema, payloads)
    try:
        await store.enqueue_many_rollouts(
            [
                EnqueueRolloutRequest(
                    input={"i": i}, config=RolloutConfig(max_attempts=2, retry_condition=["failed"])
                )
                for i in range(6)
            ]
        )
        claimed = [await store.dequeue_rollout(worker_id="w1") for _ in range(6)]
        for ar in claimed[:2]:  # warm: the connection prepares the statements
            assert ar is not None
            await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
        rest = claimed[2:5]

        async def finish(i: int) -> None:
            ar = rest[i]
            assert ar is not None
            attempt = await store.update_attempt(ar.rollout_id, "latest", status="succeeded")
            assert attempt.status == "succeeded" and attempt.end_time is not None

        per_call, seen = await _measure(counter, finish, 3)
        assert [q.split()[0] for q in seen.queries] == ["BEGIN", "COMMIT;"] * 3, seen.queries
        assert len(seen.statements) == 6 and per_call == 4, seen
        assert all("pg_notify" in st for st in seen.statements[1::2])
        for ar in rest:
            assert ar is not None
            rollout = await store.get_rollout_by_id(ar.rollout_id)
            assert rollout is not None and rollout.status == "succeeded"
        worker = await store.get_worker_by_id("w1")
        assert worker is not None and worker.status == "idle" and worker.current_rollout_id is None
        # A failure with a retry left: the rollout is requeued (a queue position, a "queued" event).
        last = claimed[5]
        assert last is not None
        mark = counter.mark()
        await store.update_attempt(last.rollout_id, last.attempt.attempt_id, status="failed")
        assert len(counter.since(mark).statements) == 3  # lock, queue position, the writes
        rollout = await store.get_rollout_by_id(last.rollout_id)
        assert rollout is not None and rollout.status == "requeuing"
        deadline = asyncio.get_running_loop().time() + 5
        while len(payloads) < 7 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        # The enqueue's "queued", five "finished", the requeue's "queued": each exactly once.
        assert sorted(p.split(":", 1)[1] for p in payloads) == ["finished"] * 5 + ["queued"] * 2, payloads
    finally:
        await listener.close()
        await store.close()


async def test_an_attempt_update_alone_to_a_one_to_one_status_is_one_statement(
    wire_own_database: tuple[WireCounter, str, str],
) -> None:
    """``update_attempt`` of a concrete attempt to running / succeeded, awaited alone: ONE statement
    without BEGIN/COMMIT (it locks the rollout and then the attempt, writes both, the worker's row
    and, for a finished rollout, the notification): one round trip.  An attempt it does not find
    costs that statement (which writes nothing) and then the transaction that raises the error."""
    counter, url, schema = wire_own_database
    store = _open(url, schema)
    payloads: list[str] = []
    listener = await _listening(url, schema, payloads)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(5)])
        claimed = [await store.dequeue_rollout(worker_id="w1") for _ in range(5)]
        assert all(ar is not None for ar in claimed)
        for ar in claimed[:2]:  # warm: the connection prepares the statements
            assert ar is not None
            await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="running")
            await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
        await asyncio.sleep(0.05)
        payloads.clear()
        rest = claimed[2:]

        async def run_then_finish(i: int) -> None:
            ar = rest[i // 2]
            assert ar is not None
            status = "running" if i % 2 == 0 else "succeeded"
            attempt = await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status=status)
            assert attempt.status == status and (attempt.end_time is not None) == (status == "succeeded")

        per_call, seen = await _measure(counter, run_then_finish, 6)
        assert seen.queries == [] and len(seen.statements) == 6 and per_call == 1, seen
        assert all("FOR UPDATE" in st and ".attempts SET" in st for st in seen.statements), seen.statements[0]
        for ar in rest:
            assert ar is not None
            rollout = await store.get_rollout_by_id(ar.rollout_id)
            assert rollout is not None and rollout.status == "succeeded" and rollout.end_time is not None
        worker = await store.get_worker_by_id("w1")
        assert worker is not None and worker.status == "idle" and worker.current_rollout_id is None
        deadline = asyncio.get_running_loop().time() + 5
        while len(payloads) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert [p.split(":", 1)[1] for p in payloads] == ["finished"] * 3, payloads  # not for "running"

        ar = rest[0]
        assert ar is not None
        mark = counter.mark()
        with pytest.raises(ValueError, match=f"Attempt at-missing not found for rollout {ar.rollout_id}"):
            await store.update_attempt(ar.rollout_id, "at-missing", status="succeeded")
        seen = counter.since(mark)
        assert [q.split()[0] for q in seen.queries] == ["BEGIN", "ROLLBACK;"], seen.queries
        assert ".attempts SET" in seen.statements[0] and len(seen.statements) == 2, seen
    finally:
        await listener.close()
        await store.close()


async def test_concurrent_attempt_updates_are_one_statement_or_one_transaction(
    wire_own_database: tuple[WireCounter, str, str],
) -> None:
    """Four ``update_attempt`` calls of distinct rollouts issued in the same loop turn, each to a
    status its rollout follows one to one: ONE statement without a transaction (it locks every
    rollout and attempt, writes them with their workers' rows, and notifies), 1 round trip instead
    of 16; one "finished" notification.  Four calls that do not fit one statement (``failed``): ONE
    transaction (BEGIN, one statement that locks every rollout and attempt, one that writes them
    all, COMMIT), 4 round trips."""
    counter, url, schema = wire_own_database
    store = _open(url, schema)
    payloads: list[str] = []
    listener = await _listening(url, schema, payloads)

    async def finished_once() -> None:
        deadline = asyncio.get_running_loop().time() + 5
        while not payloads and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert [p.split(":", 1)[1] for p in payloads] == ["finished"], payloads
        payloads.clear()

    def update_all(ars: list[Any], status: str) -> Any:
        return asyncio.gather(*(store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status=status) for ar in ars))

    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(12)])
        claimed = [await store.dequeue_rollout(worker_id=f"w{i}") for i in range(12)]
        assert all(ar is not None for ar in claimed)
        await update_all(claimed[0:2], "succeeded")  # warm: the connection prepares the statements
        await update_all(claimed[2:4], "failed")
        await asyncio.sleep(0.05)
        payloads.clear()

        rest = claimed[4:8]
        mark = counter.mark()
        got = await update_all(rest, "succeeded")
        seen = counter.since(mark)
        assert [a.status for a in got] == ["succeeded"] * 4
        assert seen.queries == [] and len(seen.statements) == 1 and seen.ready == 1, seen
        for ar, attempt in zip(rest, got, strict=True):
            assert (attempt.rollout_id, attempt.attempt_id) == (ar.rollout_id, ar.attempt.attempt_id)
            assert attempt.end_time is not None
            rollout = await store.get_rollout_by_id(ar.rollout_id)
            assert rollout is not None and rollout.status == "succeeded" and rollout.end_time == attempt.end_time
            worker = await store.get_worker_by_id(ar.attempt.worker_id or "")
            assert worker is not None and worker.status == "idle" and worker.current_rollout_id is None
        await finished_once()

        rest = claimed[8:12]
        mark = counter.mark()
        got = await update_all(rest, "failed")
        seen = counter.since(mark)
        assert [a.status for a in got] == ["failed"] * 4
        assert [q.split()[0] for q in seen.queries] == ["BEGIN", "COMMIT;"], seen.queries
        assert len(seen.statements) == 2 and seen.ready == 4, seen
        assert {(await store.get_rollout_by_id(ar.rollout_id)).status for ar in rest} == {"failed"}  # type: ignore[union-attr]
        await finished_once()
    finally:
        await listener.close()
        await store.close()


async def test_attempt_update_batches_take_one_statement_per_mix_of_shapes_and_at_most_16_calls(
    wire: tuple[WireCounter, str, str],
) -> None:
    """The write statement of a batch depends on which kinds of update it holds and how many of
    each, not on their order: two batches of the same mix in opposite orders prepare one statement.
    A turn's 20 calls run as two batches (``UPDATE_BATCH_MAX``), each one statement."""
    from lightning_sql.store.sql import rollouts as ro
    from lightning_sql.store.sql import statements

    counter, url, schema = wire
    store = _open(url, schema, scan_debounce_seconds=3600)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(46)])
        claimed = [await store.dequeue_rollout(worker_id=f"w{i}") for i in range(46)]
        assert all(ar is not None for ar in claimed)

        def written() -> set[Any]:
            return {key for key in list(statements._CACHE) if isinstance(key, tuple) and key[0] == "writes_in_one_statement"}

        def done(ar: Any) -> Any:
            return store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")

        def tagged(ar: Any) -> Any:
            return store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, metadata={"k": 1})

        await asyncio.gather(done(claimed[0]), tagged(claimed[1]), tagged(claimed[2]))
        after_first = written()  # (the cache is the process's: other tests may have added the same)
        await asyncio.gather(tagged(claimed[3]), tagged(claimed[4]), done(claimed[5]))
        assert written() == after_first
        assert [(await store.get_rollout_by_id(ar.rollout_id)).status for ar in claimed[:6]] == [
            "succeeded", "preparing", "preparing", "preparing", "preparing", "succeeded"
        ]

        assert ro.UPDATE_BATCH_MAX == 16
        await asyncio.gather(*(done(ar) for ar in claimed[6:26]))  # warm: two connections prepare it
        rest = claimed[26:]
        mark = counter.mark()
        got = await asyncio.gather(*(done(ar) for ar in rest))
        seen = counter.since(mark)
        assert [a.status for a in got] == ["succeeded"] * 20
        assert seen.queries == [] and len(seen.statements) == 2 and seen.ready == 2, seen  # 16 + 4
    finally:
        await store.close()


async def test_the_checker_reads_one_snapshot(wire: tuple[WireCounter, str, str]) -> None:
    counter, url, schema = wire
    store = _open(url, schema)
    try:
        await store.enqueue_rollout(1)
        mark = counter.mark()
        assert await check_invariants(store) == []
        seen = counter.since(mark)
        assert seen.queries == ["BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;", "COMMIT;"], seen.queries
    finally:
        await store.close()


async def test_read_units_see_one_transaction_per_statement_and_snapshots_one_for_all(
    wire: tuple[WireCounter, str, str],
) -> None:
    """What autocommit means for a read unit, seen from the server (no proxy bookkeeping)."""
    _, url, schema = wire
    store = _open(url, schema)
    stamps = text(
        "SELECT statement_timestamp(), transaction_timestamp(), current_setting('transaction_isolation'), "
        "current_setting('transaction_read_only')"
    )

    def two_statements(ctx: UnitContext) -> list[Any]:
        first = ctx.conn.execute(stamps).one()
        time.sleep(0.01)
        return [first, ctx.conn.execute(stamps).one()]

    try:
        worker, _ = await store._prepare(needs_run=False)
        read = await store._submit(worker, two_statements, write=False)
        assert read[0][1] != read[1][1]  # each statement its own transaction
        assert read[0][2] == "read committed"
        snap = await store._submit(worker, two_statements, write=False, snapshot=True)
        assert snap[0][1] == snap[1][1]  # one transaction
        assert snap[0][2:] == ("repeatable read", "on")
        write = await store._submit(worker, two_statements, write=True)
        assert write[0][1] == write[1][1]
        assert write[0][2:] == ("read committed", "off")
    finally:
        await store.close()


@pytest.mark.parametrize("ping", ["after-a-rest", "recently-used", "off"])
async def test_a_read_on_a_dropped_connection_is_retried(
    wire: tuple[WireCounter, str, str], ping: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a transaction a read still replays after a lost connection (and finds a new one).

    When the checkout pings (the connection rested longer than PG_PRE_PING_IDLE_S) it notices the
    dead connection and opens another; when it does not (a connection used a moment ago, or
    ``pool_pre_ping=False``) the read's first statement fails and the worker replays the unit
    (``ctx.attempt`` 1)."""
    counter, url, schema = wire
    if ping == "after-a-rest":
        monkeypatch.setattr(engine_module, "PG_PRE_PING_IDLE_S", 0.01)
    store = _open(url, schema, pool_pre_ping=ping != "off")
    tries: list[int] = []

    def read(ctx: UnitContext) -> int:
        tries.append(ctx.attempt)
        return int(ctx.conn.execute(text("SELECT 1")).scalar_one())

    try:
        await store.update_worker("w1")
        worker, _ = await store._prepare(needs_run=False)
        assert await store._submit(worker, read, write=False) == 1
        for _ in range(3):
            tries.clear()
            counter.drop_all()
            await asyncio.sleep(0.05)
            assert await store._submit(worker, read, write=False) == 1
            assert tries == ([0] if ping == "after-a-rest" else [0, 1])
            assert (await store.get_worker_by_id("w1")) is not None
            assert (await store.update_worker("w1")).worker_id == "w1"
    finally:
        await store.close()
