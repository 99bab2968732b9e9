"""How the Trainer's side of a run lives through a database outage.

The decision is docs/adr/0013-the-trainer-waits-outages-out.md.

The algorithm's store calls run under ``outage_patience``: each waits an outage out for the Trainer's
``outage_timeout`` (default None: until the database answers, as runners and workers do).
``OutageLog`` says so while it lasts; ``stopped_message`` is what ``fit`` says when the bound is hit.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from lightning_sql.store.base import PersistentStore

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = ["OutageLog", "patience_seconds", "stopped_message"]

logger = logging.getLogger("lightning_sql.runtime.trainer")

DEFAULT_LOG_INTERVAL_S = 30.0  # for a store without connect_deadline_seconds
END_GRACE_S = 2.0  # the store reporting no outage for this long ends one (its longest back-off is 1.5 s)


def patience_seconds(outage_timeout: float | None) -> float:
    """The ``outage_patience`` of the algorithm's calls: ``outage_timeout``, or forever for None."""
    return math.inf if outage_timeout is None else float(outage_timeout)


def _bound(outage_timeout: float | None) -> str:
    return "outage_timeout=None" if outage_timeout is None else f"outage_timeout={outage_timeout:g} s"


def _patience(outage_timeout: float | None) -> str:
    return "as long as it takes (outage_timeout=None)" if outage_timeout is None else f"up to {_bound(outage_timeout)} a call"


def _clock(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class OutageLog:
    """Logs that the Trainer waits for its store: when an outage begins, again every
    ``connect_deadline_seconds`` of the store (default 30 s: where a call used to give up) while it
    lasts, and when the database answers again.  ``check()`` is called often (every 0.1 s).  The
    store's ``unavailable_since`` may start afresh after one back-off longer than its quiet window:
    a gap under ``END_GRACE_S`` is the same outage, reported with its first start."""

    def __init__(self, store: LightningStore, run: str | None, outage_timeout: float | None) -> None:
        self.store = store
        self.run = run
        self.outage_timeout = outage_timeout
        deadline = store.connect_deadline_seconds if isinstance(store, PersistentStore) else DEFAULT_LOG_INTERVAL_S
        self.interval = max(float(deadline), 1.0)
        self.since: float | None = None
        self.last_seen = 0.0
        self.next_line = 0.0

    def check(self, *, answered: bool = False) -> None:
        """Log what is due; ``answered``: the algorithm's calls returned (it finished)."""
        store = self.store
        since = store.unavailable_since if isinstance(store, PersistentStore) and not answered else None
        now = time.monotonic()
        if since is None:
            if self.since is not None and (answered or now - self.last_seen > END_GRACE_S):
                logger.warning(
                    "Run %r: the store answers again (unavailable since %s); the algorithm goes on", self.run,
                    _clock(self.since),
                )
                self.since = None
            return
        self.last_seen = now
        if self.since is None:
            self.since = since
        elif now < self.next_line:
            return
        where = self.store.url if isinstance(self.store, PersistentStore) else type(self.store).__name__
        logger.warning(
            "Run %r: the store %s is unavailable since %s (%.0f s); the algorithm waits for it %s",
            self.run, where, _clock(self.since), time.time() - self.since, _patience(self.outage_timeout),
        )
        self.next_line = now + self.interval


def stopped_message(store: LightningStore, run: str | None, outage_timeout: float | None, exc: BaseException) -> str:
    """What ``fit`` says when the store stayed unavailable past the bound: the run, that it is
    resumable, and how to resume it."""
    where = repr(store.url) if isinstance(store, PersistentStore) else "<the same store>"
    return (
        f"lightning_sql: run {run!r} stopped, the store is unavailable ({_bound(outage_timeout)}): {exc}. "
        f"The run is resumable: it stays active and keeps what it did, and external workers wait for the store. "
        f"Once the database answers, resume it by running the same fit again with the same run: "
        f"Trainer(store={where}, run={run!r}, ...).fit(agent, train_dataset, val_dataset)"
    )
