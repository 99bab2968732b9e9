"""Running the proxy's app with uvicorn: in a thread, as a task of the caller's loop, or in a process.

* ``thread`` (default): uvicorn's own event loop in a daemon thread of this process; the app shares the
  ``LLMProxy`` object (``update_model_list`` and ``set_store`` apply to the next call).
* ``asyncio``: a task of the event loop that called ``start()``; that loop must keep running while the
  proxy serves.  In the main thread uvicorn takes SIGINT/SIGTERM while it serves, as its ``serve()`` does.
* ``mp``: a spawned child process, which receives the pickled settings and store (the store must be
  ``zero_copy``); changes to the model list apply at the next start.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from typing import TYPE_CHECKING, Any, Literal

import httpx
import uvicorn

from lightning_sql.llm_proxy.app import ProxyApp
from lightning_sql.llm_proxy.config import ProxySettings

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = ["LaunchMode", "ProxyServer", "ThreadServer", "TaskServer", "ProcessServer", "LAUNCH_MODES"]

logger = logging.getLogger(__name__)

LaunchMode = Literal["thread", "mp", "asyncio"]
LAUNCH_MODES: tuple[LaunchMode, ...] = ("thread", "mp", "asyncio")
_POLL_S = 0.01


def _uvicorn_server(app: ProxyApp, host: str, port: int, shutdown_timeout: float) -> uvicorn.Server:
    config = uvicorn.Config(
        app.app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=max(int(shutdown_timeout), 1),
        timeout_keep_alive=30,
    )
    return uvicorn.Server(config)


class ProxyServer:
    """A started proxy server; ``stop()`` shuts it down gracefully."""

    @property
    def pid(self) -> int:
        """The process that serves."""
        return os.getpid()

    def is_running(self) -> bool:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError


class ThreadServer(ProxyServer):
    def __init__(self, app: ProxyApp, host: str, port: int, shutdown_timeout: float) -> None:
        self.app = app
        self.server = _uvicorn_server(app, host, port, shutdown_timeout)
        self.shutdown_timeout = shutdown_timeout
        self.thread = threading.Thread(target=self.server.run, name=f"lightning-sql-llm-proxy-{port}", daemon=True)

    async def start(self, timeout: float) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("The LLM proxy could not start (is the port already in use?)")
            if time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError(f"The LLM proxy did not start within {timeout} s")
            await asyncio.sleep(_POLL_S)

    def is_running(self) -> bool:
        return self.thread.is_alive() and self.server.started and not self.server.should_exit

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.to_thread(self.thread.join, self.shutdown_timeout + 5.0)
        if self.thread.is_alive():
            logger.warning("The LLM proxy thread did not stop within %.0f s", self.shutdown_timeout + 5.0)


class TaskServer(ProxyServer):
    def __init__(self, app: ProxyApp, host: str, port: int, shutdown_timeout: float) -> None:
        self.app = app
        self.server = _uvicorn_server(app, host, port, shutdown_timeout)
        self.task: asyncio.Task[None] | None = None

    async def start(self, timeout: float) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve())
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self.task.done():
                exc = self.task.exception() if not self.task.cancelled() else None
                raise RuntimeError(f"The LLM proxy could not start (is the port already in use?): {exc!r}")
            if time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError(f"The LLM proxy did not start within {timeout} s")
            await asyncio.sleep(_POLL_S)

    def is_running(self) -> bool:
        return self.task is not None and not self.task.done() and self.server.started and not self.server.should_exit

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)


def _serve_in_child(
    settings: ProxySettings, store: LightningStore, host: str, port: int, shutdown_timeout: float
) -> None:
    """Entry point of the ``mp`` child: serve until SIGTERM."""
    logging.basicConfig(level=logging.WARNING)
    app = ProxyApp(settings, lambda: store)
    _uvicorn_server(app, host, port, shutdown_timeout).run()


class ProcessServer(ProxyServer):
    def __init__(
        self,
        settings: ProxySettings,
        store: LightningStore,
        host: str,
        port: int,
        access_host: str,
        shutdown_timeout: float,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.shutdown_timeout = shutdown_timeout
        self.health_url = f"http://{access_host}:{port}/health"
        self.process: SpawnProcess = context.Process(
            target=_serve_in_child,
            args=(settings, store, host, port, shutdown_timeout),
            name=f"lightning-sql-llm-proxy-{port}",
            daemon=True,
        )

    async def start(self, timeout: float) -> None:
        self.process.start()
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
            while True:
                if not self.process.is_alive():
                    raise RuntimeError(f"The LLM proxy process exited with code {self.process.exitcode}")
                try:
                    if (await client.get(self.health_url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    await self.stop()
                    raise RuntimeError(f"The LLM proxy process did not start within {timeout} s")
                await asyncio.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    def is_running(self) -> bool:
        return self.process.is_alive()

    async def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()  # SIGTERM: uvicorn shuts down gracefully
            await asyncio.to_thread(self.process.join, self.shutdown_timeout + 5.0)
        if self.process.is_alive():
            logger.warning("The LLM proxy process did not stop: killing it")
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5.0)


async def start_server(
    mode: LaunchMode,
    make_app: Callable[[], ProxyApp],
    settings: ProxySettings,
    store: LightningStore,
    host: str,
    port: int,
    access_host: str,
    startup_timeout: float,
    shutdown_timeout: float,
) -> ProxyServer:
    """Start the proxy in ``mode`` and return once it accepts connections."""
    server: Any
    if mode == "thread":
        server = ThreadServer(make_app(), host, port, shutdown_timeout)
    elif mode == "asyncio":
        server = TaskServer(make_app(), host, port, shutdown_timeout)
    else:
        server = ProcessServer(settings, store, host, port, access_host, shutdown_timeout)
    await server.start(startup_timeout)
    return server  # type: ignore[no-any-return]
