"""``lightning-sql serve``: the store over HTTP (``pip install 'lightning_sql[server]'``).

``create_app(ServerConfig(url=...))`` builds the Starlette application; ``docs/server.md`` describes
its endpoints (Agent-Lightning's client API, OTLP/HTTP trace ingestion, Prometheus metrics, health)
and its safety defaults.  Nothing heavy is imported here: see ``app.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_sql.server.config import ServerConfig

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["ServerConfig", "create_app"]


def create_app(config: ServerConfig) -> Starlette:
    from lightning_sql.server.app import create_app as build

    return build(config)
