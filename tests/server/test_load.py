"""Many Agent-Lightning clients at once against a spawned ``lightning-sql serve`` (SQLite and
PostgreSQL): every rollout finished, no error, no lease expired while its client was alive.

Sized by ``LIGHTNING_SQL_LOAD_CLIENTS`` (default 32, CI's size: it proves the mechanism in seconds);
``python -m benchmarks.server_load --clients 512`` is the full size, with its figures.
"""

from __future__ import annotations

import os

from benchmarks.server_load import run_load
from tests.conftest import BackendSpec
from tests.required import AGENTLIGHTNING, required_import

required_import("agentlightning.store.client_server", AGENTLIGHTNING)

CLIENTS = int(os.environ.get("LIGHTNING_SQL_LOAD_CLIENTS", "32"))


async def test_many_clients_finish_every_rollout_without_errors(mp_backend: BackendSpec) -> None:
    import asyncio

    rollouts = CLIENTS * 3
    result = await asyncio.to_thread(run_load, mp_backend.url, CLIENTS, rollouts, 120.0, mp_backend.schema)
    assert result.errors == {}, result.report()
    assert result.finished == rollouts and result.expired == 0, result.report()
    assert len(result.latencies["update_attempt"]) == rollouts
