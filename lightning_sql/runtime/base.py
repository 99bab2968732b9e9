"""``ParallelWorkerBase``: the lifecycle shared by runners, tracers and hooks.

Its behaviour is specified in docs/store-contract.md §3.1.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ParallelWorkerBase"]


class ParallelWorkerBase:
    """A component that is set up once, then once per worker, and torn down in reverse order.

    ``init`` runs once in the process that owns the component; ``init_worker`` runs in every worker
    (an asyncio task or a child process) with that worker's id; ``teardown_worker`` and ``teardown``
    undo them.
    """

    worker_id: int | str | None = None

    def init(self, *args: Any, **kwargs: Any) -> None:
        """Set up the component once (no-op by default)."""

    def init_worker(self, worker_id: int | str, *args: Any, **kwargs: Any) -> None:
        """Set up the component for one worker and remember its id."""
        self.worker_id = worker_id

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Do the component's work (no-op by default)."""

    def teardown_worker(self, worker_id: int | str, *args: Any, **kwargs: Any) -> None:
        """Undo ``init_worker`` (no-op by default)."""

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """Undo ``init`` (no-op by default)."""
