"""In-process wake-ups: callers waiting for a run's rollouts or queue, woken after commits,
PostgreSQL notifications and SQLite ``data_version`` polls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

WaitEntry = tuple[asyncio.AbstractEventLoop, asyncio.Event]


def call_soon_threadsafe(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """``loop.call_soon_threadsafe(callback)``; a closed loop has nobody left to wake."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass


class WaitHub:
    """The waiters of this process on one database, by run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[int, set[WaitEntry]] = {}
        # Called (outside the lock) when the first waiter arrives: the SQLite writer thread polls for
        # other processes' commits only while someone waits, and may be asleep on its queue.
        self.on_first_waiter: Callable[[], None] | None = None

    def register(self, run_id: int) -> WaitEntry:
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            first = not self._waiters
            self._waiters.setdefault(run_id, set()).add(entry)
        if first and self.on_first_waiter is not None:
            self.on_first_waiter()
        return entry

    def unregister(self, run_id: int, entry: WaitEntry) -> None:
        with self._lock:
            bucket = self._waiters.get(run_id)
            if bucket is not None:
                bucket.discard(entry)
                if not bucket:
                    del self._waiters[run_id]

    @property
    def has_waiters(self) -> bool:
        return bool(self._waiters)

    def wake(self, run_id: int | None = None) -> None:
        """Wake the waiters of one run (of every run when ``run_id`` is None)."""
        with self._lock:
            if run_id is None:
                entries = [e for bucket in self._waiters.values() for e in bucket]
            else:
                entries = list(self._waiters.get(run_id, ()))
        for loop, event in entries:
            call_soon_threadsafe(loop, event.set)
