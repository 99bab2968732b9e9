"""``ServerConfig``: what one ``lightning-sql serve`` process serves, and how safely."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4747
DEFAULT_RUN = "default"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# How long a call waits for an unreachable database before answering 503 (the store's default of
# 30 s suits a runner that must not give up; an HTTP client should hear sooner, and it retries).
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# Request header naming the run a call works on (API and ingestion); the server's run otherwise.
RUN_HEADER = "x-lightning-sql-run"
# OTLP resource or span attribute naming the run of a span (span-level wins, then resource, header).
RUN_ATTRIBUTE = "lightning_sql.run"


@dataclass(frozen=True)
class ServerConfig:
    """Options of one server process.

    ``run`` is the run that API calls and ingested spans go to unless a request names another (the
    ``X-Lightning-SQL-Run`` header, or a ``lightning_sql.run`` OTLP attribute).  ``token``: when set,
    every call except ``/healthz`` and the login page needs it (``Authorization: Bearer``, HTTP
    Basic with the token as password, or the dashboard's login cookie).  ``read_only`` serves the
    dashboard, ``/metrics`` and ``/healthz`` only and opens the database without ever writing.
    ``connect_timeout``: seconds a call waits for an unreachable database before its 503.
    ``allowed_hosts``: ``Host`` names served besides loopback and the bound address (``*``: any;
    ``lightning_sql.server.guard``).
    """

    url: str
    run: str = DEFAULT_RUN
    schema: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token: str | None = None
    read_only: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    cors_origins: tuple[str, ...] = field(default_factory=tuple)
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    allowed_hosts: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError("url must be a non-empty database URL")
        if not isinstance(self.run, str) or not self.run:
            raise ValueError(f"run must be a non-empty str, got {self.run!r}")
        if self.schema is not None and (not isinstance(self.schema, str) or not self.schema):
            raise ValueError(f"schema must be a non-empty str or None, got {self.schema!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {self.port!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError("token must be a non-empty str or None")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive int, got {self.max_body_bytes!r}")
        if isinstance(self.connect_timeout, bool) or not isinstance(self.connect_timeout, int | float):
            raise ValueError(f"connect_timeout must be a number of seconds, got {self.connect_timeout!r}")
        if not self.connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0, got {self.connect_timeout!r}")
        for name in ("cors_origins", "allowed_hosts"):
            values = getattr(self, name)
            if not isinstance(values, tuple):
                raise TypeError(f"{name} must be a tuple of strings, got {values!r}")
            for value in values:
                if not isinstance(value, str) or not value or value != value.strip():
                    raise ValueError(f"{name} must hold non-empty strings without surrounding spaces, got {value!r}")
