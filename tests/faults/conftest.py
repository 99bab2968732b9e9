"""Fixtures of the fault scenarios: stores on the multi-process backends (SQLite file, PostgreSQL), and
throwaway servers (a private PostgreSQL cluster, PgBouncer in front of it)."""

from __future__ import annotations

import gc
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NoReturn

import pytest

from lightning_sql import SqlLightningStore
from tests.conftest import REQUIRE_PG, BackendSpec
from tests.faults.servers import APT_PACKAGES, MissingServerBinary, PgBouncer, ThrowawayPostgres


@pytest.fixture(autouse=True)
def collect_garbage_after_each_test() -> Iterator[None]:
    """Finalizers of a test's leftover driver objects run here, not in whatever runs next.

    A finalizer that switches greenlets (SQLAlchemy's asyncio adaptor) inside pytest's ``ast.parse``
    of a later failure's source makes CPython 3.11.7 raise "AST constructor recursion depth mismatch",
    which ends the whole session with INTERNALERROR.
    """
    yield
    gc.collect()


@pytest.fixture
async def mp_store_factory(mp_backend: BackendSpec) -> AsyncIterator[Callable[..., SqlLightningStore]]:
    """``mp_store_factory(**options)``: stores on ``mp_backend`` (run "test-run", real clock, no clock
    sync, every [sweeps] call sweeps), closed afterwards."""
    stores: list[SqlLightningStore] = []

    def make(**kwargs: Any) -> SqlLightningStore:
        kwargs.setdefault("run", "test-run")
        kwargs.setdefault("clock_sync", False)
        kwargs.setdefault("scan_debounce_seconds", 0)
        store = mp_backend.open(**kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


# --- throwaway servers (tests/faults/servers.py) -----------------------------------------------------


def _unavailable(what: str, exc: BaseException) -> NoReturn:
    """A server binary is missing: skip, unless CI requires the PostgreSQL scenarios to run."""
    if REQUIRE_PG:
        pytest.fail(f"{what} is required in CI (apt-get install -y {APT_PACKAGES}): {exc}")
    pytest.skip(f"cannot start {what} (apt-get install -y {APT_PACKAGES}): {exc}")


@pytest.fixture(scope="module")
def throwaway_pg(request: pytest.FixtureRequest) -> Iterator[ThrowawayPostgres]:
    """A private PostgreSQL cluster for the test module, on a free port, deleted afterwards.

    Its postgresql.conf settings are the module's ``PG_SETTINGS`` (a dict, e.g.
    ``{"max_connections": 30}``) over ``servers.DEFAULT_PG_SETTINGS``.
    """
    settings = getattr(request.module, "PG_SETTINGS", None)
    try:
        pg = ThrowawayPostgres(settings)
    except (MissingServerBinary, OSError, subprocess.CalledProcessError) as exc:
        _unavailable("a private PostgreSQL cluster", exc)
    try:
        try:
            pg.start()
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"the private cluster did not start: {exc}\n{pg.log.read_text(errors='replace')[-2000:]}")
        yield pg
    finally:
        pg.destroy()


@pytest.fixture(scope="module")
def pgbouncer(request: pytest.FixtureRequest, throwaway_pg: ThrowawayPostgres) -> Iterator[PgBouncer]:
    """Debian's pgbouncer in transaction pooling mode in front of ``throwaway_pg``, on another free port.

    It admits the module's ``BOUNCER_USERS`` (default: postgres); ``BOUNCER_POOL_SIZE`` (default 2)
    server connections per user and database, so clients share them transaction by transaction.
    """
    users = getattr(request.module, "BOUNCER_USERS", ("postgres",))
    pool_size = getattr(request.module, "BOUNCER_POOL_SIZE", 2)
    try:
        bouncer = PgBouncer(throwaway_pg, users=users, default_pool_size=pool_size)
    except (MissingServerBinary, OSError) as exc:
        _unavailable("pgbouncer", exc)
    try:
        yield bouncer
    finally:
        bouncer.destroy()
