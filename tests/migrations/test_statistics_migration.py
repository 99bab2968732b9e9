"""Revision 0003 (PostgreSQL): ANALYZE never samples ``run_id`` nor ``rollouts.queue_seq``, and the
statistics a database already had for them are dropped by the upgrade (ADR 0007).

A statistics target of 0 alone would keep those statistics for ever (ANALYZE skips the column, it
does not clear it), and they are exactly what misleads the planner: the runs of the day they were
gathered.  The tests analyse tables at 0002 holding a run, upgrade, and read ``pg_stats``, the
targets and the data: as a superuser the statistics go; as the tables' owner without superuser
rights the columns stay sampled and a warning says how to finish; a never-analysed database only
gets its targets (nothing rebuilt); downgrading restores the default target; SQLite is unchanged.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from sqlalchemy import Connection, text

from lightning_sql.store.sql import migrate
from lightning_sql.store.sql import schema as schema_module
from tests.migrations import test_migrations as base
from tests.migrations.test_migrations import (
    Database,
    PostgresDatabase,
    catalogue,
    check,
    downgrade_to,
    upgrade_to,
    version_rows,
)

database = base.database
open_database = base.open_database

UNSAMPLED = {(table, column) for table, columns in schema_module.UNSAMPLED_COLUMNS.items() for column in columns}


def _fill_and_analyze(conn: Connection, schema: str) -> None:
    """A run of 300 rollouts with an attempt, a span and a worker each, half of them queued; then ANALYZE."""
    conn.execute(text(f'SET LOCAL search_path TO "{schema}"'))
    conn.execute(text("INSERT INTO runs (run_id, name, status, created_at, seq) VALUES (1, 'r1', 'active', 1, 0)"))
    conn.execute(
        text(
            """
            INSERT INTO rollouts (run_id, rollout_id, status, max_attempts, retry_condition, start_time,
                                  queue_seq, create_seq)
            SELECT 1, 'ro-' || i, 'queuing', 1, '[]', 1, CASE WHEN i % 2 = 0 THEN i END, i
            FROM generate_series(1, 300) AS i
            """
        )
    )
    conn.execute(
        text(
            """
            INSERT INTO attempts (run_id, rollout_id, attempt_id, sequence_id, status, start_time)
            SELECT 1, 'ro-' || i, 'at-' || i, 1, 'running', 1 FROM generate_series(1, 300) AS i
            """
        )
    )
    conn.execute(
        text(
            """
            INSERT INTO spans (run_id, rollout_id, attempt_id, sequence_id, trace_id, span_id, name, status_code)
            SELECT 1, 'ro-' || i, 'at-' || i, 1, 't', 's', 'n', 'OK' FROM generate_series(1, 300) AS i
            """
        )
    )
    conn.execute(
        text(
            """
            INSERT INTO workers (run_id, worker_id, status, create_seq)
            SELECT 1, 'w-' || i, 'idle', i FROM generate_series(1, 300) AS i
            """
        )
    )
    conn.execute(text("ANALYZE rollouts, attempts, spans, workers"))


def _sampled(database: Database) -> set[tuple[str, str]]:
    """The (table, column) pairs of the run tables that hold statistics."""
    query = text(
        "SELECT tablename, attname FROM pg_stats WHERE schemaname = :schema"
        " AND tablename IN ('rollouts', 'attempts', 'spans', 'workers')"
    )
    return {(r[0], r[1]) for r in database.run(lambda conn: conn.execute(query, {"schema": database.schema}).all())}


def _row_counts(database: Database) -> dict[str, int]:
    def count(conn: Connection) -> dict[str, int]:
        conn.execute(text(f'SET LOCAL search_path TO "{database.schema}"'))
        return {t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()) for t in ("rollouts", "spans")}

    return database.run(count)


def test_upgrade_drops_the_run_columns_statistics_and_keeps_the_others(database: Database) -> None:
    if not isinstance(database, PostgresDatabase):
        upgrade_to(database, "0002")
        before = catalogue(database)
        upgrade_to(database, "0003")
        assert version_rows(database) == ["0003"]
        assert catalogue(database) == before  # SQLite: nothing to do
        return
    assert database.schema is not None
    upgrade_to(database, "0002")
    schema = database.schema
    database.run(lambda conn: _fill_and_analyze(conn, schema))
    sampled = _sampled(database)
    assert UNSAMPLED <= sampled  # else the upgrade would have nothing to drop
    queue_index = _queue_index_file(database)

    upgrade_to(database, "0003")  # the revision under test (0005 rebuilds the queue index)
    assert _queue_index_file(database) == queue_index  # nothing rebuilt
    assert version_rows(database) == ["0003"]
    assert _sampled(database) == sampled - UNSAMPLED
    assert _row_counts(database) == {"rollouts": 300, "spans": 300}

    # ANALYZE (the store's, autovacuum's) now leaves them unsampled.
    database.run(lambda conn: _analyze(conn, schema))
    assert _sampled(database) == sampled - UNSAMPLED

    downgrade_to(database, "0002")
    assert catalogue(database)["statistics_targets"] == set()
    database.run(lambda conn: _analyze(conn, schema))
    assert _sampled(database) == sampled
    upgrade_to(database)
    assert version_rows(database) == [migrate.HEAD_REVISION]
    assert _row_counts(database) == {"rollouts": 300, "spans": 300}
    assert check(database) == []


def _analyze(conn: Connection, schema: str) -> None:
    conn.execute(text(f'ANALYZE "{schema}".rollouts, "{schema}".attempts, "{schema}".spans, "{schema}".workers'))


def _queue_index_file(database: Database) -> int:
    query = text(
        "SELECT c.relfilenode FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = :schema AND c.relname = 'ix_rollouts_queue'"
    )
    return int(database.run(lambda conn: conn.execute(query, {"schema": database.schema}).scalar_one()))


def test_upgrade_of_a_never_analysed_database_only_sets_the_targets(database: Database) -> None:
    """No statistics yet (a new database): nothing is rebuilt (the queue index keeps its file)."""
    upgrade_to(database, "0002")
    if not isinstance(database, PostgresDatabase):
        pytest.skip("SQLite: covered by the test above")
    before = _queue_index_file(database)
    upgrade_to(database, "0003")  # the revision under test (0005 rebuilds the queue index)
    assert catalogue(database)["statistics_targets"] == {(t, c, 0) for t, c in UNSAMPLED}
    assert _sampled(database) == set()
    assert _queue_index_file(database) == before


def test_a_role_that_is_not_a_superuser_leaves_sampled_columns_and_says_how_to_finish(
    database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    if not isinstance(database, PostgresDatabase):
        pytest.skip("PostgreSQL roles")
    assert database.schema is not None
    schema, owner = database.schema, f"lsql_owner_{uuid.uuid4().hex[:8]}"
    database.run(lambda conn: _each(conn, f"CREATE ROLE {owner} NOLOGIN; GRANT CREATE ON DATABASE postgres TO {owner}"))
    try:

        def as_owner(revision: str) -> None:
            def go(conn: Connection) -> None:
                conn.execute(text(f"SET LOCAL ROLE {owner}"))
                migrate.upgrade(conn, schema, revision)

            database.run(go, migrating=True)

        as_owner("0002")  # the owner creates the schema and owns every table
        database.run(lambda conn: _fill_and_analyze(conn, schema))
        sampled = _sampled(database)
        with caplog.at_level(logging.WARNING, logger="lightning_sql.migrations"):
            as_owner("head")
        assert version_rows(database) == [migrate.HEAD_REVISION]
        assert _sampled(database) == sampled
        assert catalogue(database)["statistics_targets"] == set()  # left sampled: no frozen statistics
        warned = [r.getMessage() for r in caplog.records if r.name == "lightning_sql.migrations"]
        assert len(warned) == len(UNSAMPLED)
        assert all("DELETE FROM pg_statistic" in w and "SET STATISTICS 0" in w for w in warned)
        for message in warned:  # what it says to run finishes the job
            statements = message.split(" with: ", 1)[1]
            database.run(lambda conn, sql=statements: _each(conn, sql))
        assert _sampled(database) == sampled - UNSAMPLED
        assert catalogue(database)["statistics_targets"] == {(t, c, 0) for t, c in UNSAMPLED}
    finally:
        database.run(lambda conn: conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')))
        database.run(
            lambda conn: _each(conn, f"REVOKE CREATE ON DATABASE postgres FROM {owner}; DROP OWNED BY {owner}; DROP ROLE {owner}")
        )


def _each(conn: Connection, statements: str) -> None:
    """Run ``; ``-separated statements one by one (asyncpg prepares one statement at a time)."""
    for statement in statements.split("; "):
        conn.exec_driver_sql(statement)
