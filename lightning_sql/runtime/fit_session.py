"""What ``Trainer.fit`` does around the execution: checks and announcements before, the summary after.

Before: the run's fingerprint is checked (``fingerprint.py``), the rollouts of gone local runner
processes are handed back (``recovery.py``), and the user is told whether the run is new, resumed or
already complete.  After: the run's summary is read from the store (``summary.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from lightning_sql.runtime.fingerprint import check_fingerprint, fit_fingerprint
from lightning_sql.runtime.recovery import LeaseRecovery, release_stopped_local_workers
from lightning_sql.runtime.summary import FitSummary, collect_summary
from lightning_sql.store.base import PersistentStore
from lightning_sql.types import FINISHED_STATUSES

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = ["FitStart", "prepare_fit", "announce_fit", "summarise_fit"]

logger = logging.getLogger(__name__)


@dataclass
class FitStart:
    """The run as ``fit`` found it."""

    run: str | None
    finished_before: int = 0
    total_before: int = 0
    run_was_finished: bool = False
    finished_at: float | None = None
    accepted_changes: list[str] = field(default_factory=list)
    recovery: LeaseRecovery = field(default_factory=LeaseRecovery)
    started: float = field(default_factory=time.monotonic)


async def prepare_fit(
    store: LightningStore,
    run: str | None,
    algorithm: Any,
    train_dataset: Any,
    val_dataset: Any,
    initial_resources: Any,
    *,
    accept_changes: bool,
) -> FitStart:
    """Check the run's fingerprint, hand back dead local runners' rollouts, count what is finished.

    Raises:
        RunChangedError: the run was started with other data (nothing has been written).
    """
    start = FitStart(run=run)
    row = await store.get_run(run) if isinstance(store, PersistentStore) and run is not None else None
    if row is not None and row.status == "finished":
        start.run_was_finished = True
        start.finished_at = row.finished_at
    if row is not None:
        start.finished_before = (await store.query_rollouts(status_in=list(FINISHED_STATUSES), limit=0)).total
        start.total_before = (await store.query_rollouts(limit=0)).total
    if algorithm is not None:
        fingerprint = fit_fingerprint(algorithm, train_dataset, val_dataset, initial_resources)
        start.accepted_changes = await check_fingerprint(
            store, run, fingerprint, accept_changes=accept_changes, rollouts=start.total_before
        )
    if row is not None:
        start.recovery = await release_stopped_local_workers(store)
    return start


def announce_fit(start: FitStart, console: Console | None) -> None:
    """Tell the user (console, else the log) whether the run is new, resumed or complete, and about leases."""
    name = escape(start.run or "")
    lines: list[str] = []
    if start.run_was_finished:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start.finished_at or 0))
        lines.append(
            f"Run [bold]{name}[/] is complete (finished {when}, {start.finished_before} rollouts): finished work is "
            "not redone; use a new run name to start over."
        )
    elif start.total_before:
        lines.append(
            f"Resuming run [bold]{name}[/]: {start.finished_before} of {start.total_before} rollouts are finished "
            "and are not redone."
        )
    if start.accepted_changes:
        lines.append("Accepted changes to the run's data: " + escape("; ".join(start.accepted_changes)) + ".")
    lines += [escape(line) + "." for line in start.recovery.describe()]
    for line in lines:
        if console is not None:
            console.print(line)
        else:
            logger.info(line)


async def summarise_fit(store: LightningStore, start: FitStart) -> FitSummary:
    """The run's summary when ``fit`` returns."""
    summary = await collect_summary(store, start.run)
    summary.finished_before = start.finished_before
    summary.run_was_finished = start.run_was_finished
    summary.wall_time_s = time.monotonic() - start.started
    return summary
