"""fastexec runs prebuilt statements on the DBAPI cursor: it must return what SQLAlchemy returns.

Each statement below is executed both ways inside one unit on real data of every backend, and the
rows (values, column names, processed types such as decoded JSON) and row counts are compared.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import bindparam, select, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import fastexec
from lightning_sql.store.sql import rollouts as ro
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.statements import cached, is_prebuilt
from lightning_sql.types import EnqueueRolloutRequest

R = s.rollouts
A = s.attempts

_PAGE = cached(
    ("test_fastexec_page",),
    lambda: select(R.c.rollout_id, R.c.input, R.c.metadata, R.c.start_time, R.c.status)
    .where(R.c.run_id == bindparam("t_run_id"))
    .order_by(R.c.create_seq)
    .limit(bindparam("t_limit"))
    .offset(2),  # a bound value the caller never passes
)
_TOUCH = cached(
    ("test_fastexec_touch",),
    lambda: update(R).where(R.c.run_id == bindparam("t_run_id"), R.c.status == bindparam("t_status")).values(
        mode=R.c.mode
    ),
)
_STAMP = cached(  # bind processors (JSON's encoder, Float's) and a literal bound value (the 0.25)
    ("test_fastexec_stamp",),
    lambda: update(R)
    .where(R.c.run_id == bindparam("t_run_id"), R.c.rollout_id == bindparam("t_id"))
    .values(
        end_time=bindparam("t_time", type_=R.c.end_time.type) + 0.25,
        metadata=bindparam("t_meta", type_=R.c.metadata.type),
    )
    .returning(R.c.rollout_id, R.c.end_time, R.c.metadata),
)


def _rows(result: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return [(tuple(row), dict(row._mapping)) for row in result.all()]


async def test_prebuilt_statements_return_what_sqlalchemy_returns(store: Any) -> None:
    queued = await store.enqueue_many_rollouts(
        [EnqueueRolloutRequest(input={"task": i, "tags": ["a", i], "x": 1.5}, metadata={"k": str(i)}) for i in range(6)]
    )
    ids = [r.rollout_id for r in queued]
    claimed = await store.dequeue_many_rollouts(limit=3, worker_id="w")
    pairs = [(ar.rollout_id, ar.attempt.sequence_id) for ar in claimed]

    def unit(ctx: Any, run_id: int, _now: float) -> list[str]:
        cases: list[tuple[Any, Any]] = [
            (ro._ROLLOUTS_BY_ID, {"r_run_id": run_id, "r_ids": ids[:4]}),  # expanding IN
            (ro._ROLLOUTS_BY_ID, {"r_run_id": run_id, "r_ids": []}),  # empty IN: SQLAlchemy's own path
            (d._ATTEMPTS_BY_PAIRS_IN, {"la_run_id": run_id, "la_pairs": pairs}),  # tuple IN
            (ro._ROLLOUT_WITH_COUNT, {"r_run_id": run_id, "r_rollout_id": ids[0]}),
            (ro._ROLLOUT_WITH_COUNT, {"r_run_id": run_id, "r_rollout_id": "missing"}),
            (_PAGE, {"t_run_id": run_id, "t_limit": 3}),
        ]
        if ctx.dialect == "postgresql":  # array parameters, a LATERAL look-up per pair
            keyed = cached("attempts_by_sequence", d._attempts_by_sequence_statement)
            rids, seqs = [rid for rid, _seq in pairs], [seq for _rid, seq in pairs]
            cases.append((keyed, {"la_run_id": run_id, "la_rollout_ids": rids, "la_sequence_ids": seqs, "la_pairs": 3}))
        checked = []
        for stmt, params in cases:
            assert is_prebuilt(stmt)
            fast = _rows(fastexec.execute(ctx.conn, stmt, params))
            slow = _rows(ctx.conn.execute(stmt, params))
            assert fast == slow, stmt
            assert [type(v) for row, _ in fast for v in row] == [type(v) for row, _ in slow for v in row]
            checked.append(str(len(fast)))
        for status in ("queuing", "preparing", "succeeded"):
            params = {"t_run_id": run_id, "t_status": status}
            assert fastexec.execute(ctx.conn, _TOUCH, params).rowcount == ctx.conn.execute(_TOUCH, params).rowcount
        # The same statement with its parameters named in another order, and an int where the
        # column's bind processor makes a float: the same rows either way.
        for params in (
            {"t_run_id": run_id, "t_id": ids[5], "t_time": 7, "t_meta": {"n": [1, "two"]}},
            {"t_meta": {"m": None}, "t_time": 2.5, "t_id": ids[5], "t_run_id": run_id},
        ):
            fast = _rows(fastexec.execute(ctx.conn, _STAMP, params))
            slow = _rows(ctx.conn.execute(_STAMP, params))
            expected = (ids[5], params["t_time"] + 0.25, params["t_meta"])
            columns = dict(zip(("rollout_id", "end_time", "metadata"), expected, strict=True))
            assert fast == slow == [(expected, columns)]
            assert [type(v) for row, _ in fast for v in row] == [str, float, dict]
        return checked

    counts = await store._call("test", unit, write=True)
    assert counts == ["4", "0", "3", "1", "0", "3"] + (["3"] if store._target.dialect == "postgresql" else [])


def test_plans_follow_the_connections_schema_map(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A statement's plan is looked up again when the connection's schema translation changes, and
    found again (without ``_lookup``) while the same map object stays, whatever else the options say."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{tmp_path / 'plans.db'}")
    stmt = cached(
        ("test_fastexec_options",), lambda: select(R.c.rollout_id).where(R.c.run_id == bindparam("t_run_id"))
    )
    try:
        with engine.connect() as conn:
            conn.execute(text("ATTACH DATABASE ':memory:' AS other"))
            for schema, rows in (("main", "(1, 'in-main')"), ("other", "(1, 'in-other')")):
                conn.execute(text(f"CREATE TABLE {schema}.rollouts (run_id INTEGER, rollout_id TEXT)"))
                conn.execute(text(f"INSERT INTO {schema}.rollouts VALUES {rows}"))
            plain = fastexec._hot_lookup(conn, stmt, {"t_run_id": 1})
            assert plain is not None and plain.schema_map is None
            assert fastexec._hot_lookup(conn, stmt, {"t_run_id": 1}) is plain
            assert [row.rollout_id for row in fastexec.execute(conn, stmt, {"t_run_id": 1})] == ["in-main"]
            conn.execution_options(schema_translate_map={None: "other"})
            moved = fastexec._hot_lookup(conn, stmt, {"t_run_id": 1})
            assert moved is not None and moved is not plain and (moved.schema_map or {}).get(None) == "other"
            assert [row.rollout_id for row in fastexec.execute(conn, stmt, {"t_run_id": 1})] == ["in-other"]
            # Another option (a unit's isolation level, say) keeps the map: found again without a look-up.
            looked_up: list[Any] = []
            real = fastexec._lookup
            monkeypatch.setattr(fastexec, "_lookup", lambda *args: looked_up.append(args) or real(*args))
            conn.execution_options(stream_results=False)
            assert fastexec._hot_lookup(conn, stmt, {"t_run_id": 1}) is moved
            assert looked_up == []
    finally:
        engine.dispose()


async def test_missing_parameter_raises_sqlalchemys_error(store: Any) -> None:
    def unit(ctx: Any, run_id: int, _now: float) -> None:
        fastexec.execute(ctx.conn, ro._ROLLOUT_WITH_COUNT, {"r_run_id": run_id})

    with pytest.raises(Exception, match="r_rollout_id"):
        await store._call("test", unit, write=False)


# --- PostgreSQL: asyncpg without SQLAlchemy's cursor adapter -------------------------------------


def test_command_status_row_counts() -> None:
    assert fastexec._status_rowcount("UPDATE 3") == 3
    assert fastexec._status_rowcount("DELETE 0") == 0
    assert fastexec._status_rowcount("SELECT 12") == 12
    assert fastexec._status_rowcount("INSERT 0 5") == 5
    for other in ("BEGIN", "MERGE 2", "", None, "UPDATE x"):
        assert fastexec._status_rowcount(other) == -1


_ATTEMPT_INSERT = cached(("test_fastexec_attempt_insert",), lambda: A.insert())
_MARK = cached(
    ("test_fastexec_mark",),
    lambda: update(R).where(R.c.run_id == bindparam("t_run_id"), R.c.rollout_id == bindparam("t_id")).values(
        status="failed"
    ),
)


async def test_postgres_runs_prebuilt_statements_on_asyncpg_directly(store: Any, backend: Any, monkeypatch) -> None:
    """On PostgreSQL a prebuilt statement skips SQLAlchemy's cursor adapter; its results, errors and
    transaction are the adapter's: a constraint violation is SQLAlchemy's IntegrityError, and a
    write of a unit that fails is rolled back with the rest of the unit."""
    if backend.name != "postgres":
        pytest.skip("asyncpg only")
    direct: list[str] = []
    real = fastexec._execute_asyncpg

    def spy(conn: Any, adapter: Any, plan: Any, sql: str, params: Any) -> Any:
        direct.append(sql)
        return real(conn, adapter, plan, sql, params)

    monkeypatch.setattr(fastexec, "_execute_asyncpg", spy)
    (queued,) = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"task": 1})])
    ar = await store.dequeue_rollout(worker_id="w")
    assert ar is not None and ar.rollout_id == queued.rollout_id

    def duplicate(ctx: Any, run_id: int, _now: float) -> None:
        row = {
            "run_id": run_id,
            "rollout_id": ar.rollout_id,
            "attempt_id": ar.attempt.attempt_id,
            "sequence_id": 1,
            "status": "preparing",
            "worker_id": None,
            "start_time": 1.0,
        }
        fastexec.execute(ctx.conn, _ATTEMPT_INSERT, row)

    direct.clear()
    with pytest.raises(Exception) as fast_error:
        await store._call("test", duplicate, write=True)
    assert len(direct) == 1
    real_direct = fastexec._asyncpg_direct
    monkeypatch.setattr(fastexec, "_asyncpg_direct", lambda _conn: False)  # the cursor adapter's way
    with pytest.raises(Exception) as slow_error:
        await store._call("test", duplicate, write=True)
    monkeypatch.setattr(fastexec, "_asyncpg_direct", real_direct)
    assert len(direct) == 1
    assert type(fast_error.value) is type(slow_error.value)
    assert type(fast_error.value).__name__ == "IntegrityError"
    assert type(fast_error.value.orig) is type(slow_error.value.orig)  # type: ignore[attr-defined]

    def mark_then_fail(ctx: Any, run_id: int, _now: float) -> None:
        assert fastexec.execute(ctx.conn, _MARK, {"t_run_id": run_id, "t_id": ar.rollout_id}).rowcount == 1
        raise RuntimeError("after the write")

    direct.clear()
    with pytest.raises(RuntimeError, match="after the write"):
        await store._call("test", mark_then_fail, write=True)
    assert len(direct) == 1  # the write went the direct way ...
    assert (await store.get_rollout_by_id(ar.rollout_id)).status == "preparing"  # ... and was rolled back


async def test_event_listeners_see_every_statement(store: Any) -> None:
    """With a ``before_cursor_execute`` listener (a statement counter, OpenTelemetry's SQLAlchemy
    instrumentation) prebuilt statements take SQLAlchemy's path, so the listener sees them."""
    from sqlalchemy import event

    ar = await store.start_rollout({"q": 1})
    pair = (ar.rollout_id, ar.attempt.attempt_id)
    await store.get_many_span_sequence_ids([pair])  # warm-up: schema, run
    engine = store._worker._engine
    engine = getattr(engine, "sync_engine", engine)
    if hasattr(store._worker, "engine_for_this_loop"):  # PostgreSQL: this loop's units may run on its own engine
        engine = store._worker.engine_for_this_loop()
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        assert list(await store.get_many_span_sequence_ids([pair])) == [2]  # a prebuilt UPDATE
    finally:
        event.remove(engine, "before_cursor_execute", before)
    assert any(sql.lstrip().upper().startswith("UPDATE") and "rollouts" in sql for sql in seen), seen
