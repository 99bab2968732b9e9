"""``Hook``: callbacks a runner fires around each rollout (docs/store-contract.md §3.7)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_sql.runtime.base import ParallelWorkerBase

if TYPE_CHECKING:
    from lightning_sql.runtime.agent import LitAgent
    from lightning_sql.runtime.runner import Runner
    from lightning_sql.runtime.tracer import Tracer
    from lightning_sql.types import Rollout, Span

__all__ = ["Hook"]


class Hook(ParallelWorkerBase):
    """Async no-op callbacks; subclass and override the ones you need.

    Order for one rollout: ``on_rollout_start`` (before the trace context), ``on_trace_start``
    (inside it, before the agent), ``on_trace_end`` (after the agent, still inside),
    ``on_rollout_end`` (in ``finally``, before the attempt's status is reported).  The runner logs
    and swallows exceptions raised by hooks.
    """

    async def on_rollout_start(self, *, agent: LitAgent[Any], runner: Runner[Any], rollout: Rollout) -> None:
        """Called before the trace context is entered."""

    async def on_trace_start(
        self, *, agent: LitAgent[Any], runner: Runner[Any], tracer: Tracer, rollout: Rollout
    ) -> None:
        """Called inside the trace context, before the agent runs."""

    async def on_trace_end(
        self, *, agent: LitAgent[Any], runner: Runner[Any], tracer: Tracer, rollout: Rollout
    ) -> None:
        """Called after the agent returned or raised, still inside the trace context."""

    async def on_rollout_end(
        self, *, agent: LitAgent[Any], runner: Runner[Any], rollout: Rollout, spans: Sequence[Span] | Sequence[Any]
    ) -> None:
        """Called in ``finally``, before the attempt's status is reported."""
