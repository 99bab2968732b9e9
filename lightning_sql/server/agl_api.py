"""Agent-Lightning 0.3's store API over HTTP (``/v1/agl/...``), served from ``SqlLightningStore``.

The routes, payloads and status codes are those ``agentlightning.store.client_server``'s
``LightningStoreClient`` speaks, so Agent-Lightning runners in other processes or on other hosts
work against ``lightning-sql serve`` unchanged; the server itself does not import agentlightning.
Bodies follow its request models: a field that is absent is left as it is (``UNSET``), a field sent
as ``null`` where the store needs a value is a 400.  Calls work on the server's run unless the
``X-Lightning-SQL-Run`` header names another.  Only a call that stores something creates its run:
reads of a run that does not exist answer as for an empty run, and updates of what is not there a
400.  Bad input is a 400 with the store's message (the client does not retry a 4xx); an unreachable
database is a 503 (it retries).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lightning_sql.server.config import RUN_HEADER
from lightning_sql.server.errors import ApiError, JsonResponse, error_response

if TYPE_CHECKING:
    from lightning_sql.server.metrics import ServerMetrics
    from lightning_sql.server.stores import StorePool
    from lightning_sql.store import SqlLightningStore

PREFIX = "/v1/agl"
# The counts of ``statistics()``, all zero for a run that does not exist.
EMPTY_COUNTS = ("total_rollouts", "total_attempts", "total_spans", "total_resources", "total_workers", "queue_depth")
Endpoint = Callable[[Request], Awaitable[Response]]


def _dump(value: Any) -> Any:
    """JSON-ready form of a store result (models, lists of them, pages, None)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if hasattr(value, "items") and hasattr(value, "total") and hasattr(value, "limit"):
        return {"items": [_dump(i) for i in value.items], "limit": value.limit, "offset": value.offset, "total": value.total}
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [_dump(v) for v in value]
    return value


def reply(value: Any, status: int = 200) -> JsonResponse:
    return JsonResponse(_dump(value), status_code=status)


# An integer literal of 19 digits or more may not fit 64 bits, and orjson would read it as a float.
_LONG_INTEGER = re.compile(rb"(?<![\w.])-?\d{19,}(?![\d.eE])")
# Items one request may hand the store (rollouts to enqueue, ids to wait for, statuses to filter by):
# each becomes a model in memory before the store sees it.
MAX_ITEMS_PER_REQUEST = 10_000
# Seconds a claimer of a paused run is told to wait (Retry-After of its 429): resume_run wakes the
# store's own waiters at once; a client of the API polls.
PAUSED_RETRY_AFTER_S = 1


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, integers exactly (also past 64 bits, so that the check naming the field sees
    them rather than a float); ``ValueError`` when it is not JSON."""
    if _LONG_INTEGER.search(raw) is None:
        return orjson.loads(raw)
    return json.loads(raw)


async def body_of(request: Request, *, default: Any = None) -> Any:
    """The JSON body, ``default`` for an empty one; a 400 for anything that is not JSON."""
    raw = await request.body()
    if not raw.strip():
        return default
    try:
        return parse_json(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None


async def object_of(request: Request, *, required: bool = True) -> dict[str, Any]:
    data = await body_of(request)
    if data is None and not required:
        return {}
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def _present(body: dict[str, Any], name: str, *, nullable: bool = True) -> Any:
    """The field's value, ``UNSET`` when absent; ``null`` is a 400 for a field the store needs."""
    from lightning_sql.types import UNSET

    if name not in body:
        return UNSET
    if body[name] is None and not nullable:
        raise ApiError(400, f"{name} is invalid; it cannot be a null value.")
    return body[name]


