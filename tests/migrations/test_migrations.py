"""Migrations on SQLite and PostgreSQL (docs/architecture.md §9, docs/store-contract.md §4).

models == migrations (no autogenerate diff, and `check` can fail), catalogue after `upgrade head` ==
catalogue of a fresh `create_all`, upgrade -> downgrade -> upgrade, data surviving an upgrade,
the `ensure_schema` guards (auto_migrate, read_only, incompatible newer schema), concurrent
ensure_schema, Alembic by hand, and an upgrade from an installed, non-editable wheel.

The databases are driven the way the store drives them: SQLite through a sync engine whose
transactions are `BEGIN IMMEDIATE`, with foreign keys ON except while migrating (then under the
sidecar file lock); PostgreSQL through asyncpg and `AsyncConnection.run_sync`, on an engine that
maps the schema-less tables onto a throwaway schema (`schema_translate_map`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
import threading
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Column,
    Connection,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    create_engine,
    event,
    func,
    insert,
    inspect,
    make_url,
    select,
    text,
)
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from lightning_sql.store.sql import migrate
from lightning_sql.store.sql import schema as schema_module
from lightning_sql.store.sql.migrate import HEAD_REVISION, SchemaError

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
POSTGRES_URL = make_url(
    os.environ.get("LIGHTNING_SQL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
).set(drivername="postgresql+asyncpg")
OUR_TABLES = {table.name for table in schema_module.ALL_TABLES}


# -- databases -------------------------------------------------------------------------------------


class SqliteDatabase:
    """A SQLite file, opened like the store opens it."""

    dialect = "sqlite"
    schema: str | None = None

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url_for_messages = f"sqlite:///{path}"
        self.engine = create_engine(self.url_for_messages, poolclass=NullPool)

        @event.listens_for(self.engine, "connect")
        def _manual_transactions(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None

        @event.listens_for(self.engine, "begin")
        def _begin_immediate(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    def run(self, fn: Callable[[Connection], T], *, migrating: bool = False) -> T:
        """Run ``fn`` in one committed transaction; ``migrating`` takes the sidecar file lock and
        switches foreign keys off before beginning, as the store does."""
        lock = migrate.migration_file_lock(self.path) if migrating else contextlib.nullcontext()
        with lock, self.engine.connect() as conn:
            # On the DBAPI connection: through SQLAlchemy it would autobegin, and inside a
            # transaction the pragma is a no-op.
            driver = conn.connection.driver_connection
            assert driver is not None
            driver.execute(f"PRAGMA foreign_keys={'OFF' if migrating else 'ON'}")
            with conn.begin():
                return fn(conn)

    def drop(self) -> None:
        self.engine.dispose()


class PostgresDatabase:
    """A throwaway schema of the test PostgreSQL database, reached through asyncpg."""

    dialect = "postgresql"

    def __init__(self, schema: str) -> None:
        self.schema: str | None = schema
        self.url_for_messages = POSTGRES_URL.render_as_string(hide_password=True)

    def run(self, fn: Callable[[Connection], T], *, migrating: bool = False) -> T:
        """Run ``fn`` in one committed transaction through ``run_sync`` (a fresh engine per call, so
        threads and event loops never share a connection)."""

        async def go() -> T:
            engine = create_async_engine(
                POSTGRES_URL,
                poolclass=NullPool,
                execution_options={"schema_translate_map": {None: self.schema}},
            )
            try:
                async with engine.begin() as conn:
                    return await conn.run_sync(fn)
            finally:
                await engine.dispose()

        return asyncio.run(go())

    def drop(self) -> None:
        quoted = '"' + str(self.schema).replace('"', '""') + '"'
        self.run(lambda conn: conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {quoted} CASCADE"))


Database = SqliteDatabase | PostgresDatabase

_postgres_error: list[str] = []


def _require_postgres() -> None:
    if not _postgres_error:
        try:
            PostgresDatabase("public").run(lambda conn: conn.exec_driver_sql("SELECT 1").scalar())
            _postgres_error.append("")
        except Exception as error:  # noqa: BLE001 - any failure means "no PostgreSQL here"
            _postgres_error.append(f"PostgreSQL unreachable at {POSTGRES_URL}: {error!r}")
    if _postgres_error[0]:
        if os.environ.get("LIGHTNING_SQL_REQUIRE_POSTGRES") == "1":
            pytest.fail(_postgres_error[0])
        pytest.skip(_postgres_error[0])


def _unique_schema() -> str:
    return f"lsql_test_{uuid.uuid4().hex[:12]}"


def _open(kind: str, tmp_path: Path, name: str = "run") -> Database:
    if kind == "sqlite":
        return SqliteDatabase(tmp_path / f"{name}.db")
    _require_postgres()
    return PostgresDatabase(_unique_schema())


@pytest.fixture
def open_database(tmp_path: Path) -> Iterator[Callable[..., Database]]:
    """Open extra databases of a kind; each is dropped after the test."""
    opened: list[Database] = []

    def opener(kind: str, name: str = "extra") -> Database:
        database = _open(kind, tmp_path, name)
        opened.append(database)
        return database

    yield opener
    for database in opened:
        database.drop()


BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def database(request: pytest.FixtureRequest, open_database: Callable[..., Database]) -> Database:
    return open_database(request.param, "run")


# -- helpers ---------------------------------------------------------------------------------------


def upgrade_to(database: Database, revision: str = "head") -> None:
    """``migrate.upgrade`` to ``revision`` under the migration lock, as ``lightning-sql db upgrade``."""
    database.run(lambda conn: migrate.upgrade(conn, database.schema, revision), migrating=True)


def downgrade_to(database: Database, revision: str) -> None:
    database.run(lambda conn: migrate.downgrade(conn, database.schema, revision), migrating=True)


def ensure(database: Database, *, auto_migrate: bool = True, read_only: bool = False) -> None:
    database.run(
        lambda conn: migrate.ensure_schema(
            conn,
            schema=database.schema,
            auto_migrate=auto_migrate,
            read_only=read_only,
            url_for_messages=database.url_for_messages,
        ),
        migrating=auto_migrate and not read_only,
    )


def version_rows(database: Database) -> list[str]:
    def read(conn: Connection) -> list[str]:
        table = migrate._version_table(database.schema)
        if not inspect(conn).has_table(table.name, schema=database.schema):
            return []
        return list(conn.execute(table.select()).scalars())

    return database.run(read)


def compat_marker(database: Database) -> str | None:
    def read(conn: Connection) -> str | None:
        table = migrate._compat_table(database.schema)
        if not inspect(conn).has_table(table.name, schema=database.schema):
            return None
        return conn.execute(table.select()).scalar_one()

    return database.run(read)


def table_names(database: Database) -> set[str]:
    return set(database.run(lambda conn: inspect(conn).get_table_names(schema=database.schema)))


def pg_schema_count(database: Database) -> int:
    query = text("SELECT count(*) FROM pg_namespace WHERE nspname = :schema")
    return int(database.run(lambda conn: conn.execute(query, {"schema": database.schema}).scalar_one()))


def check(database: Database, target_metadata: MetaData | None = None) -> list[Any]:
    return database.run(lambda conn: migrate.check(conn, database.schema, target_metadata=target_metadata))


def metadata_copy() -> MetaData:
    copy = MetaData(naming_convention=schema_module.NAMING_CONVENTION)
    for table in schema_module.metadata.sorted_tables:
        table.to_metadata(copy)
    return copy


def stamp(database: Database, revision: str, min_code_revision: str | None) -> None:
    """Pretend a newer release migrated the database: rewrite the version and the compat marker."""

    def write(conn: Connection) -> None:
        version = migrate._version_table(database.schema)
        conn.execute(version.update().values(version_num=revision))
        compat = migrate._compat_table(database.schema)
        conn.execute(compat.delete())
        if min_code_revision is not None:
            conn.execute(compat.insert().values(min_code_revision=min_code_revision))

    database.run(write, migrating=True)


# -- script directory ------------------------------------------------------------------------------


def test_head_revision_is_alembics_head() -> None:
    script = ScriptDirectory(str(migrate.script_location()))
    assert script.get_heads() == [HEAD_REVISION]
    for revision in script.walk_revisions():
        assert re.fullmatch(r"\d{4}", revision.revision), revision.revision
        assert Path(str(revision.path)).name.startswith(f"{revision.revision}_"), revision.path


def test_script_location_holds_env_and_revisions() -> None:
    location = migrate.script_location()
    assert (location / "env.py").is_file()
    assert (location / "script.py.mako").is_file()
    assert (location / "versions" / "0001_initial.py").is_file()


def test_sqlite_refuses_a_schema_name(tmp_path: Path) -> None:
    database = SqliteDatabase(tmp_path / "run.db")
    with pytest.raises(ValueError, match="schema='lightning_sql'"):
        database.run(lambda conn: migrate.current_revision(conn, "lightning_sql"))


# -- models == migrations == fresh create ----------------------------------------------------------


def test_empty_database_to_head_creates_every_table(database: Database) -> None:
    assert database.run(lambda conn: migrate.current_revision(conn, database.schema)) is None
    ensure(database)
    assert database.run(lambda conn: migrate.current_revision(conn, database.schema)) == HEAD_REVISION
    assert version_rows(database) == [HEAD_REVISION]
    assert table_names(database) == OUR_TABLES | migrate.BOOKKEEPING_TABLES
    assert compat_marker(database) == MIN_CODE_REVISION


def test_migrated_database_matches_the_models(database: Database) -> None:
    ensure(database)
    assert check(database) == []


@pytest.mark.parametrize(
    "change",
    ["column type", "added column", "server default", "index predicate", "dropped table", "collation"],
)
def test_check_catches_real_differences(database: Database, change: str) -> None:
    ensure(database)
    model = metadata_copy()
    if change == "column type":
        model.tables["runs"].c.status.type = String(32)
    elif change == "added column":
        model.tables["workers"].append_column(Column("labels", Text()))
    elif change == "server default":
        model.tables["runs"].c.seq.server_default = None
    elif change == "index predicate":
        rollouts = model.tables["rollouts"]
        queue_index = next(ix for ix in rollouts.indexes if ix.name == "ix_rollouts_queue")
        rollouts.indexes.discard(queue_index)
        Index("ix_rollouts_queue", rollouts.c.run_id, rollouts.c.queue_seq)  # the predicate forgotten
    elif change == "dropped table":
        model.remove(model.tables["resource_versions"])
    elif change == "collation":
        if database.dialect == "sqlite":
            pytest.skip("SQLite ids use the default BINARY collation; there is no collation to lose")
        model.tables["attempts"].c.worker_id.type = Text()
    assert check(database, model) != []


def _sqlite_catalogue(conn: Connection) -> dict[tuple[str, str], tuple[str, str | None]]:
    rows = conn.exec_driver_sql("SELECT type, name, tbl_name, sql FROM sqlite_master").all()
    # A table rebuilt by a batch migration is renamed into place, which quotes its name: the same DDL.
    return {
        (kind, name): (table, None if sql is None else " ".join(sql.replace(f'TABLE "{name}"', f"TABLE {name}").split()))
        for kind, name, table, sql in rows
        if table not in migrate.BOOKKEEPING_TABLES
    }


_PG_CATALOGUE_QUERIES = {
    "columns": """
        SELECT table_name, column_name,
               -- the order of the columns, not their numbers (a dropped column leaves a gap)
               row_number() OVER (PARTITION BY table_name ORDER BY ordinal_position),
               data_type, character_maximum_length,
               numeric_precision, collation_name, is_nullable, column_default, is_identity
        FROM information_schema.columns WHERE table_schema = :schema""",
    "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = :schema",
    "constraints": """
        SELECT rel.relname, con.conname, con.contype, pg_get_constraintdef(con.oid)
        FROM pg_constraint con
        JOIN pg_class rel ON rel.oid = con.conrelid
        JOIN pg_namespace ns ON ns.oid = con.connamespace
        WHERE ns.nspname = :schema""",
    "sequences": """
        SELECT sequence_name, data_type, start_value, minimum_value, maximum_value, increment,
               cycle_option
        FROM information_schema.sequences WHERE sequence_schema = :schema""",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = :schema",
    # Statistics targets other than the default (revision 0003: the columns ANALYZE never samples).
    "statistics_targets": """
        SELECT rel.relname, att.attname, att.attstattarget
        FROM pg_attribute att
        JOIN pg_class rel ON rel.oid = att.attrelid
        JOIN pg_namespace ns ON ns.oid = rel.relnamespace
        WHERE ns.nspname = :schema AND rel.relkind = 'r' AND att.attnum > 0 AND NOT att.attisdropped
          AND att.attstattarget <> -1""",
}


def _pg_catalogue(conn: Connection, schema: str) -> dict[str, set[tuple[Any, ...]]]:
    catalogue: dict[str, set[tuple[Any, ...]]] = {}
    for name, query in _PG_CATALOGUE_QUERIES.items():
        rows = conn.execute(text(query), {"schema": schema}).all()
        catalogue[name] = {
            tuple(value.replace(schema, "<schema>") if isinstance(value, str) else value for value in row)
            for row in rows
            if row[0] not in migrate.BOOKKEEPING_TABLES
        }
    return catalogue


def catalogue(database: Database) -> Any:
    if isinstance(database, PostgresDatabase):
        return database.run(lambda conn: _pg_catalogue(conn, str(database.schema)))
    return database.run(_sqlite_catalogue)


def test_catalogue_after_upgrade_equals_a_fresh_create(
    database: Database, open_database: Callable[..., Database]
) -> None:
    ensure(database)
    fresh = open_database(database.dialect, "fresh")

    def create_all(conn: Connection) -> None:
        if fresh.schema is not None:
            migrate.prepare_pg_schema(conn, fresh.schema)
        schema_module.metadata.create_all(conn)

    fresh.run(create_all, migrating=True)
    migrated, created = catalogue(database), catalogue(fresh)
    assert migrated == created
    # The comparison must include what autogenerate cannot see: the queue's partial predicate.
    assert "queue_seq IS NOT NULL" in repr(migrated)
    if database.dialect == "postgresql":
        assert any(row[0] == "lightning_sql_position_seq" for row in migrated["sequences"])
        assert ("attempts", "worker_id") in {(row[0], row[1]) for row in migrated["columns"] if row[6] == "C"}
        assert migrated["statistics_targets"] == {
            (table, column, 0) for table, columns in schema_module.UNSAMPLED_COLUMNS.items() for column in columns
        }


def test_upgrade_downgrade_upgrade(database: Database) -> None:
    database.run(lambda conn: migrate.upgrade(conn, database.schema), migrating=True)
    assert version_rows(database) == [HEAD_REVISION]
    database.run(lambda conn: migrate.downgrade(conn, database.schema, "base"), migrating=True)
    assert version_rows(database) == []
    assert table_names(database) == {schema_module.VERSION_TABLE}
    if database.dialect == "postgresql":
        assert catalogue(database)["sequences"] == set()
    database.run(lambda conn: migrate.upgrade(conn, database.schema), migrating=True)
    assert version_rows(database) == [HEAD_REVISION]
    assert compat_marker(database) == MIN_CODE_REVISION
    assert check(database) == []


# -- ensure_schema ---------------------------------------------------------------------------------


def test_ensure_schema_twice_is_a_no_op(database: Database) -> None:
    ensure(database)
    statements: list[str] = []

    def second_time(conn: Connection) -> None:
        def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            statements.append(statement)

        event.listen(conn, "before_cursor_execute", record)
        try:
            migrate.ensure_schema(
                conn,
                schema=database.schema,
                auto_migrate=True,
                read_only=False,
                url_for_messages=database.url_for_messages,
            )
        finally:
            event.remove(conn, "before_cursor_execute", record)

    database.run(second_time, migrating=True)
    assert statements, "ensure_schema must read the version"
    writes = [s for s in statements if re.match(r"\s*(CREATE|ALTER|DROP|INSERT|UPDATE|DELETE)\b", s, re.I)]
    assert writes == []
    assert not [s for s in statements if "advisory" in s], "the fast path takes no lock"
    assert version_rows(database) == [HEAD_REVISION]


def test_ensure_schema_restores_the_callers_execution_options(database: Database) -> None:
    seen: list[Any] = []

    def migrate_and_look(conn: Connection) -> None:
        seen.append(conn.get_execution_options().get("schema_translate_map"))
        migrate.ensure_schema(
            conn,
            schema=database.schema,
            auto_migrate=True,
            read_only=False,
            url_for_messages=database.url_for_messages,
        )
        seen.append(conn.get_execution_options().get("schema_translate_map"))

    database.run(migrate_and_look, migrating=True)
    assert version_rows(database) == [HEAD_REVISION]
    assert seen[0] == seen[1]


@pytest.mark.parametrize(("auto_migrate", "read_only"), [(False, False), (True, True), (False, True)])
def test_empty_database_is_refused_without_migration_rights(
    database: Database, auto_migrate: bool, read_only: bool
) -> None:
    with pytest.raises(SchemaError) as raised:
        ensure(database, auto_migrate=auto_migrate, read_only=read_only)
    message = str(raised.value)
    assert "lightning-sql db upgrade" in message
    assert HEAD_REVISION in message
    assert database.url_for_messages in message
    if database.schema is not None:
        assert database.schema in message
        assert pg_schema_count(database) == 0, "a refused call creates nothing, not even the schema"
    else:
        assert table_names(database) == set()


def test_tables_without_a_version_are_refused(database: Database) -> None:
    def create_all(conn: Connection) -> None:
        if database.schema is not None:
            migrate.prepare_pg_schema(conn, database.schema)
        schema_module.metadata.create_all(conn)

    database.run(create_all, migrating=True)
    with pytest.raises(SchemaError, match="not created by lightning_sql's migrations"):
        ensure(database)


def test_unknown_incompatible_revision_is_refused(database: Database) -> None:
    ensure(database)
    stamp(database, "9999", min_code_revision="9999")
    for auto_migrate, read_only in [(True, False), (False, False), (False, True)]:
        with pytest.raises(SchemaError) as raised:
            ensure(database, auto_migrate=auto_migrate, read_only=read_only)
        message = str(raised.value)
        assert "9999" in message and HEAD_REVISION in message
        assert database.url_for_messages in message
    assert version_rows(database) == ["9999"]


def test_unknown_compatible_revision_is_used_as_it_is(database: Database) -> None:
    ensure(database)
    stamp(database, "9999", min_code_revision="0001")
    ensure(database)
    ensure(database, auto_migrate=False, read_only=True)
    assert version_rows(database) == ["9999"]


def test_unknown_revision_without_a_compat_marker_is_refused(database: Database) -> None:
    ensure(database)
    stamp(database, "9999", min_code_revision=None)
    with pytest.raises(SchemaError, match="9999"):
        ensure(database)


def test_concurrent_ensure_schema_creates_one_schema(database: Database) -> None:
    workers = 4
    barrier = threading.Barrier(workers, timeout=60)
    errors: list[BaseException] = []

    def open_store() -> None:
        try:
            barrier.wait()
            ensure(database)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=open_store) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert version_rows(database) == [HEAD_REVISION]
    assert check(database) == []
    if isinstance(database, PostgresDatabase):
        assert pg_schema_count(database) == 1


@pytest.mark.postgres
def test_postgres_schema_name_is_quoted() -> None:
    _require_postgres()
    database = PostgresDatabase(f'Odd "schema" {uuid.uuid4().hex[:8]}')
    try:
        ensure(database)
        assert version_rows(database) == [HEAD_REVISION]
        assert check(database) == []
    finally:
        database.drop()


# -- an older revision, a newer one, and older code ------------------------------------------------

# The test-only revision goes on top of the shipped head.
SHIPPED = HEAD_REVISION
# The newest shipped revision older code cannot run against (0005: the queue's back-off and priorities).
MIN_CODE_REVISION = "0005"
NEXT = f"{int(HEAD_REVISION) + 1:04d}"

REVISION_0002 = '''
"""Test-only revision: worker labels and a rollout shard (rebuilds a referenced table on SQLite)."""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "NEXT"
down_revision = "SHIPPED"
branch_labels = None
depends_on = None

compatible_with_older_code = False


def _rebuild_on_sqlite() -> str:
    # SQLite would add the column in place; force the copy-and-rename that real changes need.
    return "always" if op.get_context().dialect.name == "sqlite" else "auto"


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(
            sa.Column("labels", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True)
        )
    with op.batch_alter_table("rollouts", recreate=_rebuild_on_sqlite()) as batch:
        batch.add_column(sa.Column("shard", sa.Integer(), nullable=False, server_default=sa.text("0")))


def downgrade() -> None:
    with op.batch_alter_table("rollouts", recreate=_rebuild_on_sqlite()) as batch:
        batch.drop_column("shard")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("labels")
'''


@pytest.fixture
def code_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Switch the code between the shipped revisions (``SHIPPED``) and a copy that adds ``NEXT``."""
    shipped = migrate.script_location()
    newer = tmp_path / "migrations_0002"
    shutil.copytree(shipped, newer, ignore=shutil.ignore_patterns("__pycache__"))
    (newer / "versions" / f"{NEXT}_worker_labels.py").write_text(
        REVISION_0002.replace('"NEXT"', repr(NEXT)).replace('"SHIPPED"', repr(SHIPPED))
    )

    def use(head: str) -> None:
        location = newer if head == NEXT else shipped
        monkeypatch.setattr(migrate, "script_location", lambda: location)
        monkeypatch.setattr(migrate, "HEAD_REVISION", head)
        migrate._script_directory.cache_clear()
        migrate._known_revisions.cache_clear()

    yield use
    migrate._script_directory.cache_clear()
    migrate._known_revisions.cache_clear()


