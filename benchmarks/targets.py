"""The stores under test: ``sqlite`` and ``postgres`` (SqlLightningStore), B1 and B2 (Agent-Lightning 0.3).

Every workload repetition opens a fresh target (a new SQLite file, a new throwaway PostgreSQL
schema, a new in-memory store) so that repetitions do not grow each other's tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

PG_URL_ENV = "LIGHTNING_SQL_BENCH_POSTGRES_URL"
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
SQL_TARGETS = ("sqlite", "postgres")
BASELINE_TARGETS = ("B1", "B2")
RUN_NAME = "bench"

_schema_ids = itertools.count(1)


def pg_url() -> str:
    return os.environ.get(PG_URL_ENV, DEFAULT_PG_URL)


def pg_dsn(url: str | None = None) -> str:
    return (url or pg_url()).replace("postgresql+asyncpg://", "postgresql://")


def agentlightning_available() -> tuple[bool, str]:
    """Whether Agent-Lightning 0.3 can be imported (offline), and why not."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import agentlightning
        from agentlightning.store import InMemoryLightningStore  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no baseline"
        return False, f"agentlightning is not importable ({type(exc).__name__}: {exc}); pip install '.[bench]'"
    version = getattr(agentlightning, "__version__", "?")
    if not str(version).startswith("0.3"):
        return False, f"agentlightning {version} is installed; the baselines need 0.3.x"
    return True, ""


async def postgres_available() -> tuple[bool, str]:
    import asyncpg

    try:
        conn = await asyncpg.connect(pg_dsn(), timeout=5)
        await conn.close()
    except Exception as exc:  # noqa: BLE001
        return False, f"PostgreSQL at {PG_URL_ENV}={pg_url()} is unreachable ({type(exc).__name__}: {exc})"
    return True, ""


async def drop_schema(schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(pg_dsn(), timeout=10)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Target:
    """One opened store under test, with the model classes its API takes."""

    name: str
    store: Any
    span_cls: type[Any]
    request_cls: type[Any]
    # How another process reaches the same store: ("sql", url, schema) or ("http", endpoint).
    remote: tuple[Any, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dialect(self) -> str | None:
        return {"sqlite": "sqlite", "postgres": "postgresql"}.get(self.name)


def sql_store_options(name: str) -> dict[str, Any]:
    # Production defaults (10 s sweep debounce, the real clock); only the run is pinned.
    return {"run": RUN_NAME}


@contextlib.asynccontextmanager
async def open_target(name: str, workdir: str, **store_options: Any) -> AsyncIterator[Target]:
    """A fresh store of kind ``name`` ("sqlite", "postgres", "B1", "B2"), closed and removed after;
    ``store_options`` go to ``SqlLightningStore`` (the SQL targets only)."""
    if name == "sqlite":
        from lightning_sql import SqlLightningStore
        from lightning_sql.types import EnqueueRolloutRequest, Span

        directory = tempfile.mkdtemp(prefix="bench-sqlite-", dir=workdir)
        url = f"sqlite:///{directory}/bench.db"
        store = SqlLightningStore(url, **sql_store_options(name), **store_options)
        try:
            await store.statistics()  # open, migrate and bind the run outside the timings
            yield Target(name, store, Span, EnqueueRolloutRequest, remote=("sql", url, None), extra={"path": f"{directory}/bench.db"})
        finally:
            await store.close()
            shutil.rmtree(directory, ignore_errors=True)
    elif name == "postgres":
        from lightning_sql import SqlLightningStore
        from lightning_sql.types import EnqueueRolloutRequest, Span

        schema = f"bench_{os.getpid()}_{next(_schema_ids)}"
        url = pg_url()
        store = SqlLightningStore(url, schema=schema, **sql_store_options(name), **store_options)
        try:
            await store.statistics()
            yield Target(name, store, Span, EnqueueRolloutRequest, remote=("sql", url, schema), extra={"schema": schema})
        finally:
            await store.close()
            await drop_schema(schema)
    elif name == "B1":
        from agentlightning.store import InMemoryLightningStore
        from agentlightning.types import EnqueueRolloutRequest, Span

        yield Target(name, InMemoryLightningStore(), Span, EnqueueRolloutRequest)
    elif name == "B2":
        from agentlightning.store import InMemoryLightningStore, LightningStoreClient, LightningStoreServer
        from agentlightning.store.client_server import API_V1_AGL_PREFIX
        from agentlightning.types import EnqueueRolloutRequest, Span
        from agentlightning.utils.server_launcher import PythonServerLauncherArgs

        backing = InMemoryLightningStore(thread_safe=True)
        args = PythonServerLauncherArgs(
            port=free_port(),
            host="127.0.0.1",
            access_host="127.0.0.1",
            launch_mode="thread",
            healthcheck_url=API_V1_AGL_PREFIX + "/health",
            log_level=logging.WARNING,
        )
        server = LightningStoreServer(backing, launcher_args=args)
        await server.start()
        client = LightningStoreClient(server.endpoint)
        try:
            yield Target(name, client, Span, EnqueueRolloutRequest, remote=("http", server.endpoint))
        finally:
            await client.close()
            await server.stop()
    else:
        raise ValueError(f"unknown target {name!r}")


async def open_remote(remote: tuple[Any, ...]) -> Any:
    """Open the store of another process's target (W7 runner processes)."""
    if remote[0] == "sql":
        from lightning_sql import SqlLightningStore

        _kind, url, schema = remote
        kwargs: dict[str, Any] = {"run": RUN_NAME, "create_run": False}
        if schema is not None:
            kwargs["schema"] = schema
        return SqlLightningStore(url, **kwargs)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from agentlightning.store import LightningStoreClient

    return LightningStoreClient(remote[1])


async def close_store(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        result = close()
        if asyncio.iscoroutine(result):
            await result
