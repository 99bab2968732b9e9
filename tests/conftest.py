"""Shared fixtures: one store factory parametrised over every backend (docs/architecture.md §12).

Backends: ``sqlite_file`` (writer thread), ``sqlite_memory`` and ``postgres`` (asyncpg, one
throwaway PostgreSQL schema per test, dropped afterwards).  A ``sqlite+aiosqlite://`` URL is served
by the very executor of ``sqlite://`` (``urls.py``), so it is no backend of its own: one test checks
that it names the same store (``tests/contract/test_limits_and_urls.py``).  PostgreSQL tests skip when
the server is unreachable, unless ``LIGHTNING_SQL_REQUIRE_POSTGRES=1`` (CI), where they fail.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_sql import SqlLightningStore
from tests.helpers import FakeClock, drop_pg_schema, pg_available

PG_URL = os.environ.get("LIGHTNING_SQL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REQUIRE_PG = os.environ.get("LIGHTNING_SQL_REQUIRE_POSTGRES") == "1"

ALL_BACKENDS = ["sqlite_file", "sqlite_memory", "postgres"]
# Backends whose data outlives one instance (reopen, pickling, several processes).
PERSISTENT_BACKENDS = ["sqlite_file", "postgres"]
MULTIPROCESS_BACKENDS = ["sqlite_file", "postgres"]


def require_postgres() -> None:
    """Skip (or, in CI, fail) a test that needs PostgreSQL when it is unreachable."""
    ok, reason = pg_available(PG_URL)
    if ok:
        return
    if REQUIRE_PG:
        pytest.fail(f"PostgreSQL is required (LIGHTNING_SQL_REQUIRE_POSTGRES=1) but unreachable: {reason}")
    pytest.skip(f"PostgreSQL unreachable: {reason}")


class BackendSpec:
    """Where one test's database lives, and how to open more stores on it."""

    def __init__(self, name: str, tmp_path: Path) -> None:
        self.name = name
        self.schema: str | None = None
        if name == "sqlite_file":
            self.url = f"sqlite:///{tmp_path / 'store.db'}"
        elif name == "sqlite_memory":
            self.url = "sqlite://"
        elif name == "postgres":
            self.url = PG_URL
            self.schema = f"t_{uuid.uuid4().hex[:12]}"
        else:  # pragma: no cover
            raise ValueError(name)

    @property
    def is_postgres(self) -> bool:
        return self.name == "postgres"

    @property
    def persistent(self) -> bool:
        return self.name != "sqlite_memory"

    def options(self, **kwargs: Any) -> dict[str, Any]:
        """Constructor options for a store on this backend (schema on PostgreSQL)."""
        opts = dict(kwargs)
        if self.schema is not None:
            opts.setdefault("schema", self.schema)
        return opts

    def open(self, **kwargs: Any) -> SqlLightningStore:
        return SqlLightningStore(self.url, **self.options(**kwargs))


@pytest.fixture(params=ALL_BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendSpec]:
    yield from _backend(request.param, tmp_path)


@pytest.fixture(params=PERSISTENT_BACKENDS)
def persistent_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendSpec]:
    yield from _backend(request.param, tmp_path)


@pytest.fixture(params=MULTIPROCESS_BACKENDS)
def mp_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendSpec]:
    yield from _backend(request.param, tmp_path)


@pytest.fixture
def pg_backend(tmp_path: Path) -> Iterator[BackendSpec]:
    yield from _backend("postgres", tmp_path)


def _backend(name: str, tmp_path: Path) -> Iterator[BackendSpec]:
    if name == "postgres":
        require_postgres()
    spec = BackendSpec(name, tmp_path)
    try:
        yield spec
    finally:
        if spec.schema is not None:
            drop_pg_schema(PG_URL, spec.schema)


@pytest.fixture
def clock() -> Iterator[FakeClock]:
    """A mutable fake local clock, injected as ``clock=`` (starts at a fixed epoch); its file is
    removed after the test."""
    fake = FakeClock(1_800_000_000.0)
    try:
        yield fake
    finally:
        fake.remove()


@pytest.fixture
async def store_factory(backend: BackendSpec, clock: FakeClock) -> AsyncIterator[Callable[..., SqlLightningStore]]:
    """``store_factory(**options)`` opens a store on the test's backend; all are closed afterwards.

    Defaults: run ``"test-run"``, the fake clock, ``clock_sync=False`` and
    ``scan_debounce_seconds=0`` (every [sweeps] call sweeps), unless overridden.
    """
    stores: list[SqlLightningStore] = []

    def make(**kwargs: Any) -> SqlLightningStore:
        kwargs.setdefault("run", "test-run")
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("clock_sync", False)
        kwargs.setdefault("scan_debounce_seconds", 0)
        store = backend.open(**kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
async def store(store_factory: Callable[..., SqlLightningStore]) -> SqlLightningStore:
    return store_factory()


def run_in_new_loop(coro_factory: Callable[[], Any]) -> Any:
    """Run a coroutine in a brand-new event loop (e.g. from another thread)."""
    return asyncio.run(coro_factory())
