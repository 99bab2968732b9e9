"""The web dashboard of ``lightning-sql serve``: read-only pages over a store's database.

``Dashboard(url, schema=...)`` reads through a read-only engine (``lightning_sql.server.readonly``,
its own unless given one) and exposes Starlette
``routes`` for the server to mount at ``/``; authentication is the server's, in front of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from lightning_sql.server.dashboard.pages import Pages
from lightning_sql.server.dashboard.rendering import make_environment
from lightning_sql.server.readonly import Database

__all__ = ["Dashboard"]


class Dashboard:
    """Pages: ``/`` (runs), ``/runs/{id}``, ``/runs/{id}/rollouts``, ``/runs/{id}/rollouts/{rollout_id}``,
    ``/runs/{id}/spans/{span}``, ``/runs/{id}/resources``; assets under ``/static/dashboard``."""

    def __init__(
        self,
        url: str,
        *,
        schema: str | None = None,
        clock: Callable[[], float] = time.time,
        db: Database | None = None,
    ) -> None:
        self._owns_db = db is None
        self.db = Database(url, schema) if db is None else db
        self.pages = Pages(self.db, make_environment(), clock)
        p = self.pages
        self.routes: list[BaseRoute] = [
            Route("/", p.guarded(p.runs), name="dashboard_runs"),
            Route("/runs/{run_id:int}", p.guarded(p.run), name="dashboard_run"),
            Route("/runs/{run_id:int}/rollouts", p.guarded(p.rollouts), name="dashboard_rollouts"),
            Route("/runs/{run_id:int}/rollouts/{rollout_id}", p.guarded(p.rollout), name="dashboard_rollout"),
            Route("/runs/{run_id:int}/spans/{span_pk:int}", p.guarded(p.span), name="dashboard_span"),
            Route("/runs/{run_id:int}/resources", p.guarded(p.resources), name="dashboard_resources"),
            Mount(
                "/static/dashboard",
                app=StaticFiles(packages=[("lightning_sql.server.dashboard", "static")]),
                name="dashboard_static",
            ),
        ]

    async def startup(self) -> None:
        """Nothing to open eagerly: the pool connects on the first page (the server must answer
        ``/healthz`` fast, and a dashboard page is not needed for that)."""

    async def shutdown(self) -> None:
        if self._owns_db:
            await self.db.close()
