"""External workers: runners on any host, joining an existing run (docs/store-contract.md §3.6).

``run_worker(url, run, "module:attr", n=4)`` opens the store with ``create_run=False`` (a mistyped
run name fails with the list of existing runs) and runs ``n`` runners until the run is marked
finished with nothing left queued or running (``forever=True``: until interrupted).  Worker ids
embed the host name and pid, so workers on many hosts never share a worker row.
``lightning-sql worker --url URL --run NAME --agent module:attr [-n N] [--forever]`` calls it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from lightning_sql.runtime.agent import LitAgent
from lightning_sql.runtime.hooks import Hook
from lightning_sql.runtime.runner import OUTAGE_RETRY_MAX_S, LitAgentRunner
from lightning_sql.runtime.tracer import OtelTracer, Tracer
from lightning_sql.runtime.trainer import _import_path
from lightning_sql.store.sql.urls import mask_url

__all__ = ["run_worker", "run_worker_async", "load_agent", "default_worker_prefix", "UNFINISHED_STATUSES"]

logger = logging.getLogger(__name__)

# Rollouts in these states still need a runner: a finished run with none of them left is done.
UNFINISHED_STATUSES = ("queuing", "requeuing", "preparing", "running")


def default_worker_prefix() -> str:
    """``<hostname>-<pid>``: unique among the workers of a run."""
    return f"{socket.gethostname()}-{os.getpid()}"


def load_agent(spec: str | LitAgent[Any]) -> LitAgent[Any]:
    """The agent named by ``module:attr`` (a ``LitAgent`` instance, a ``LitAgent`` class, or a factory)."""
    if isinstance(spec, LitAgent):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"agent must be given as module:attr, got {spec!r}")
    try:
        obj = _import_path(spec)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"Cannot import agent {spec!r}: {exc}") from exc
    if isinstance(obj, type) and issubclass(obj, LitAgent):
        obj = obj()
    elif not isinstance(obj, LitAgent) and callable(obj):
        obj = obj()
    if not isinstance(obj, LitAgent):
        raise TypeError(f"{spec} is a {type(obj).__qualname__}, not a LitAgent (or @rollout function)")
    return obj


async def run_worker_async(
    url: str,
    run: str | None,
    agent_spec: str | LitAgent[Any],
    n: int = 1,
    worker_prefix: str | None = None,
    *,
    stop_event: threading.Event | None = None,
    tracer: Tracer | None = None,
    hooks: Sequence[Hook] | None = None,
    max_rollouts: int | None = None,
    poll_interval: float = 5.0,
    heartbeat_interval: float = 10.0,
    forever: bool = False,
    on_start: Callable[[str], None] | None = None,
    **store_options: Any,
) -> int:
    """Run ``n`` runners against an existing run; returns the rollouts reported.

    The runners stop when ``stop_event`` is set, and, unless ``forever``, once the run is marked
    finished and none of its rollouts is queued or running (checked every ``poll_interval``).
    ``on_start`` receives one line (masked URL, run, n, agent) once the run is known to exist.
    """
    from lightning_sql.store import SqlLightningStore, StoreUnavailableError

    run = run or os.environ.get("LIGHTNING_SQL_RUN")
    if not run:
        raise ValueError("run is required for an external worker (--run NAME or LIGHTNING_SQL_RUN)")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    agent = load_agent(agent_spec)
    prefix = worker_prefix or default_worker_prefix()
    stop = stop_event or threading.Event()
    store = SqlLightningStore(url, run=run, create_run=False, **store_options)
    try:
        # Fails now, naming the existing runs, if the run does not exist; waits out an outage.
        await _through_outages(store.statistics, stop, "starting")
        agent_name = agent_spec if isinstance(agent_spec, str) else type(agent_spec).__qualname__
        line = (
            f"Worker {prefix}: {n} runner(s) on run {run!r} at {mask_url(url)}, agent {agent_name}"
            + ("" if forever else "; exits when the run is finished")
        )
        logger.info("%s", line)
        if on_start is not None:
            on_start(line)
        runners = []
        for i in range(n):
            runner: LitAgentRunner[Any] = LitAgentRunner(
                tracer=copy.copy(tracer) if tracer is not None else OtelTracer(),
                max_rollouts=max_rollouts,
                poll_interval=poll_interval,
                heartbeat_interval=heartbeat_interval,
            )
            runner.init(agent, hooks=hooks)
            runner.init_worker(f"{prefix}-{i}", store)
            runners.append(runner)
        watcher = None if forever else asyncio.ensure_future(_stop_when_run_is_done(store, run, stop, poll_interval))
        try:
            outcomes = await asyncio.gather(*(r.iter(event=stop) for r in runners), return_exceptions=True)
            for outcome in outcomes:
                # Told to stop while the database was unavailable: the leases recover the rest.
                if isinstance(outcome, BaseException) and not (stop.is_set() and isinstance(outcome, StoreUnavailableError)):
                    raise outcome
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            for runner in runners:
                runner.teardown_worker(runner.worker_id or "")
                runner.teardown()
        return sum(r.completed_rollouts for r in runners)
    finally:
        await store.close()


async def run_is_done(store: Any, run: str) -> bool:
    """True once ``run`` is marked finished and none of its rollouts is queued or running."""
    found = await store.get_run(run)
    if found is None or found.status != "finished":
        return False
    unfinished = await store.query_rollouts(status_in=list(UNFINISHED_STATUSES), limit=1)
    return len(unfinished) == 0


async def _stop_when_run_is_done(store: Any, run: str, stop: threading.Event, interval: float) -> None:
    failing = False
    while not stop.is_set():
        try:
            done = await run_is_done(store, run)
        except Exception as exc:  # noqa: BLE001 - a failed check is retried; the runners go on meanwhile
            if not failing:  # one line per outage, not one per check
                logger.warning("Could not check whether run %r is finished: %s", run, exc)
            failing, done = True, False
        else:
            failing = False
        if done:
            logger.info("Run %r is finished and nothing is queued or running: stopping", run)
            stop.set()
            return
        await asyncio.sleep(interval)


async def _through_outages(call: Callable[[], Awaitable[Any]], stop: threading.Event, what: str) -> Any:
    """``call()``, tried again while the database is unavailable, with one warning per outage; a
    worker waits for its database rather than exiting (until ``stop``)."""
    from lightning_sql.store import StoreUnavailableError

    delay, logged = 0.1, False
    while True:
        try:
            return await call()
        except StoreUnavailableError as exc:
            if stop.is_set():
                raise
            if not logged:  # the store logged the outage once for the whole process
                logger.debug("Worker %s: the database is unavailable: %s; retrying", what, exc)
                logged = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, OUTAGE_RETRY_MAX_S)


def run_worker(
    url: str,
    run: str | None,
    agent_spec: str | LitAgent[Any],
    n: int = 1,
    worker_prefix: str | None = None,
    **options: Any,
) -> int:
    """Blocking ``run_worker_async``: SIGTERM / the first Ctrl-C stop gracefully (current rollouts finish)."""
    stop: threading.Event = options.pop("stop_event", None) or threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def graceful(signum: int, frame: Any) -> None:
            if stop.is_set():
                raise KeyboardInterrupt
            logger.warning("Stopping after the current rollouts (signal %d again to abort)", signum)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, graceful)
    try:
        return asyncio.run(run_worker_async(url, run, agent_spec, n, worker_prefix, stop_event=stop, **options))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
