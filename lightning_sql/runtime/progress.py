"""A live bar of the run's finished rollouts, read from the store (so it counts every runner and host)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lightning_sql.types import FINISHED_STATUSES

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = ["RunProgress", "PROGRESS_INTERVAL_S"]

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5  # how often the bar re-reads the counts (three COUNT queries)


class RunProgress:
    """Shows ``finished / expected`` rollouts of a run until ``stop`` is set.

    ``expected`` is the algorithm's estimate; without one (or when the run holds more) the bar's
    total is the number of rollouts in the run.
    """

    def __init__(
        self,
        store: LightningStore,
        run: str | None,
        expected: int | None,
        console: Console,
        interval: float = PROGRESS_INTERVAL_S,
    ) -> None:
        self.store = store
        self.run = run
        self.expected = expected
        self.console = console
        self.interval = interval

    async def _counts(self) -> tuple[int, int, int]:
        finished = await self.store.query_rollouts(status_in=list(FINISHED_STATUSES), limit=0)
        failed = await self.store.query_rollouts(status_in=["failed"], limit=0)
        everything = await self.store.query_rollouts(limit=0)
        return finished.total, failed.total, everything.total

    async def show(self, stop: asyncio.Event) -> None:
        """Refresh the bar every ``interval`` seconds; one last refresh once ``stop`` is set."""
        label = f"run {escape(self.run)}" if self.run else "rollouts"
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]}", style="red"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        ) as progress:
            bar = progress.add_task(label, total=self.expected, failed="")
            while True:
                last = stop.is_set()
                try:
                    finished, failed, total = await self._counts()
                except Exception as exc:  # noqa: BLE001 - a missed refresh is not worth stopping the run
                    logger.debug("Progress refresh failed: %s", exc)
                else:
                    # The estimate guides the bar while the run goes; the end shows what the run holds.
                    goal = total if last else max(self.expected or 0, total)
                    progress.update(
                        bar, completed=finished, total=goal or None, failed=f"{failed} failed" if failed else ""
                    )
                if last:
                    return
                try:
                    await asyncio.wait_for(stop.wait(), self.interval)
                except TimeoutError:
                    pass