def _write_sample_run(conn: Connection) -> None:
    s = schema_module
    run_id = conn.execute(
        insert(s.runs).values(name="r1", status="running", created_at=1.0, seq=5).returning(s.runs.c.run_id)
    ).scalar_one()
    conn.execute(
        insert(s.rollouts).values(
            run_id=run_id,
            rollout_id="ro-1",
            input={"q": 1},
            status="queuing",
            max_attempts=1,
            retry_condition=[],
            start_time=1.0,
            queue_seq=1,
            create_seq=1,
        )
    )
    conn.execute(
        insert(s.attempts).values(
            run_id=run_id,
            rollout_id="ro-1",
            attempt_id="at-1",
            sequence_id=1,
            status="running",
            start_time=1.0,
        )
    )
    conn.execute(
        insert(s.spans).values(
            run_id=run_id,
            rollout_id="ro-1",
            attempt_id="at-1",
            sequence_id=1,
            trace_id="t",
            span_id="s",
            name="reward",
            status_code="OK",
            attributes={"reward": 1.0},
        )
    )
    conn.execute(insert(s.workers).values(run_id=run_id, worker_id="w-1", status="idle", create_seq=2))


def _read_sample_run(conn: Connection) -> tuple[Any, ...]:
    s = schema_module
    return (
        tuple(conn.execute(select(s.runs.c.name, s.runs.c.seq)).one()),
        tuple(
            conn.execute(select(s.rollouts.c.rollout_id, s.rollouts.c.input, s.rollouts.c.queue_seq)).one()
        ),
        conn.execute(select(func.count()).select_from(s.attempts)).scalar(),
        tuple(conn.execute(select(s.spans.c.span_id, s.spans.c.attributes)).one()),
        conn.execute(select(s.workers.c.worker_id)).scalar(),
    )


