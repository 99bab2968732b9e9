"""Alembic environment for lightning_sql.

Two ways in:

* Programmatic (``lightning_sql.store.sql.migrate``): ``config.attributes["connection"]`` is a sync
  Connection inside the caller's transaction, already locked, and ``config.attributes["schema"]``
  the PostgreSQL schema (``None`` on SQLite).  Nothing here configures logging, commits or closes.
* By hand (``alembic upgrade head`` at the repository top): the URL comes from the environment
  variable ``LIGHTNING_SQL_URL``, the PostgreSQL schema from ``-x schema=NAME``, else
  ``LIGHTNING_SQL_SCHEMA``, else ``lightning_sql``.  This path opens its own transaction and takes
  the same locks as the store.  Autogenerate new revisions against a SQLite URL so that the
  rendered operations carry no schema name.

On PostgreSQL every object lives in the configured schema: the revisions use schema-less names,
which ``migrate.migration_namespace`` points at the schema (``schema_translate_map`` plus a
transaction-local ``search_path``); the version table is put there explicitly
(``version_table_schema``).
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import Connection, make_url, pool
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from lightning_sql.store.sql import migrate
from lightning_sql.store.sql.schema import DEFAULT_PG_SCHEMA, VERSION_TABLE, metadata

config = context.config


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Keep the migration bookkeeping tables out of autogenerate."""
    return not (type_ == "table" and name in migrate.BOOKKEEPING_TABLES)


def run_migrations_on(connection: Connection, schema: str | None) -> None:
    """Run the requested migrations on ``connection`` inside its current transaction."""
    with migrate.migration_namespace(connection, schema):
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table=VERSION_TABLE,
            version_table_schema=schema,
            render_as_batch=True,
            include_name=include_name,
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
            migrate.write_compat_marker(connection, schema, context.script)


def _url_from_environment() -> URL:
    raw = os.environ.get("LIGHTNING_SQL_URL") or config.get_main_option("sqlalchemy.url")
    if not raw:
        raise SystemExit("set LIGHTNING_SQL_URL to the database to migrate, e.g. sqlite:///run.db")
    url = make_url(raw)
    if url.get_backend_name() == "postgresql":
        # The store talks to PostgreSQL through asyncpg only (store-contract §4).
        url = url.set(drivername="postgresql+asyncpg")
    elif url.get_backend_name() == "sqlite":
        url = url.set(drivername="sqlite")
    else:
        raise SystemExit(f"unsupported database URL {url.render_as_string(hide_password=True)}")
    return url


def _schema_by_hand(url: URL) -> str | None:
    requested = context.get_x_argument(as_dictionary=True).get("schema") or os.environ.get(
        "LIGHTNING_SQL_SCHEMA"
    )
    if url.get_backend_name() == "sqlite":
        if requested:
            raise SystemExit(f"schema={requested!r}: SQLite has no schemas")
        return None
    return requested or DEFAULT_PG_SCHEMA


def _migrate_sqlite_by_hand(url: URL) -> None:
    from lightning_sql.store.sql.sqlite_executor import migration_transaction, sqlite_engine

    database = url.database if url.database and url.database != ":memory:" else None
    engine = sqlite_engine(database or ":memory:")
    try:
        with engine.connect() as connection, migration_transaction(connection, database):
            run_migrations_on(connection, None)
            migrate.check_sqlite_foreign_keys(connection)
    finally:
        engine.dispose()


async def _migrate_postgresql_by_hand(url: URL, schema: str | None) -> None:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(_locked_run, schema)
    finally:
        await engine.dispose()


def _locked_run(connection: Connection, schema: str | None) -> None:
    migrate.take_migration_lock(connection)
    run_migrations_on(connection, schema)


def run_migrations_offline() -> None:
    url = _url_from_environment()
    schema = _schema_by_hand(url)
    context.configure(
        url=url,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        if schema is not None:
            # No connection to carry schema_translate_map: point unqualified names at the schema.
            quoted = context.get_context().dialect.identifier_preparer.quote_identifier(schema)
            context.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
            context.execute(f"SET search_path TO {quoted}")
        # The lightning_sql_compat marker is not scripted: until an online upgrade or downgrade
        # writes it, code older than the database's revision refuses the database (the safe side).
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        run_migrations_on(connection, config.attributes.get("schema"))
        return
    url = _url_from_environment()
    if url.get_backend_name() == "sqlite":
        _migrate_sqlite_by_hand(url)
    else:
        asyncio.run(_migrate_postgresql_by_hand(url, _schema_by_hand(url)))


# Only the alembic command line configures logging; a library caller keeps its own.
if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
