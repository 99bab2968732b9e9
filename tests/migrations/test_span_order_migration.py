"""Revision 0004: the spans' ordering index ends with ``id`` (docs/adr/0010-span-pages-follow-the-index.md).

The upgrade replaces ``(run_id, rollout_id, attempt_id, sequence_id)`` by ``(..., sequence_id, id)``
and keeps the spans; the downgrade puts the old index back.  On PostgreSQL an index an operator
built beforehand with ``CREATE INDEX CONCURRENTLY`` (docs/operations.md) is kept as it is, and one
that cannot serve (a failed concurrent build leaves an invalid index; another definition under the
name, or the right columns in another collation) is built again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from sqlalchemy import Connection, text

from lightning_sql.store.sql import migrate
from tests.helpers import pg_execute
from tests.migrations import test_migrations as base
from tests.migrations.test_migrations import (
    POSTGRES_URL,
    Database,
    PostgresDatabase,
    check,
    downgrade_to,
    upgrade_to,
    version_rows,
)

database = base.database
open_database = base.open_database

OLD = "ix_spans_run_id_rollout_id_attempt_id_sequence_id"
NEW = "ix_spans_run_id_rollout_id_attempt_id_sequence_id_id"
PG_URL = POSTGRES_URL.set(drivername="postgresql").render_as_string(hide_password=False)


def _pg(sql: str) -> None:
    """One statement outside a transaction (``CONCURRENTLY`` refuses one), on a connection of its own."""
    asyncio.run(pg_execute(PG_URL, sql))


def _indexes(database: Database) -> dict[str, str]:
    """The spans table's indexes: name -> definition (PostgreSQL) or SQL (SQLite)."""
    if isinstance(database, PostgresDatabase):
        query = text(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = :schema AND tablename = 'spans'"
        )
        rows = database.run(lambda conn: conn.execute(query, {"schema": database.schema}).all())
    else:
        query = text(
            "SELECT name, coalesce(sql, '') FROM sqlite_master WHERE type = 'index' AND tbl_name = 'spans'"
        )
        rows = database.run(lambda conn: conn.execute(query).all())
    return {name: definition for name, definition in rows}


def _index_oid(database: Database, name: str) -> int:
    query = text(
        "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = :schema AND c.relname = :name"
    )
    return int(
        database.run(lambda conn: conn.execute(query, {"schema": database.schema, "name": name}).scalar_one())
    )


def _fill(conn: Connection, schema: str | None) -> None:
    """A run with one rollout, one attempt and 30 spans, three per sequence id."""
    if schema is not None:
        conn.execute(text(f'SET LOCAL search_path TO "{schema}"'))
    conn.execute(
        text("INSERT INTO runs (run_id, name, status, created_at, seq) VALUES (1, 'r1', 'active', 1, 0)")
    )
    conn.execute(
        text(
            "INSERT INTO rollouts (run_id, rollout_id, status, max_attempts, retry_condition, start_time, create_seq)"
            " VALUES (1, 'ro-1', 'running', 1, '[]', 1, 1)"
        )
    )
    conn.execute(
        text(
            "INSERT INTO attempts (run_id, rollout_id, attempt_id, sequence_id, status, start_time)"
            " VALUES (1, 'ro-1', 'at-1', 1, 'running', 1)"
        )
    )
    for i in range(30):
        conn.execute(
            text(
                "INSERT INTO spans (run_id, rollout_id, attempt_id, sequence_id, trace_id, span_id, name, status_code)"
                " VALUES (1, 'ro-1', 'at-1', :seq, 't', :sid, 'n', 'OK')"
            ),
            {"seq": 10 - i // 3, "sid": f"s{i}"},
        )


def _span_order(database: Database) -> list[str]:
    def read(conn: Connection) -> list[str]:
        if database.schema is not None:
            conn.execute(text(f'SET LOCAL search_path TO "{database.schema}"'))
        return list(conn.execute(text("SELECT span_id FROM spans ORDER BY sequence_id, id")).scalars())

    return database.run(read)


def test_upgrade_replaces_the_span_order_index_and_keeps_the_spans(database: Database) -> None:
    upgrade_to(database, "0003")
    database.run(lambda conn: _fill(conn, database.schema))
    before = _span_order(database)
    assert OLD in _indexes(database) and NEW not in _indexes(database)

    upgrade_to(database)
    assert version_rows(database) == [migrate.HEAD_REVISION]
    indexes = _indexes(database)
    assert OLD not in indexes
    assert "(run_id, rollout_id, attempt_id, sequence_id, id)" in indexes[NEW].replace('"', "")
    assert _span_order(database) == before
    assert check(database) == []

    downgrade_to(database, "0003")
    indexes = _indexes(database)
    assert NEW not in indexes
    assert "(run_id, rollout_id, attempt_id, sequence_id)" in indexes[OLD].replace('"', "")
    assert _span_order(database) == before


def test_an_index_built_beforehand_is_kept(open_database: Callable[..., Database]) -> None:
    database = open_database("postgresql")  # CREATE INDEX CONCURRENTLY
    upgrade_to(database, "0003")
    database.run(lambda conn: _fill(conn, database.schema))
    _pg(
        f'CREATE INDEX CONCURRENTLY {NEW} ON "{database.schema}".spans (run_id, rollout_id, attempt_id, sequence_id, id)'
    )
    built = _index_oid(database, NEW)

    upgrade_to(database)
    assert _index_oid(database, NEW) == built  # kept, not built again
    assert OLD not in _indexes(database)
    assert check(database) == []


@pytest.mark.parametrize("left", ["invalid", "other columns", "another collation"])
def test_an_unusable_index_of_that_name_is_built_again(
    open_database: Callable[..., Database], left: str
) -> None:
    database = open_database("postgresql")  # CREATE INDEX CONCURRENTLY, index catalogues
    upgrade_to(database, "0003")
    database.run(lambda conn: _fill(conn, database.schema))
    table = f'"{database.schema}".spans'
    if left == "invalid":
        # A concurrent build that fails (here: duplicate keys) leaves its index behind, invalid.
        with pytest.raises(Exception, match="could not create unique index"):
            _pg(f"CREATE UNIQUE INDEX CONCURRENTLY {NEW} ON {table} (run_id, rollout_id)")
    elif left == "other columns":
        _pg(f"CREATE INDEX {NEW} ON {table} (run_id, rollout_id)")
    else:  # the right columns, but sorted by another collation than the columns' "C"
        _pg(
            f'CREATE INDEX {NEW} ON {table} (run_id, rollout_id COLLATE "POSIX", attempt_id, sequence_id, id)'
        )
    left_behind = _index_oid(database, NEW)

    upgrade_to(database)
    assert _index_oid(database, NEW) != left_behind
    assert "(run_id, rollout_id, attempt_id, sequence_id, id)" in _indexes(database)[NEW].replace('"', "")
    assert OLD not in _indexes(database)
    assert check(database) == []
