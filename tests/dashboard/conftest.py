"""Dashboard fixtures: a seeded store on SQLite and PostgreSQL, served by uvicorn on a loopback port."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from starlette.applications import Starlette

from lightning_sql.server.dashboard import Dashboard
from tests.conftest import BackendSpec
from tests.dashboard.seed import Seeded, seed
from tests.helpers import FakeClock


@dataclass
class Served:
    base: str
    seeded: Seeded
    backend: BackendSpec
    clock: FakeClock
    dashboard: Dashboard

    def url(self, path: str) -> str:
        return self.base + path


@contextlib.contextmanager
def serve(dashboard: Dashboard) -> Iterator[str]:
    """Run a Starlette app holding only the dashboard's routes under uvicorn; yields its base URL."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await dashboard.startup()
        yield
        await dashboard.shutdown()

    app = Starlette(routes=dashboard.routes, lifespan=lifespan)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
async def seeded(mp_backend: BackendSpec, clock: FakeClock) -> Seeded:
    return await seed(mp_backend.url, mp_backend.schema, clock)


@pytest.fixture
def served(seeded: Seeded, mp_backend: BackendSpec, clock: FakeClock) -> Iterator[Served]:
    dashboard = Dashboard(mp_backend.url, schema=mp_backend.schema, clock=clock)
    with serve(dashboard) as base:
        yield Served(base, seeded, mp_backend, clock, dashboard)
