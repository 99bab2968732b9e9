"""``create_app``: the ``lightning-sql serve`` application (Starlette), built from a ``ServerConfig``.

Routes: ``/healthz`` (200 when the database answers, 503 otherwise), ``/metrics`` (Prometheus),
``/login``/``/logout`` (the dashboard's token form), ``/v1/agl/...`` (Agent-Lightning's client API),
``POST /v1/traces`` (OTLP/HTTP ingestion), and the dashboard at ``/``.  Middleware, outermost first:
the Host, Origin and Content-Type rules (``guard.py``), CORS (only when origins are configured), the
body-size limit, token authentication, and the last resort that turns an unexpected exception into a
JSON 500 without a traceback.

Protobuf and the OTLP messages are imported by the first request that needs them, and the
dashboard is made once the database is up, so a supervisor restarting the server gets ``/healthz``
answered quickly (``benchmarks/server_startup.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lightning_sql.server.agl_api import api_routes
from lightning_sql.server.auth import TokenAuthMiddleware, login_routes
from lightning_sql.server.catalog import Catalog
from lightning_sql.server.config import RUN_HEADER, ServerConfig
from lightning_sql.server.errors import CatchAllMiddleware, ErrorHandlers, JsonResponse, error_response
from lightning_sql.server.guard import BrowserGuardMiddleware, HostPolicy, json_body_rule
from lightning_sql.server.ingest import traces_endpoint
from lightning_sql.server.limits import BodyLimitMiddleware
from lightning_sql.server.metrics import ServerMetrics
from lightning_sql.server.readonly import Database
from lightning_sql.server.stores import StorePool

logger = logging.getLogger(__name__)

READ_ONLY_MESSAGE = (
    "this server runs with --read-only: it serves the dashboard, /metrics and /healthz, "
    "not the API or trace ingestion"
)


def _dashboard_class() -> Any:
    """The dashboard's class, or None when this installation has no dashboard package."""
    try:
        from lightning_sql.server.dashboard import Dashboard
    except ModuleNotFoundError as exc:
        if exc.name != "lightning_sql.server.dashboard":
            raise
        return None
    return Dashboard


def create_app(config: ServerConfig) -> Starlette:
    """The application serving ``config``; the database is opened by the app's startup."""
    pool = StorePool(config)
    metrics = ServerMetrics()
    handlers = ErrorHandlers(on_database_error=metrics.database_error)
    dashboard_class = _dashboard_class()
    dashboard: Any = None
    catalog: Catalog | None = None

    def current_catalog() -> Catalog | None:
        return catalog

    async def healthz(request: Request) -> Response:
        ok, detail = await pool.healthy()
        if ok:
            return JsonResponse({"status": "ok"})
        return JsonResponse({"status": "unavailable", "detail": detail}, status_code=503)

    async def read_only(request: Request) -> Response:
        return error_response(403, READ_ONLY_MESSAGE)

    async def index(request: Request) -> Response:
        return JsonResponse(
            {
                "service": "lightning-sql serve",
                "endpoints": ["/healthz", "/metrics", "/v1/agl/...", "/v1/traces"],
                "dashboard": "not installed in this environment",
            }
        )

    routes: list[BaseRoute] = [
        Route("/healthz", healthz, methods=["GET", "HEAD"]),
        Route("/metrics", metrics.endpoint(current_catalog), methods=["GET"]),
        *login_routes(config.token),
    ]
    if config.read_only:
        methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
        routes.append(Route("/v1/{path:path}", read_only, methods=methods))
    else:
        routes.extend(api_routes(pool, metrics))
        routes.append(
            Route("/v1/traces", traces_endpoint(pool, metrics, current_catalog, config.max_body_bytes), methods=["POST"])
        )
    if dashboard_class is None:
        routes.append(Route("/", index, methods=["GET"]))

    middleware: list[Middleware] = [
        Middleware(
            BrowserGuardMiddleware,
            hosts=HostPolicy(config.host, config.allowed_hosts),
            body_types=json_body_rule,
            cors_origins=config.cors_origins,
        )
    ]
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", "Content-Encoding", RUN_HEADER],
            )
        )
    middleware += [
        Middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes),
        Middleware(TokenAuthMiddleware, token=config.token),
        Middleware(CatchAllMiddleware, handlers=handlers),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal dashboard, catalog
        ok, detail = await pool.healthy()
        if not ok:
            logger.warning("Serving, but %s: /healthz answers 503 until it does", detail)
        # Made once the database exists (a writable server has just created a new one).
        database = Database(config.url, config.schema)
        catalog = Catalog(database)
        if dashboard_class is not None:
            # Its pages go after the server's own routes, before the first request is served.
            dashboard = dashboard_class(config.url, schema=config.schema, db=database)
            app.router.routes.extend(dashboard.routes)
            await dashboard.startup()
        try:
            yield
        finally:
            if dashboard is not None:
                await dashboard.shutdown()
            await database.close()
            await pool.close()

    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=handlers.mapping(),
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.pool = pool
    app.state.metrics = metrics
    return app
