"""The dashboard's pages: each handler runs a few bounded queries (queries.py) and renders a template."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from jinja2 import Environment
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from lightning_sql.server.dashboard import charts, queries
from lightning_sql.server.dashboard.diffs import resource_lines, side_by_side
from lightning_sql.server.dashboard.figures import (
    BUCKETS,
    MIN_AXIS_SECONDS,
    latest,
    reward_charts,
    run_stats,
)
from lightning_sql.server.dashboard.queries import IN_FLIGHT, PAGE_SIZE, SORTS, RolloutFilter
from lightning_sql.server.dashboard.traces import build_tree, is_llm_call, llm_call, rewards_of
from lightning_sql.server.readonly import Database

logger = logging.getLogger(__name__)

LIVE_INTERVAL_MS = 4000
ROLLOUT_MODES = ("train", "val", "test", "none")
ROLLOUT_STATUSES = ("queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled")


def _key(request: Request, name: str, largest: int, what: str) -> int:
    """An integer key of the path; one no column can hold is a missing thing, not a database error."""
    value = int(request.path_params[name])
    if value > largest:
        raise HTTPException(404, f"No {what} with id {value}")
    return value


class Pages:
    def __init__(self, db: Database, env: Environment, clock: Callable[[], float]) -> None:
        self.db = db
        self.env = env
        self.clock = clock

    # --- plumbing -------------------------------------------------------------------------------

    def render(self, request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        context.setdefault("live", False)
        html = self.env.get_template(template).render(
            root=root, now=self.clock(), request_path=request.url.path, live_interval=LIVE_INTERVAL_MS, **context
        )
        return HTMLResponse(html, status_code=status_code, headers={"Cache-Control": "no-store"})

    async def _run(self, run_id: int) -> Any:
        """The run's row, or a 404 page."""
        rows = await self.db.rows(queries.run_row(run_id))
        if not rows:
            raise HTTPException(404, f"No run with id {run_id}")
        return rows[0]

    @staticmethod
    def _run_id(request: Request) -> int:
        return _key(request, "run_id", 2**31 - 1, "run")

    # --- runs -----------------------------------------------------------------------------------

    async def runs(self, request: Request) -> Response:
        run_rows, count_rows, worker_rows = await self.db.many(
            queries.run_list_with_activity(), queries.status_counts(), queries.worker_heartbeats()
        )
        items = [(run, run_stats(run, count_rows, worker_rows)) for run in run_rows]
        live = any(stats.in_flight for _run, stats in items)
        return self.render(request, "runs.html", items=items, statuses=ROLLOUT_STATUSES, live=live)

    # --- one run --------------------------------------------------------------------------------

    async def run(self, request: Request) -> Response:
        run_id = self._run_id(request)
        now = self.clock()
        run_rows, count_rows, worker_rows, positions = await self.db.many(
            queries.run_row(run_id),
            queries.status_counts(run_id),
            queries.worker_heartbeats(run_id),
            queries.window_positions(run_id),
        )
        if not run_rows:
            raise HTTPException(404, f"No run with id {run_id}")
        run = run_rows[0]
        seqs = [row.create_seq for row in positions]
        # A window covering the whole run needs no bound.
        threshold = seqs[-1] if len(seqs) >= queries.WINDOW else None
        reward_threshold = seqs[queries.REWARD_WINDOW - 1] if len(seqs) >= queries.REWARD_WINDOW else None
        bounds, window_rows, failure_rows, workers = await self.db.many(
            queries.window_bounds(run_id, threshold),
            queries.reward_window(run_id, reward_threshold),
            queries.failures(run_id, threshold),
            queries.worker_list(run_id),
        )
        first_start, last_start, last_end = bounds[0] if bounds else (None, None, None)
        stats = run_stats(run, count_rows, worker_rows)
        stats.last_activity = latest(stats.last_activity, last_start, last_end)
        origin = first_start if first_start is not None else now
        # Clocks step back: what falls outside the axis joins its first or last interval.
        width = max((last_start or origin) - origin, MIN_AXIS_SECONDS) / BUCKETS * (1 + 1e-9)
        overview_rows = await self.db.rows(
            queries.window_overview(
                self.db.dialect, run_id, threshold, now - queries.THROUGHPUT_WINDOW_SECONDS, origin, width
            )
        )
        counts: dict[tuple[int, str], int] = {}
        recent = 0
        for row in overview_rows:
            key = (min(max(int(row.b), 0), BUCKETS - 1), row.status)
            counts[key] = counts.get(key, 0) + row.n
            recent += int(row.recent or 0)
        status_chart = charts.stacked_status_bars(counts, BUCKETS, origin, width)
        reward_chart, version_chart, version_rows = reward_charts(window_rows)
        failure_groups: dict[str, Any] = {}
        examples: dict[str, list[Any]] = {}
        for row in failure_rows:
            failure_groups.setdefault(row.kind, row)
            examples.setdefault(row.kind, []).append(row)
        return self.render(
            request,
            "run.html",
            run=run,
            stats=stats,
            recent_per_minute=recent / (queries.THROUGHPUT_WINDOW_SECONDS / 60.0),
            statuses=ROLLOUT_STATUSES,
            status_chart=status_chart,
            reward_chart=reward_chart,
            version_chart=version_chart,
            version_rows=version_rows,
            window=len(seqs),
            windowed=threshold is not None,
            reward_window=min(len(seqs), queries.REWARD_WINDOW),
            failures=list(failure_groups.values()),
            examples=examples,
            workers=workers,
            live=stats.in_flight > 0,
        )

    # --- rollouts table -------------------------------------------------------------------------

    @staticmethod
    def _filter(request: Request) -> RolloutFilter:
        q = request.query_params
        status = q.get("status", "")
        if status and status not in ROLLOUT_STATUSES:
            raise HTTPException(400, f"Unknown status {status!r}: use one of {', '.join(ROLLOUT_STATUSES)}")
        mode = q.get("mode", "")
        if mode and mode not in ROLLOUT_MODES:
            raise HTTPException(400, f"Unknown mode {mode!r}: use one of {', '.join(ROLLOUT_MODES)}")
        version_text = q.get("version", "").strip()
        try:
            version = int(version_text) if version_text else None
            page = int(q.get("page", "1") or "1")
        except ValueError:
            raise HTTPException(400, "version and page must be whole numbers") from None
        if page < 1 or page > 1_000_000:
            raise HTTPException(400, "page must be between 1 and 1000000")
        sort = q.get("sort", "created") or "created"
        if sort not in SORTS:
            raise HTTPException(400, f"Unknown sort {sort!r}: use one of {', '.join(SORTS)}")
        order = q.get("order", "desc") or "desc"
        if order not in ("asc", "desc"):
            raise HTTPException(400, "order must be asc or desc")
        text = q.get("q", "")
        if len(text) > 200:
            raise HTTPException(400, "the text filter is limited to 200 characters")
        return RolloutFilter(
            status=status,
            mode=mode,
            version=version,
            text=text,
            sort=sort,
            descending=order == "desc",
            page=page,
        )

    async def rollouts(self, request: Request) -> Response:
        run_id = self._run_id(request)
        f = self._filter(request)
        run = await self._run(run_id)
        dialect = self.db.dialect
        page_rows, version_rows = await self.db.many(
            queries.rollout_page(dialect, run_id, f), queries.version_choices(run_id)
        )
        if f.page == 1 and len(page_rows) < PAGE_SIZE:
            total = len(page_rows)  # the first page holds every match: no second pass to count them
        else:
            total = int((await self.db.rows(queries.rollout_count(dialect, run_id, f)))[0][0])
        ids = [row.rollout_id for row in page_rows]
        summaries: dict[str, Any] = {}
        inputs: dict[str, Any] = {}
        if ids:
            summary_rows, input_rows = await self.db.many(queries.summaries(run_id, ids), queries.inputs(run_id, ids))
            summaries = {row.rollout_id: row for row in summary_rows}
            inputs = {row.rollout_id: row.input for row in input_rows}
        versions = [row.version for row in version_rows]
        rows = [(summaries.get(rid), inputs.get(rid), rid) for rid in ids]
        live = any(s is not None and s.status in IN_FLIGHT for s, _i, _r in rows)
        return self.render(
            request,
            "rollouts.html",
            run=run,
            f=f,
            rows=rows,
            total=min(total, queries.COUNT_LIMIT),
            more=total > queries.COUNT_LIMIT,
            pages=max(1, math.ceil(min(total, queries.COUNT_LIMIT) / PAGE_SIZE)),
            statuses=ROLLOUT_STATUSES,
            modes=ROLLOUT_MODES,
            versions=versions,
            sorts=list(SORTS),
            live=live,
        )

    # --- one rollout ----------------------------------------------------------------------------

    async def rollout(self, request: Request) -> Response:
        run_id = self._run_id(request)
        rollout_id = request.path_params["rollout_id"]
        run = await self._run(run_id)
        rollout_rows, attempt_rows, reward_rows = await self.db.many(
            queries.rollout_row(run_id, rollout_id),
            queries.attempt_rows(run_id, rollout_id),
            queries.final_reward(run_id, rollout_id),
        )
        if not rollout_rows:
            raise HTTPException(404, f"No rollout {rollout_id!r} in this run")
        rollout = rollout_rows[0]
        chosen = request.query_params.get("attempt") or (attempt_rows[-1].attempt_id if attempt_rows else None)
        if chosen is not None and not any(a.attempt_id == chosen for a in attempt_rows):
            raise HTTPException(404, f"No attempt {chosen!r} in rollout {rollout_id!r}")
        now = self.clock()
        timeline, t0, total = charts.lanes(
            [
                (a.attempt_id, f"#{a.sequence_id}", f"a-{a.status}", a.start_time, a.end_time or a.last_heartbeat_time, 0)
                for a in attempt_rows
            ],
            now,
        )
        nodes: list[Any] = []
        truncated = False
        waterfall: list[charts.Lane] = []
        w_t0 = w_total = 0.0
        if chosen is not None:
            span_rows = list(await self.db.rows(queries.span_rows(run_id, rollout_id, chosen)))
            truncated = len(span_rows) > queries.SPAN_LIMIT
            _roots, nodes = build_tree(span_rows[: queries.SPAN_LIMIT])
            waterfall, w_t0, w_total = charts.lanes(
                [
                    (
                        str(n.pk),
                        n.name,
                        "reward" if n.rewards else ("llm" if n.is_llm_call else f"sc-{n.status_code}"),
                        n.start_time,
                        n.end_time,
                        n.depth,
                    )
                    for n in nodes
                ],
                now,
            )
        return self.render(
            request,
            "rollout.html",
            run=run,
            rollout=rollout,
            attempts=attempt_rows,
            chosen=chosen,
            final_reward=reward_rows[0].final_reward if reward_rows else None,
            timeline=timeline,
            timeline_t0=t0,
            timeline_total=total,
            nodes=nodes,
            lanes=dict(zip([n.pk for n in nodes], waterfall, strict=True)),
            waterfall_t0=w_t0,
            waterfall_total=w_total,
            truncated=truncated,
            span_limit=queries.SPAN_LIMIT,
            live=rollout.status in IN_FLIGHT,
        )

    async def span(self, request: Request) -> Response:
        run_id = self._run_id(request)
        run = await self._run(run_id)
        rows = await self.db.rows(queries.span_detail(run_id, _key(request, "span_pk", 2**63 - 1, "span")))
        if not rows:
            raise HTTPException(404, "No such span in this run")
        span = rows[0]
        attributes = span.attributes if isinstance(span.attributes, dict) else {}
        node_rewards = rewards_of(span.name, attributes)
        call = llm_call(attributes) if is_llm_call(span.name, attributes) else None
        return self.render(
            request, "span.html", run=run, span=span, attributes=attributes, rewards=node_rewards, call=call
        )

    # --- resources ------------------------------------------------------------------------------

    async def resources(self, request: Request) -> Response:
        run_id = self._run_id(request)
        run = await self._run(run_id)
        ids = await self.db.rows(queries.resource_ids(run_id))
        chosen = request.query_params.get("id") or (ids[0].resources_id if ids else None)
        history: list[Any] = []
        diff = None
        a = b = None
        if chosen is not None:
            history = list(await self.db.rows(queries.resource_history(run_id, chosen)))
            if not history and request.query_params.get("id"):
                raise HTTPException(404, "No resources with that id in this run")
            versions = [row.version for row in history]
            try:
                b = int(request.query_params.get("b") or (versions[0] if versions else 0))
                a = int(request.query_params.get("a") or (versions[1] if len(versions) > 1 else b))
            except ValueError:
                raise HTTPException(400, "versions a and b must be whole numbers") from None
            if versions:
                left_rows, right_rows = await self.db.many(
                    queries.resource_version(run_id, chosen, a), queries.resource_version(run_id, chosen, b)
                )
                if not left_rows or not right_rows:
                    raise HTTPException(404, f"Version {a if not left_rows else b} of these resources does not exist")
                diff = side_by_side(resource_lines(left_rows[0].resources), resource_lines(right_rows[0].resources))
        return self.render(
            request,
            "resources.html",
            run=run,
            ids=ids,
            chosen=chosen,
            history=history,
            a=a,
            b=b,
            diff=diff,
        )

    # --- errors ---------------------------------------------------------------------------------

    def guarded(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` answering a bad request or an unreachable database with a page, never a traceback
        (the routes are mounted into an app whose error handlers are not the dashboard's)."""

        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except HTTPException as exc:
                return self.render(request, "error.html", status_code=exc.status_code, message=exc.detail)
            except DATABASE_ERRORS as exc:
                logger.warning("dashboard query failed: %s", exc)
                return self.render(
                    request, "error.html", status_code=503, message="The database did not answer; try again shortly."
                )

        endpoint.__name__ = handler.__name__
        return endpoint


DATABASE_ERRORS = (SQLAlchemyError, OSError)