def _model_at_0002() -> MetaData:
    model = metadata_copy()
    model.tables["workers"].append_column(Column("labels", schema_module.JsonValue()))
    model.tables["rollouts"].append_column(
        Column("shard", Integer, nullable=False, server_default=text("0"))
    )
    return model


def test_older_schema_is_upgraded_with_its_data_and_guards_older_code(
    database: Database, code_versions: Callable[[str], None]
) -> None:
    code_versions(SHIPPED)
    ensure(database)
    database.run(_write_sample_run)
    before = database.run(_read_sample_run)

    code_versions(NEXT)
    for auto_migrate, read_only in [(False, False), (True, True)]:
        with pytest.raises(SchemaError) as raised:
            ensure(database, auto_migrate=auto_migrate, read_only=read_only)
        assert "lightning-sql db upgrade" in str(raised.value)
        assert SHIPPED in str(raised.value) and NEXT in str(raised.value)
    if isinstance(database, SqliteDatabase):
        # Batch mode rebuilds tables: foreign keys must be off before the transaction begins.
        with pytest.raises(SchemaError, match="foreign_keys"):
            database.run(lambda conn: migrate.upgrade(conn, None), migrating=False)
    assert version_rows(database) == [SHIPPED]

    ensure(database)
    assert version_rows(database) == [NEXT]
    assert compat_marker(database) == NEXT
    assert database.run(_read_sample_run) == before
    # The rebuilt rollouts table kept its partial queue index and everything else.
    assert check(database, _model_at_0002()) == []

    code_versions(SHIPPED)
    with pytest.raises(SchemaError) as raised:
        ensure(database, auto_migrate=False, read_only=True)
    assert NEXT in str(raised.value) and SHIPPED in str(raised.value)

    code_versions(NEXT)
    database.run(lambda conn: migrate.downgrade(conn, database.schema, SHIPPED), migrating=True)
    assert version_rows(database) == [SHIPPED]
    assert compat_marker(database) == MIN_CODE_REVISION
    assert database.run(_read_sample_run) == before
    code_versions(SHIPPED)
    ensure(database)
    assert check(database) == []