class _Page:
    """Pagination, sorting and filter logic of a query, checked as Agent-Lightning's server checks them."""

    def __init__(self, source: dict[str, Any], fields: Sequence[str], default_sort: str | None = None) -> None:
        self.limit = _int(source.get("limit", -1), "limit")
        self.offset = _int(source.get("offset", 0), "offset")
        self.sort_by = source.get("sort_by", default_sort)
        self.sort_order = source.get("sort_order", "asc")
        self.filter_logic = source.get("filter_logic", "and")
        if self.sort_by is not None and self.sort_by not in fields:
            raise ApiError(400, f"Invalid sort_by: {self.sort_by}, allowed fields are: {', '.join(fields)}")
        if self.sort_order not in ("asc", "desc"):
            raise ApiError(400, f"Invalid sort_order: {self.sort_order}, allowed values are: asc, desc")
        if self.limit == 0 or self.limit < -1:
            raise ApiError(400, "Limit must be greater than 0 or -1 for no limit")
        if self.offset < 0:
            raise ApiError(400, "Offset must be greater than or equal to 0")
        if self.filter_logic not in ("and", "or"):
            raise ApiError(400, f"Invalid filter_logic: {self.filter_logic}, allowed values are: and, or")

    def empty(self) -> dict[str, Any]:
        """The page of a query on a run that does not exist."""
        return {"items": [], "limit": self.limit, "offset": self.offset, "total": 0}

    def sorting(self) -> dict[str, Any]:
        return {"sort_by": self.sort_by, "sort_order": self.sort_order, "limit": self.limit, "offset": self.offset}


def _int(value: Any, name: str, maximum: int | None = None) -> int:
    """An integer field (a JSON integer, or the digits of a query parameter) in 64 bits and at most
    ``maximum``; a 400 naming the field and the value otherwise."""
    from lightning_sql.types import MAX_INT64, MIN_INT64, check_int64

    if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
        value = int(value)
    try:
        return check_int64(value, name, minimum=MIN_INT64, maximum=MAX_INT64 if maximum is None else maximum)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)[:300]) from None


def _items(value: Any, name: str) -> None:
    if isinstance(value, list) and len(value) > MAX_ITEMS_PER_REQUEST:
        raise ApiError(400, f"{name} holds {len(value)} items: at most {MAX_ITEMS_PER_REQUEST} per request")


def _query(request: Request, *lists: str) -> dict[str, Any]:
    """Query parameters as a dict; ``lists`` name the repeatable ones (given as lists)."""
    params: dict[str, Any] = {k: v for k, v in request.query_params.items() if k not in lists}
    for name in lists:
        values = request.query_params.getlist(name)
        if values:
            params[name] = values
    return params


