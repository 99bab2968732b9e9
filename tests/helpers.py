"""Test helpers: a fake clock usable across processes, PostgreSQL schema management."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import struct
import tempfile
from pathlib import Path

import asyncpg


class FakeClock:
    """A mutable, picklable fake local clock.

    The time lives in a small file, so copies pickled into child processes (spawn) read and move the
    same time as the parent.  Call it to read; ``advance(s)`` / ``set(t)`` to move it.
    """

    def __init__(self, start: float, path: str | None = None) -> None:
        if path is None:
            fd, path = tempfile.mkstemp(prefix="lsql-clock-")
            os.close(fd)
        self.path = path
        self.set(start)

    def __call__(self) -> float:
        with open(self.path, "rb") as fh:
            data = fh.read(8)
        return struct.unpack("<d", data)[0]

    def set(self, value: float) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<d", float(value)))
        os.replace(tmp, self.path)

    def advance(self, seconds: float) -> float:
        value = self() + seconds
        self.set(value)
        return value

    def remove(self) -> None:
        """Delete the clock's file (when its test is done with it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.path = state["path"]

    def __repr__(self) -> str:
        return f"FakeClock({Path(self.path).name})"


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


@functools.lru_cache(maxsize=8)
def pg_available(url: str) -> tuple[bool, str]:
    async def probe() -> None:
        conn = await asyncpg.connect(_dsn(url), timeout=5)
        await conn.close()

    try:
        asyncio.run(probe())
    except Exception as exc:  # noqa: BLE001
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


async def pg_execute(url: str, sql: str) -> None:
    """Run SQL text (DDL, grants) on a connection of its own, as the URL's user."""
    conn = await asyncpg.connect(_dsn(url), timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def pg_fetch(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    """The rows of one query with bound ``args``, on a connection of its own, as the URL's user."""
    conn = await asyncpg.connect(_dsn(url), timeout=10)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


def drop_pg_schema(url: str, schema: str) -> None:
    asyncio.run(pg_execute(url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
