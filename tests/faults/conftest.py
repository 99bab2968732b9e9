"""Fixtures of the fault scenarios: stores on the multi-process backends (SQLite file, PostgreSQL)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from lightning_sql import SqlLightningStore
from tests.conftest import BackendSpec


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
