"""``lightning-sql serve``: run the server (dashboard, Agent-Lightning API, OTLP ingestion, metrics)."""

from __future__ import annotations

import ipaddress
import logging
import sys
from typing import Any

import click

from lightning_sql.server.config import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    DEFAULT_RUN,
    ServerConfig,
)

EXIT_USAGE = 2
# Seconds an idle connection stays open.  Longer than the clients' own idle limits (httpx 5 s, aiohttp
# 15 s): a server that closes first races a client reusing the connection, which then fails with a
# read error the server never sees (uvicorn's default is 5 s, httpx's too).
KEEP_ALIVE_S = 75
logger = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--url", envvar="LIGHTNING_SQL_URL", required=True, help="Database URL (or LIGHTNING_SQL_URL).")
@click.option(
    "--run",
    envvar="LIGHTNING_SQL_RUN",
    default=DEFAULT_RUN,
    show_default=True,
    help="Run that API calls and ingested spans go to, unless a request names another "
    "(X-Lightning-SQL-Run header, lightning_sql.run OTLP attribute).",
)
@click.option("--schema", envvar="LIGHTNING_SQL_SCHEMA", help="PostgreSQL schema (default lightning_sql).")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True, help="Port to bind.")
@click.option(
    "--token",
    envvar="LIGHTNING_SQL_TOKEN",
    help="Access token every call needs (or LIGHTNING_SQL_TOKEN); prefer the variable: "
    "command lines are visible to other users.",
)
@click.option("--read-only", is_flag=True, help="Serve the dashboard, /metrics and /healthz only; never write.")
@click.option(
    "--max-body-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_MAX_BODY_BYTES / 2**20,
    show_default=True,
    help="Largest request body accepted, in MiB (also after gzip decompression).",
)
@click.option("--cors-origin", "cors_origins", multiple=True, help="Allow this browser origin (repeatable); none by default.")
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="Also answer requests whose Host header names this (repeatable; '*' for any); loopback and "
    "the bound address always.",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_CONNECT_TIMEOUT_S,
    show_default=True,
    help="Seconds a call waits for an unreachable database before answering 503.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
def serve(
    url: str,
    run: str,
    schema: str | None,
    host: str,
    port: int,
    token: str | None,
    read_only: bool,
    max_body_mb: float,
    cors_origins: tuple[str, ...],
    allowed_hosts: tuple[str, ...],
    connect_timeout: float,
    log_level: str,
) -> None:
    """Serve the store over HTTP: dashboard at /, Agent-Lightning's client API at /v1/agl,
    OTLP/HTTP traces at /v1/traces, Prometheus metrics at /metrics, readiness at /healthz."""
    import uvicorn

    from lightning_sql.server.app import create_app

    try:
        config = ServerConfig(
            url=url,
            run=run,
            schema=schema,
            host=host,
            port=port,
            token=token or None,
            read_only=read_only,
            max_body_bytes=int(max_body_mb * 2**20),
            cors_origins=tuple(o.strip() for o in cors_origins),
            allowed_hosts=tuple(h.strip() for h in allowed_hosts),
            connect_timeout=connect_timeout,
        )
        app = create_app(config)
    except (ValueError, TypeError) as exc:
        _console().print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(EXIT_USAGE)
    if not _is_loopback(host) and config.token is None:
        _console().print(
            f"[yellow]warning:[/yellow] serving on {host} without a token: anyone who can reach this "
            "address can read and write the store (set LIGHTNING_SQL_TOKEN)",
            highlight=False,
        )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mode = "read-only" if read_only else f"run {run!r}"
    logger.info("lightning-sql serve on http://%s:%d (%s)", host, port, mode)
    # No websocket protocol: nothing here speaks it, and not importing one keeps restarts quick.
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, server_header=False, access_log=False, ws="none",
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def _console() -> Any:
    """Rich's console on stderr, imported only when there is something to say."""
    from rich.console import Console

    return Console(stderr=True)


def main() -> None:
    serve(prog_name="python -m lightning_sql.server")
