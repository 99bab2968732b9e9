"""Execution strategies: where the algorithm and the runners run (docs/store-contract.md §3.6).

* ``inprocess`` (alias ``shm``): the algorithm and ``n_runners`` runners are tasks on one event
  loop; sync agents run in worker threads.
* ``processes`` (alias ``cs``): the algorithm in this process, each runner in a child process
  started with the spawn method, which receives the pickled store and reconnects from its URL.

Stopping is cooperative: an ``ExecutionEvent`` is set, runners finish their current rollout, then
after a grace period they are cancelled (``processes``: SIGINT, terminate, kill).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Awaitable, Callable
from multiprocessing.context import SpawnProcess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = [
    "ExecutionEvent",
    "ExecutionStrategy",
    "InProcessExecutionStrategy",
    "ProcessExecutionStrategy",
    "AlgorithmBundle",
    "RunnerBundle",
    "STRATEGY_REGISTRY",
]

logger = logging.getLogger(__name__)

AlgorithmBundle = Callable[["LightningStore", "ExecutionEvent"], Awaitable[None]]
"""``algorithm(store, event)``: runs the algorithm; returns when it is done."""
RunnerBundle = Callable[["LightningStore", int, "ExecutionEvent"], Awaitable[None]]
"""``runner(store, worker_id, event)``: runs one runner until the event is set (or it is done)."""

WATCH_INTERVAL_S = 0.1  # how often the strategy looks at its tasks / child processes


class ExecutionEvent:
    """A stop flag shared by the algorithm and the runners (threading- or multiprocessing-backed)."""

    def __init__(self, context: Any = None) -> None:
        import threading

        self._event: Any = context.Event() if context is not None else threading.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return bool(self._event.is_set())

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self._event.wait(timeout))


class ExecutionStrategy:
    """Runs an algorithm bundle and runner bundles against one store."""

    n_runners: int = 1

    def execute(self, algorithm: AlgorithmBundle, runner: RunnerBundle, store: LightningStore) -> None:
        raise NotImplementedError


async def _stop_tasks(tasks: list[asyncio.Task[Any]], graceful_timeout: float) -> None:
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, still = await asyncio.wait(pending, timeout=graceful_timeout)
        for task in still:
            task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            logger.error("A runner failed: %r", result, exc_info=result)


class InProcessExecutionStrategy(ExecutionStrategy):
    """The algorithm and ``n_runners`` runners as asyncio tasks of one event loop."""

    alias = "inprocess"

    def __init__(self, n_runners: int = 1, graceful_timeout: float = 10.0) -> None:
        if n_runners < 0:
            raise ValueError(f"n_runners must be >= 0, got {n_runners!r}")
        self.n_runners = n_runners
        self.graceful_timeout = graceful_timeout

    def execute(self, algorithm: AlgorithmBundle, runner: RunnerBundle, store: LightningStore) -> None:
        asyncio.run(self.execute_async(algorithm, runner, store))

    async def execute_async(self, algorithm: AlgorithmBundle, runner: RunnerBundle, store: LightningStore) -> None:
        event = ExecutionEvent()
        runners = [asyncio.ensure_future(runner(store, i, event)) for i in range(self.n_runners)]
        algo = asyncio.ensure_future(algorithm(store, event))
        try:
            while not algo.done():
                await asyncio.wait({algo}, timeout=WATCH_INTERVAL_S)
                if runners and all(t.done() for t in runners) and not event.is_set():
                    logger.info("All runners finished; stopping the algorithm")
                    event.set()
            algo.result()
        finally:
            event.set()
            if not algo.done():
                algo.cancel()
                await asyncio.gather(algo, return_exceptions=True)
            await _stop_tasks(runners, self.graceful_timeout)


async def _as_coroutine(awaitable: Awaitable[None]) -> None:
    await awaitable


def _runner_process_main(runner: RunnerBundle, store: LightningStore, worker_id: int, event: ExecutionEvent) -> None:
    """Entry point of a runner child process (spawned: imports everything afresh)."""
    logging.basicConfig(level=os.environ.get("LIGHTNING_SQL_LOG_LEVEL", "WARNING"))
    try:
        asyncio.run(_as_coroutine(runner(store, worker_id, event)))
    except KeyboardInterrupt:
        logger.info("Runner %s interrupted", worker_id)


class ProcessExecutionStrategy(ExecutionStrategy):
    """The algorithm here, each runner in its own spawned child process."""

    alias = "processes"

    def __init__(
        self,
        n_runners: int = 1,
        graceful_timeout: float = 10.0,
        interrupt_timeout: float = 5.0,
        terminate_timeout: float = 5.0,
    ) -> None:
        if n_runners < 0:
            raise ValueError(f"n_runners must be >= 0, got {n_runners!r}")
        self.n_runners = n_runners
        self.graceful_timeout = graceful_timeout
        self.interrupt_timeout = interrupt_timeout
        self.terminate_timeout = terminate_timeout
        self.processes: list[SpawnProcess] = []

    def execute(self, algorithm: AlgorithmBundle, runner: RunnerBundle, store: LightningStore) -> None:
        context = multiprocessing.get_context("spawn")
        event = ExecutionEvent(context)
        self.processes = [
            context.Process(
                target=_runner_process_main, args=(runner, store, i, event), name=f"lightning-sql-runner-{i}", daemon=False
            )
            for i in range(self.n_runners)
        ]
        for process in self.processes:
            process.start()
        try:
            asyncio.run(self._run_algorithm(algorithm, store, event))
        finally:
            event.set()
            self._shutdown()

    async def _run_algorithm(self, algorithm: AlgorithmBundle, store: LightningStore, event: ExecutionEvent) -> None:
        algo = asyncio.ensure_future(algorithm(store, event))
        try:
            while not algo.done():
                await asyncio.wait({algo}, timeout=WATCH_INTERVAL_S)
                if self.processes and not any(p.is_alive() for p in self.processes) and not event.is_set():
                    logger.info("All runner processes exited; stopping the algorithm")
                    event.set()
            algo.result()
        finally:
            if not algo.done():
                algo.cancel()
                await asyncio.gather(algo, return_exceptions=True)

    def _shutdown(self) -> None:
        """Stop event → SIGINT → terminate → kill, each after its timeout."""
        steps: list[tuple[str, float, Callable[[SpawnProcess], None]]] = [
            ("stop event", self.graceful_timeout, lambda p: None),
            ("SIGINT", self.interrupt_timeout, lambda p: os.kill(p.pid, signal.SIGINT) if p.pid else None),
            ("terminate", self.terminate_timeout, lambda p: p.terminate()),
            ("kill", self.terminate_timeout, lambda p: p.kill()),
        ]
        for name, timeout, action in steps:
            alive = [p for p in self.processes if p.is_alive()]
            if not alive:
                break
            if name != "stop event":
                logger.warning("Runner processes %s still alive: %s", [p.name for p in alive], name)
            for process in alive:
                try:
                    action(process)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout
            for process in alive:
                process.join(max(deadline - time.monotonic(), 0.0))
        for process in self.processes:
            if process.exitcode not in (0, None):
                logger.warning("Runner process %s exited with code %s", process.name, process.exitcode)


STRATEGY_REGISTRY: dict[str, type[ExecutionStrategy]] = {
    "inprocess": InProcessExecutionStrategy,
    "processes": ProcessExecutionStrategy,
    "shm": InProcessExecutionStrategy,  # Agent-Lightning's shared-memory strategy
    "cs": ProcessExecutionStrategy,  # Agent-Lightning's client-server strategy: runners in other processes
}
