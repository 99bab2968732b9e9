"""A real ``lightning-sql serve`` app on a loopback port, over SQLite files and PostgreSQL.

``serve(config)`` runs the app under uvicorn in a thread of the test process (port 0: the OS picks
a free one) and stops it afterwards; ``server_factory(**options)`` does it on the test's backend.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.required import SERVER, required_import

for _module in ("starlette", "uvicorn", "prometheus_client", "jinja2", "opentelemetry.proto", "google.rpc.status_pb2"):
    required_import(_module, SERVER)

import uvicorn  # noqa: E402

from lightning_sql import SqlLightningStore  # noqa: E402
from lightning_sql.server import ServerConfig, create_app  # noqa: E402
from tests.conftest import BackendSpec  # noqa: E402

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # agentlightning imports offline

RUN = "test-run"
START_TIMEOUT_S = 60.0


@dataclass
class RunningServer:
    url: str
    config: ServerConfig
    app: Any

    def metric(self, text: str, name: str, **labels: str) -> float | None:
        """The value of one sample in a Prometheus text page (None when absent)."""
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            key, value = line.rsplit(" ", 1)
            sample, _, label_text = key.partition("{")
            if sample != name:
                continue
            got = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
            if got == wanted:
                return float(value)
        return None


@contextlib.contextmanager
def serve(config: ServerConfig) -> Iterator[RunningServer]:
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="lsql-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", config, app)
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)


@pytest.fixture
def server_factory(mp_backend: BackendSpec) -> Iterator[Callable[..., RunningServer]]:
    """``server_factory(**config)`` serves the test's database (SQLite file or PostgreSQL schema)."""
    with contextlib.ExitStack() as stack:

        def make(**options: Any) -> RunningServer:
            options.setdefault("run", RUN)
            if mp_backend.schema is not None:
                options.setdefault("schema", mp_backend.schema)
            return stack.enter_context(serve(ServerConfig(url=mp_backend.url, **options)))

        yield make


@pytest.fixture
async def reader(mp_backend: BackendSpec) -> AsyncIterator[Callable[..., SqlLightningStore]]:
    """``reader(run=RUN)``: a read-only store on the served database, to check what was stored."""
    stores: list[SqlLightningStore] = []

    def make(run: str = RUN) -> SqlLightningStore:
        store = SqlLightningStore(mp_backend.url, **mp_backend.options(run=run, read_only=True, create_run=False))
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()
