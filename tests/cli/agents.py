"""Agents for `lightning-sql worker` tests (imported by module:attr)."""

from __future__ import annotations

from typing import Any

from lightning_sql import LitAgent, Rollout


class EchoAgent(LitAgent[Any]):
    """Succeeds at once with reward 1.0."""

    def rollout(self, task: Any, resources: Any, rollout: Rollout) -> float:
        return 1.0


echo_agent = EchoAgent()
