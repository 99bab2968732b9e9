"""Agents for `lightning-sql worker` tests (imported by module:attr)."""

from __future__ import annotations

from typing import Any

from lightning_sql import LitAgent, Rollout


class EchoAgent(LitAgent[Any]):
    """Succeeds at once with reward 1.0."""

    def rollout(self, task: Any, resources: Any, rollout: Rollout) -> float:
        return 1.0


echo_agent = EchoAgent()


def _divide(task: Any) -> float:
    return 1 / task["divisor"]


class DividingAgent(LitAgent[Any]):
    """Raises ZeroDivisionError (from ``_divide``) for a task with ``divisor`` 0."""

    def rollout(self, task: Any, resources: Any, rollout: Rollout) -> float:
        return _divide(task)


dividing_agent = DividingAgent()
