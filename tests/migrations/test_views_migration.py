"""Revision 0002: the analysis views and the reward-span index (docs/architecture.md §3, §9).

Same catalogue after ``upgrade head`` as after a fresh ``create_all`` (views and the partial index
included), downgrade 0002 -> 0001 removes exactly them, data written at 0001 shows up in the views
after the upgrade, the views live in the configured PostgreSQL schema, and the final-reward lookup
reads the partial index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, insert, text

from lightning_sql.store.sql import migrate, views
from lightning_sql.store.sql import schema as schema_module
from tests.migrations import test_migrations as base
from tests.migrations.test_migrations import (
    Database,
    PostgresDatabase,
    catalogue,
    check,
    ensure,
    upgrade_to,
    version_rows,
)

# The fixtures of the main migration suite (a throwaway SQLite file / PostgreSQL schema per test).
database = base.database
open_database = base.open_database

REWARD_INDEX = "ix_spans_reward"


def _view_names(database: Database) -> set[str]:
    if isinstance(database, PostgresDatabase):
        query = text("SELECT viewname FROM pg_views WHERE schemaname = :schema")
        return set(database.run(lambda conn: conn.execute(query, {"schema": database.schema}).scalars().all()))
    query = text("SELECT name FROM sqlite_master WHERE type = 'view'")
    return set(database.run(lambda conn: conn.execute(query).scalars().all()))


def _index_names(database: Database) -> set[str]:
    if isinstance(database, PostgresDatabase):
        query = text("SELECT indexname FROM pg_indexes WHERE schemaname = :schema")
        return set(database.run(lambda conn: conn.execute(query, {"schema": database.schema}).scalars().all()))
    query = text("SELECT name FROM sqlite_master WHERE type = 'index'")
    return set(database.run(lambda conn: conn.execute(query).scalars().all()))


def test_head_creates_the_views_and_the_reward_index(database: Database) -> None:
    ensure(database)
    assert _view_names(database) == set(views.VIEW_NAMES)
    assert REWARD_INDEX in _index_names(database)
    assert check(database) == []


def test_catalogue_with_views_equals_a_fresh_create(
    database: Database, open_database: Callable[..., Database]
) -> None:
    ensure(database)
    fresh = open_database(database.dialect, "fresh")

    def create_all(conn: Connection) -> None:
        if fresh.schema is not None:
            migrate.prepare_pg_schema(conn, fresh.schema)
        schema_module.metadata.create_all(conn)

    fresh.run(create_all, migrating=True)
    assert _view_names(fresh) == set(views.VIEW_NAMES)
    migrated, created = catalogue(database), catalogue(fresh)
    assert migrated == created
    shown = repr(migrated)
    for name in (*views.VIEW_NAMES, REWARD_INDEX, "agentlightning.annotation"):
        assert name in shown, name
    if isinstance(database, PostgresDatabase):
        assert {row[0] for row in migrated["views"]} == set(views.VIEW_NAMES)
        # The views read the tables of their own schema, not of whatever search_path says.
        assert all("<schema>.spans" in row[1] or "spans" not in row[1] for row in migrated["views"])


def test_downgrade_to_0001_removes_exactly_the_views_and_the_index(database: Database) -> None:
    upgrade_to(database)
    with_views = catalogue(database)
    database.run(lambda conn: migrate.downgrade(conn, database.schema, "0001"), migrating=True)
    assert version_rows(database) == ["0001"]
    assert _view_names(database) == set()
    assert REWARD_INDEX not in _index_names(database)
    upgrade_to(database)
    assert version_rows(database) == [migrate.HEAD_REVISION]
    assert catalogue(database) == with_views


def _write_at_0001(conn: Connection) -> None:
    s = schema_module
    run_id = conn.execute(
        insert(s.runs).values(name="old", status="active", created_at=1.0, seq=3).returning(s.runs.c.run_id)
    ).scalar_one()
    conn.execute(
        insert(s.rollouts).values(
            run_id=run_id, rollout_id="ro-1", status="succeeded", mode="train", max_attempts=1,
            retry_condition=[], start_time=10.0, end_time=14.0, create_seq=1, attempt_count=1,
        )
    )
    conn.execute(
        insert(s.attempts).values(
            run_id=run_id, rollout_id="ro-1", attempt_id="at-1", sequence_id=1, status="succeeded",
            worker_id="w-1", start_time=11.0, end_time=14.0,
        )
    )
    for seq, value in ((1, 0.25), (2, 0.75)):
        conn.execute(
            insert(s.spans).values(
                run_id=run_id, rollout_id="ro-1", attempt_id="at-1", sequence_id=seq, trace_id="t",
                span_id=f"s{seq}", name="agentlightning.annotation", status_code="OK", start_time=12.0 + seq,
                attributes={"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value},
            )
        )


def _read(database: Database, sql: str) -> list[tuple[Any, ...]]:
    def read(conn: Connection) -> list[tuple[Any, ...]]:
        if database.schema is not None:
            conn.execute(text("SELECT set_config('search_path', :path, true)"), {"path": f'"{database.schema}"'})
        return [tuple(row) for row in conn.execute(text(sql)).all()]

    return database.run(read)


def test_data_written_at_0001_shows_in_the_views_after_the_upgrade(database: Database) -> None:
    upgrade_to(database, "0001")
    database.run(_write_at_0001)
    upgrade_to(database)
    assert _read(
        database,
        "SELECT run_name, rollout_id, attempts, latest_worker_id, duration_seconds, final_reward "
        "FROM rollout_summary_v1",
    ) == [("old", "ro-1", 1, "w-1", 4.0, 0.75)]
    assert _read(database, "SELECT sequence_id, reward_value FROM rewards_v1 ORDER BY sequence_id") == [
        (1, 0.25),
        (2, 0.75),
    ]
    assert _read(database, "SELECT attempt_number, is_latest, duration_seconds FROM attempts_v1") == [(1, 1, 3.0)]


def test_final_reward_reads_the_partial_index(database: Database) -> None:
    ensure(database)
    database.run(_write_at_0001)
    if isinstance(database, PostgresDatabase):
        plan = _read(
            database,
            "EXPLAIN SELECT final_reward FROM rollout_summary_v1 WHERE run_id = 1",
        )
        # Tiny tables: PostgreSQL's planner may prefer a scan; the index must at least be usable.
        database_plan = " ".join(str(row[0]) for row in plan)

        def forced(conn: Connection) -> str:
            conn.execute(text("SELECT set_config('search_path', :path, true)"), {"path": f'"{database.schema}"'})
            conn.execute(text("SET LOCAL enable_seqscan = off"))
            conn.execute(text("SET LOCAL enable_bitmapscan = off"))
            rows = conn.execute(text("EXPLAIN SELECT final_reward FROM rollout_summary_v1 WHERE run_id = 1"))
            return " ".join(str(row[0]) for row in rows)

        database_plan = database.run(forced)
    else:
        plan = _read(database, "EXPLAIN QUERY PLAN SELECT final_reward FROM rollout_summary_v1 WHERE run_id = 1")
        database_plan = " ".join(str(row[-1]) for row in plan)
    assert REWARD_INDEX in database_plan, database_plan


@pytest.mark.parametrize("dialect_name", ["sqlite", "postgresql"])
def test_view_statements_quote_the_schema(dialect_name: str) -> None:
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = postgresql.dialect() if dialect_name == "postgresql" else sqlite.dialect()
    statements = views.create_statements(dialect, 'Odd "schema"')
    assert len(statements) == len(views.VIEW_NAMES)
    if dialect_name == "postgresql":
        assert all(statement.startswith('CREATE VIEW "Odd ""schema""".') for statement in statements)
        assert all('"Odd ""schema""".spans' in s or "spans" not in s for s in statements)
    else:
        assert all("schema" not in statement.split(" AS", 1)[0] for statement in statements)
    assert views.drop_statements(dialect, None) == [f"DROP VIEW IF EXISTS {n}" for n in reversed(views.VIEW_NAMES)]
