"""The server's read-only connection to the store's database: the dashboard's pages, the
``/metrics`` gauges and the look-up of a span's run (``catalog.py``) read through it.

It never migrates nor writes: SQLite files are opened with ``mode=ro`` and PostgreSQL sessions start
with ``default_transaction_read_only``, so a bug here cannot change a run.  The pool holds at most
two connections: each use is a handful of short queries, and the database belongs to the training
job first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Executable
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from lightning_sql.store.sql.schema import DEFAULT_PG_SCHEMA
from lightning_sql.store.sql.urls import normalise_url

POOL_SIZE = 2
SQLITE_BUSY_TIMEOUT_SECONDS = 5.0


def read_only_engine(url: str, schema: str | None) -> tuple[AsyncEngine, str]:
    """An async engine that can only read the store at ``url``, and its dialect name."""
    target = normalise_url(url)
    if target.kind == "sqlite-memory":
        raise ValueError("The dashboard reads a database another process writes: an in-memory SQLite store has none")
    if target.dialect == "sqlite":
        assert target.path is not None
        if not Path(target.path).is_file():
            raise ValueError(f"No SQLite database at {target.path!r}")
        ro_url = URL.create(
            "sqlite+aiosqlite",
            database=f"file:{target.path}?mode=ro",
            query={"uri": "true"},
        )
        engine = create_async_engine(
            ro_url,
            pool_size=POOL_SIZE,
            max_overflow=0,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS},
        )
        return engine, "sqlite"
    pg_url: URL = target.url
    engine = create_async_engine(
        pg_url,
        pool_size=POOL_SIZE,
        max_overflow=0,
        pool_pre_ping=True,
        connect_args={"server_settings": {"default_transaction_read_only": "on", "application_name": "lightning-sql-dashboard"}},
        execution_options={"schema_translate_map": {None: schema or DEFAULT_PG_SCHEMA}},
    )
    return engine, "postgresql"


class Database:
    """Runs statements on a read-only engine."""

    def __init__(self, url: str, schema: str | None) -> None:
        self.engine, self.dialect = read_only_engine(url, schema)

    async def rows(self, stmt: Executable) -> Sequence[Any]:
        async with self.engine.connect() as conn:
            result = await conn.execute(stmt)
            return result.all()

    async def many(self, *stmts: Executable) -> list[Sequence[Any]]:
        """Several statements on one connection, in order."""
        out: list[Sequence[Any]] = []
        async with self.engine.connect() as conn:
            for stmt in stmts:
                out.append((await conn.execute(stmt)).all())
        return out

    async def close(self) -> None:
        await self.engine.dispose()