# -- alembic by hand and the installed wheel -------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LIGHTNING_SQL"))}
    env.update(extra)
    return env


def test_alembic_by_hand(database: Database) -> None:
    if isinstance(database, SqliteDatabase):
        url, args = database.url_for_messages, []
    else:
        url, args = POSTGRES_URL.render_as_string(hide_password=False), ["-x", f"schema={database.schema}"]
    env = _clean_env(LIGHTNING_SQL_URL=url)
    alembic = [sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini"), *args]
    for command in (["upgrade", "head"], ["current"]):
        done = subprocess.run(
            [*alembic, *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
    assert HEAD_REVISION in done.stdout
    assert version_rows(database) == [HEAD_REVISION]
    assert compat_marker(database) == MIN_CODE_REVISION
    assert check(database) == []
    ensure(database, auto_migrate=False, read_only=True)


WHEEL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from sqlalchemy import create_engine, event
    import lightning_sql
    from lightning_sql.store.sql import migrate

    path = sys.argv[1]
    engine = create_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _manual(dbapi_connection, _record):
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    with migrate.migration_file_lock(path), engine.connect() as conn:
        with conn.begin():
            migrate.ensure_schema(
                conn, schema=None, auto_migrate=True, read_only=False, url_for_messages=path
            )
    with engine.connect() as conn:
        revision = migrate.current_revision(conn, None)
        diff = migrate.check(conn, None)
    print(json.dumps({
        "package": lightning_sql.__file__,
        "scripts": str(migrate.script_location()),
        "revision": revision,
        "diff": repr(diff),
    }))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_upgrade_from_an_installed_wheel(tmp_path: Path) -> None:
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    source.mkdir()
    for name in ("lightning_sql", "migrations"):
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "alembic.ini", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(source), "-w", str(wheels)],
        capture_output=True,
        text=True,
        timeout=80,
        env=_clean_env(),
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("lightning_sql-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("versions/0001_initial.py", "env.py", "script.py.mako"):
        assert f"lightning_sql/migrations/{shipped}" in names
    assert not [name for name in names if name.split("/")[0] == "migrations"], "no top-level package"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=60)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # The dependencies come from the environment running this test (a virtualenv or not); a path
    # listed in a .pth file goes on sys.path after the venv's own site-packages, and .pth files in it
    # (such as the repo's editable install) are not processed: the wheel is what gets imported.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    Path(purelib, "_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert installed.returncode == 0, installed.stderr

    database = tmp_path / "wheel.db"
    ran = subprocess.run(
        [str(python), "-I", "-c", WHEEL_SCRIPT, str(database)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    assert report["revision"] == HEAD_REVISION
    assert report["diff"] == "[]"
    assert Path(report["package"]).resolve().is_relative_to(venv.resolve())
    scripts = Path(report["scripts"]).resolve()
    assert scripts.is_relative_to(venv.resolve()) and scripts.parts[-2:] == ("lightning_sql", "migrations")
