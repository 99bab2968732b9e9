"""``/metrics``: the server's Prometheus metrics, one registry per app.

Counters and histograms record what this process sees (API calls, ingested spans, database
errors); the gauges (queue depth, rollouts by status) are read from the database on each scrape, in
one grouped count, for the runs of the database with activity in the last
``catalog.GAUGE_WINDOW_S`` (whoever wrote them: this server, runners, a trainer on the database).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from lightning_sql.server.catalog import Catalog
    from lightning_sql.types import RolloutStatus

logger = logging.getLogger(__name__)

ROLLOUT_STATUSES: tuple[RolloutStatus, ...] = ("queuing", "preparing", "running", "failed", "succeeded", "cancelled", "requeuing")
QUEUED_STATUSES: tuple[RolloutStatus, ...] = ("queuing", "requeuing")
FINISHED_ATTEMPT_STATUSES = frozenset({"succeeded", "failed", "timeout", "unresponsive"})
DURATION_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
CLAIM_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


class ServerMetrics:
    """The metrics of one app, in a registry of its own (several apps in one process stay apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_depth = Gauge(
            "lightning_sql_queue_depth", "Rollouts waiting in the queue (queuing or requeuing).", ["run"], registry=r
        )
        self.rollouts = Gauge("lightning_sql_rollouts", "Rollouts by status.", ["run", "status"], registry=r)
        self.attempts_finished = Counter(
            "lightning_sql_attempts_finished",
            "Attempts this server saw reach a final status (through the API).",
            ["run", "status"],
            registry=r,
        )
        self.attempt_duration = Histogram(
            "lightning_sql_attempt_duration_seconds",
            "Start to end of the attempts this server saw finish.",
            ["run"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.claim_latency = Histogram(
            "lightning_sql_claim_latency_seconds",
            "Enqueue to first claim of the rollouts dequeued through this server.",
            ["run"],
            buckets=CLAIM_BUCKETS,
            registry=r,
        )
        self.spans_ingested = Counter(
            "lightning_sql_spans_ingested", "Spans stored through this server.", ["source"], registry=r
        )
        self.spans_rejected = Counter(
            "lightning_sql_spans_rejected",
            "OTLP spans not stored (no rollout/attempt attribution, unknown rollout or attempt, bad ids).",
            ["reason"],
            registry=r,
        )
        self.database_errors = Counter(
            "lightning_sql_database_errors",
            "Store calls that failed because the database did not answer (answered 503).",
            ["error"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "lightning_sql_metrics_scrape_errors", "Gauge reads at scrape time that failed.", registry=r
        )

    def database_error(self, exc: BaseException) -> None:
        self.database_errors.labels(error=type(exc).__name__).inc()

    def attempt_seen(self, run: str, attempt: Any) -> None:
        """Count an attempt returned by an update that finished it."""
        if attempt.status not in FINISHED_ATTEMPT_STATUSES:
            return
        self.attempts_finished.labels(run=run, status=attempt.status).inc()
        if attempt.end_time is not None and attempt.start_time is not None:
            self.attempt_duration.labels(run=run).observe(max(attempt.end_time - attempt.start_time, 0.0))

    def claims_seen(self, run: str, attempted: Any) -> None:
        """Observe enqueue-to-claim latency of first attempts (a retry has no enqueue time of its own)."""
        for item in attempted:
            if item.attempt.sequence_id == 1:
                self.claim_latency.labels(run=run).observe(max(item.attempt.start_time - item.start_time, 0.0))

    async def refresh_gauges(self, catalog: Catalog | None) -> None:
        """Set the gauges from the database: the runs with recent activity (``catalog.GAUGE_WINDOW_S``)."""
        if catalog is None:
            return
        try:
            active = await catalog.active_run_counts(time.time())
        except Exception as exc:  # noqa: BLE001 - a scrape still returns what it has
            self.scrape_errors.inc()
            self.database_error(exc)
            logger.warning("Reading the gauges failed: %s", exc)
            return
        self.rollouts.clear()
        self.queue_depth.clear()
        for run in active:
            for status in ROLLOUT_STATUSES:
                self.rollouts.labels(run=run.name, status=status).set(run.counts.get(status, 0))
            self.queue_depth.labels(run=run.name).set(sum(run.counts.get(s, 0) for s in QUEUED_STATUSES))

    def endpoint(self, catalog: Callable[[], Catalog | None]) -> Any:
        async def metrics(request: Request) -> Response:
            await self.refresh_gauges(catalog())
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return metrics