def _strings(value: Any, name: str) -> Any:
    """A list of strings (or None); the store checks the values themselves."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ApiError(400, f"{name} must be a list of strings")
    _items(value, name)
    return value


class AglApi:
    """One handler per route of Agent-Lightning's ``LightningStoreServer``."""

    def __init__(self, pool: StorePool, metrics: ServerMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    def _run(self, request: Request) -> str:
        return request.headers.get(RUN_HEADER) or self.pool.config.run

    def _store(self, request: Request) -> SqlLightningStore:
        """The store of the request's run, for a call that may create the run (it stores something)."""
        return self.pool.store(self._run(request))

    async def _existing(self, request: Request) -> SqlLightningStore | None:
        """The store of the request's run when the run exists, else None: reads, and writes that only
        change what is there, never create a run."""
        run = self._run(request)
        return self.pool.store(run) if await self.pool.run_exists(run) else None

    async def _target(self, request: Request, what: str) -> SqlLightningStore:
        store = await self._existing(request)
        if store is None:
            raise ApiError(400, f"{what} not found: run {self._run(request)!r} does not exist")
        return store

    # --- health and statistics ------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return reply({"status": "ok"})

    async def statistics(self, request: Request) -> Response:
        store = await self._existing(request)
        if store is None:
            return reply({"name": "SqlLightningStore", **dict.fromkeys(EMPTY_COUNTS, 0), "uptime": self.pool.uptime()})
        return reply(dict(await store.statistics()))

    # --- queue and rollouts ---------------------------------------------------------------------

    async def enqueue(self, request: Request) -> Response:
        from lightning_sql.types import EnqueueRolloutRequest

        body = await object_of(request)
        items = body.get("rollouts")
        if not isinstance(items, list):
            raise ApiError(400, "rollouts must be a list of rollout requests")
        _items(items, "rollouts")
        requests = [EnqueueRolloutRequest.model_validate(item) for item in items]
        if not requests:
            return reply([], 201)
        return reply(list(await self._store(request).enqueue_many_rollouts(requests)), 201)

    async def dequeue(self, request: Request) -> Response:
        body = await object_of(request, required=False)
        from lightning_sql.store.sql.filters import MAX_CLAIM_LIMIT

        limit = _int(body.get("limit", 1), "limit", MAX_CLAIM_LIMIT)
        worker_id = body.get("worker_id")
        if limit <= 0:
            return reply([])
        store = self._store(request) if worker_id is not None else await self._existing(request)
        if store is None:  # nothing to claim in a run that does not exist, and no worker to record
            return reply([])
        attempted = list(await store.dequeue_many_rollouts(limit=limit, worker_id=worker_id))
        self.metrics.claims_seen(self._run(request), attempted)
        if not attempted and store.run is not None:
            run = await store.get_run(store.run)
            if run is not None and run.paused:
                # As Agent-Lightning v1's gateway answers while it updates weights (docs/queue.md).
                detail = f"run {run.name!r} is paused: claim again after resume_run"
                return error_response(429, detail, headers={"Retry-After": str(PAUSED_RETRY_AFTER_S)})
        return reply(attempted)

    async def start_rollout(self, request: Request) -> Response:
        from lightning_sql.types import RolloutConfig

        body = await object_of(request)
        if "input" not in body:
            raise ApiError(400, "input is required")
        config = body.get("config")
        rollout = await self._store(request).start_rollout(
            input=body["input"],
            mode=body.get("mode"),
            resources_id=body.get("resources_id"),
            config=RolloutConfig.model_validate(config) if config is not None else None,
            metadata=body.get("metadata"),
            worker_id=body.get("worker_id"),
        )
        return reply(rollout, 201)

    async def _query_rollouts(self, request: Request, params: dict[str, Any]) -> Response:
        from lightning_sql.types import Rollout

        page = _Page(params, list(Rollout.model_fields))
        store = await self._existing(request)
        if store is None:
            return reply(page.empty())
        result = await store.query_rollouts(
            status_in=_strings(params.get("status_in"), "status_in"),
            rollout_id_in=_strings(params.get("rollout_id_in"), "rollout_id_in"),
            rollout_id_contains=params.get("rollout_id_contains"),
            filter_logic=page.filter_logic,
            **page.sorting(),
        )
        return reply(result)

    async def query_rollouts(self, request: Request) -> Response:
        return await self._query_rollouts(request, _query(request, "status_in", "rollout_id_in"))

    async def search_rollouts(self, request: Request) -> Response:
        return await self._query_rollouts(request, await object_of(request))

    async def get_rollout(self, request: Request) -> Response:
        store = await self._existing(request)
        return reply(None if store is None else await store.get_rollout_by_id(request.path_params["rollout_id"]))

    async def update_rollout(self, request: Request) -> Response:
        from lightning_sql.types import RolloutConfig, Unset

        body = await object_of(request)
        config = _present(body, "config", nullable=False)
        rollout_id = request.path_params["rollout_id"]
        store = await self._target(request, f"Rollout {rollout_id}")
        rollout = await store.update_rollout(
            rollout_id,
            input=_present(body, "input"),
            mode=_present(body, "mode"),
            resources_id=_present(body, "resources_id"),
            status=_present(body, "status", nullable=False),
            config=config if isinstance(config, Unset) else RolloutConfig.model_validate(config),
            metadata=_present(body, "metadata"),
        )
        return reply(rollout)

    # --- attempts -------------------------------------------------------------------------------

    async def start_attempt(self, request: Request) -> Response:
        body = await object_of(request, required=False)
        rollout_id = request.path_params["rollout_id"]
        store = await self._target(request, f"Rollout {rollout_id}")
        attempted = await store.start_attempt(rollout_id, worker_id=body.get("worker_id"))
        return reply(attempted, 201)

    async def _query_attempts(self, request: Request, params: dict[str, Any]) -> Response:
        from lightning_sql.types import Attempt

        page = _Page(params, list(Attempt.model_fields), default_sort="sequence_id")
        store = await self._existing(request)
        if store is None:
            return reply(page.empty())
        result = await store.query_attempts(request.path_params["rollout_id"], **page.sorting())
        return reply(result)

    async def query_attempts(self, request: Request) -> Response:
        return await self._query_attempts(request, _query(request))

    async def search_attempts(self, request: Request) -> Response:
        return await self._query_attempts(request, await object_of(request))

    async def latest_attempt(self, request: Request) -> Response:
        store = await self._existing(request)
        return reply(None if store is None else await store.get_latest_attempt(request.path_params["rollout_id"]))

    async def update_attempt(self, request: Request) -> Response:
        body = await object_of(request)
        rollout_id = request.path_params["rollout_id"]
        store = await self._target(request, f"Rollout {rollout_id}")
        attempt = await store.update_attempt(
            rollout_id,
            request.path_params["attempt_id"],
            status=_present(body, "status", nullable=False),
            worker_id=_present(body, "worker_id", nullable=False),
            last_heartbeat_time=_present(body, "last_heartbeat_time", nullable=False),
            metadata=_present(body, "metadata", nullable=False),
        )
        if "status" in body:
            self.metrics.attempt_seen(self._run(request), attempt)
        return reply(attempt)

    # --- workers --------------------------------------------------------------------------------

    async def _query_workers(self, request: Request, params: dict[str, Any]) -> Response:
        from lightning_sql.types import Worker

        page = _Page(params, list(Worker.model_fields))
        store = await self._existing(request)
        if store is None:
            return reply(page.empty())
        result = await store.query_workers(
            status_in=_strings(params.get("status_in"), "status_in"),
            worker_id_contains=params.get("worker_id_contains"),
            filter_logic=page.filter_logic,
            **page.sorting(),
        )
        return reply(result)

    async def query_workers(self, request: Request) -> Response:
        return await self._query_workers(request, _query(request, "status_in"))

    async def search_workers(self, request: Request) -> Response:
        return await self._query_workers(request, await object_of(request))

    async def get_worker(self, request: Request) -> Response:
        store = await self._existing(request)
        return reply(None if store is None else await store.get_worker_by_id(request.path_params["worker_id"]))

    async def update_worker(self, request: Request) -> Response:
        body = await object_of(request, required=False)
        worker = await self._store(request).update_worker(
            request.path_params["worker_id"], heartbeat_stats=_present(body, "heartbeat_stats", nullable=False)
        )
        return reply(worker)

    # --- resources ------------------------------------------------------------------------------

    @staticmethod
    def _resources(data: Any) -> Any:
        from pydantic import TypeAdapter

        from lightning_sql.types import NamedResources

        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object of named resources")
        return TypeAdapter(NamedResources).validate_python(data)

    async def query_resources(self, request: Request) -> Response:
        from lightning_sql.types import ResourcesUpdate

        params = _query(request)
        page = _Page(params, list(ResourcesUpdate.model_fields))
        store = await self._existing(request)
        if store is None:
            return reply(page.empty())
        result = await store.query_resources(
            resources_id=params.get("resources_id"),
            resources_id_contains=params.get("resources_id_contains"),
            **page.sorting(),
        )
        return reply(result)

    async def add_resources(self, request: Request) -> Response:
        resources = self._resources(await body_of(request))
        return reply(await self._store(request).add_resources(resources), 201)

    async def latest_resources(self, request: Request) -> Response:
        store = await self._existing(request)
        return reply(None if store is None else await store.get_latest_resources())

    async def update_resources(self, request: Request) -> Response:
        resources = self._resources(await body_of(request))
        return reply(await self._store(request).update_resources(request.path_params["resources_id"], resources))

    async def get_resources(self, request: Request) -> Response:
        store = await self._existing(request)
        return reply(None if store is None else await store.get_resources_by_id(request.path_params["resources_id"]))

    # --- spans ----------------------------------------------------------------------------------

    async def add_span(self, request: Request) -> Response:
        from lightning_sql.types import Span

        span = Span.model_validate(await object_of(request))
        stored = await (await self._target(request, f"Rollout {span.rollout_id}")).add_span(span)
        if stored is not None:
            self.metrics.spans_ingested.labels(source="api").inc()
        return reply(stored, 201)

    async def _query_spans(self, request: Request, params: dict[str, Any]) -> Response:
        from lightning_sql.types import Span

        if not isinstance(params.get("rollout_id"), str):
            raise ApiError(400, "rollout_id is required")
        page = _Page(params, list(Span.model_fields), default_sort="sequence_id")
        store = await self._existing(request)
        if store is None:
            return reply(page.empty())
        result = await store.query_spans(
            params["rollout_id"],
            params.get("attempt_id"),
            trace_id=params.get("trace_id"),
            trace_id_contains=params.get("trace_id_contains"),
            span_id=params.get("span_id"),
            span_id_contains=params.get("span_id_contains"),
            parent_id=params.get("parent_id"),
            parent_id_contains=params.get("parent_id_contains"),
            name=params.get("name"),
            name_contains=params.get("name_contains"),
            filter_logic=page.filter_logic,
            **page.sorting(),
        )
        return reply(result)

    async def query_spans(self, request: Request) -> Response:
        return await self._query_spans(request, _query(request))

    async def search_spans(self, request: Request) -> Response:
        return await self._query_spans(request, await object_of(request))

    async def next_sequence_id(self, request: Request) -> Response:
        body = await object_of(request)
        rollout_id, attempt_id = body.get("rollout_id"), body.get("attempt_id")
        if not isinstance(rollout_id, str) or not isinstance(attempt_id, str):
            raise ApiError(400, "rollout_id and attempt_id are required strings")
        store = await self._target(request, f"Rollout {rollout_id}")
        sequence_id = await store.get_next_span_sequence_id(rollout_id, attempt_id)
        return reply({"sequence_id": sequence_id})

    # --- waits ----------------------------------------------------------------------------------

    async def wait_for_rollouts(self, request: Request) -> Response:
        body = await object_of(request)
        rollout_ids = _strings(body.get("rollout_ids"), "rollout_ids")
        if rollout_ids is None:
            raise ApiError(400, "rollout_ids is required")
        timeout = body.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
            raise ApiError(400, "timeout must be a number or null")
        store = await self._existing(request)
        if store is None:  # a run that does not exist holds none of them
            return reply([])
        return reply(await store.wait_for_rollouts(rollout_ids=rollout_ids, timeout=timeout))


def api_routes(pool: StorePool, metrics: ServerMetrics) -> list[Route]:
    """The routes in matching order (fixed paths before the ``{id}`` ones they would also match)."""
    api = AglApi(pool, metrics)
    table: list[tuple[str, str, Endpoint]] = [
        ("GET", "/health", api.health),
        ("GET", "/statistics", api.statistics),
        ("POST", "/queues/rollouts/enqueue", api.enqueue),
        ("POST", "/queues/rollouts/dequeue", api.dequeue),
        ("POST", "/rollouts", api.start_rollout),
        ("GET", "/rollouts", api.query_rollouts),
        ("POST", "/rollouts/search", api.search_rollouts),
        ("GET", "/rollouts/{rollout_id}", api.get_rollout),
        ("POST", "/rollouts/{rollout_id}", api.update_rollout),
        ("POST", "/rollouts/{rollout_id}/attempts", api.start_attempt),
        ("GET", "/rollouts/{rollout_id}/attempts", api.query_attempts),
        ("POST", "/rollouts/{rollout_id}/attempts/search", api.search_attempts),
        ("GET", "/rollouts/{rollout_id}/attempts/latest", api.latest_attempt),
        ("POST", "/rollouts/{rollout_id}/attempts/{attempt_id}", api.update_attempt),
        ("GET", "/workers", api.query_workers),
        ("POST", "/workers/search", api.search_workers),
        ("GET", "/workers/{worker_id}", api.get_worker),
        ("POST", "/workers/{worker_id}", api.update_worker),
        ("GET", "/resources", api.query_resources),
        ("POST", "/resources", api.add_resources),
        ("GET", "/resources/latest", api.latest_resources),
        ("POST", "/resources/{resources_id}", api.update_resources),
        ("GET", "/resources/{resources_id}", api.get_resources),
        ("POST", "/spans", api.add_span),
        ("GET", "/spans", api.query_spans),
        ("POST", "/spans/search", api.search_spans),
        ("POST", "/spans/next", api.next_sequence_id),
        ("POST", "/waits/rollouts", api.wait_for_rollouts),
    ]
    return [Route(PREFIX + path, endpoint, methods=[method]) for method, path, endpoint in table]
