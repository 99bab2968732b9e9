"""Safe by default: token on every call (and the dashboard's one-time login), read-only serving
(also as a read-only PostgreSQL role), no CORS unless configured, size-limited bodies, and JSON
errors with a message instead of tracebacks."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.server import ServerConfig
from lightning_sql.server.auth import COOKIE_NAME
from tests.conftest import PG_URL, BackendSpec
from tests.helpers import pg_execute
from tests.server.conftest import RUN, RunningServer, serve

TOKEN = "correct horse battery staple"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
ENQUEUE = "/v1/agl/queues/rollouts/enqueue"


def test_every_call_needs_the_token(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory(token=TOKEN)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path in [("GET", "/v1/agl/health"), ("POST", "/v1/traces"), ("GET", "/metrics"), ("GET", "/")]:
            response = http.request(method, path)
            assert response.status_code == 401, (path, response.text)
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert "token" in response.json()["detail"]
        assert http.get("/v1/agl/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/v1/agl/health", headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401
        assert http.get("/v1/agl/health", headers=BEARER).json() == {"status": "ok"}
        assert http.get("/v1/agl/health", auth=("anyone", TOKEN)).status_code == 200  # HTTP Basic, token as password
        assert http.get("/v1/agl/health", auth=(TOKEN, "wrong")).status_code == 401
        assert http.get("/metrics", headers=BEARER).status_code == 200
        assert http.get("/healthz").status_code == 200  # probes need no token
        refused = http.post(ENQUEUE, json={"rollouts": [{"input": 1}]})
        assert refused.status_code == 401
        assert http.get("/v1/agl/statistics", headers=BEARER).json()["total_rollouts"] == 0


def test_the_dashboard_asks_for_the_token_once(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory(token=TOKEN)
    page = {"Accept": "text/html,application/xhtml+xml"}
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as http:
        first = http.get("/runs?sort=age", headers=page)
        assert first.status_code == 303
        login_url = first.headers["location"]
        assert login_url.startswith("/login?next=") and unquote(login_url.split("=", 1)[1]) == "/runs?sort=age"
        form = http.get(login_url)
        assert form.status_code == 200 and 'name="token"' in form.text and "/runs?sort=age" in form.text

        wrong = http.post("/login", data={"token": "guess", "next": "/runs"})
        assert wrong.status_code == 401 and COOKIE_NAME not in wrong.headers.get("set-cookie", "")
        assert "not this server" in wrong.text

        right = http.post("/login", data={"token": TOKEN, "next": "/runs?sort=age"})
        assert right.status_code == 303 and right.headers["location"] == "/runs?sort=age"
        cookie = right.headers["set-cookie"]
        assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
        value = http.cookies[COOKIE_NAME]
        assert TOKEN not in value and TOKEN.replace(" ", "+") not in cookie

        assert http.get("/", headers=page).status_code == 200  # the cookie now opens dashboard pages
        # ... but never the API, ingestion or metrics: those need the header.
        assert http.post(ENQUEUE, json={"rollouts": [{"input": 1}]}).status_code == 401
        assert http.get("/metrics").status_code == 401
        forged = httpx.get(server.url + "/", headers={**page, "Cookie": f"{COOKIE_NAME}={'0' * len(value)}"})
        assert forged.status_code == 303

        # After login only local paths: never another site.
        for target in ["//evil.example/x", "https://evil.example/", "/\\evil.example"]:
            again = http.post("/login", data={"token": TOKEN, "next": target})
            assert again.headers["location"] == "/", target
        escaped = http.get("/login", params={"next": '/"><script>alert(1)</script>'})
        assert "<script>alert(1)" not in escaped.text


async def test_read_only_serves_no_api_and_writes_nothing(
    server_factory: Callable[..., RunningServer], mp_backend: BackendSpec
) -> None:
    writer = SqlLightningStore(mp_backend.url, **mp_backend.options(run=RUN))
    try:
        await writer.enqueue_rollout({"task": 1})
    finally:
        await writer.close()
    server = server_factory(read_only=True)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path in [("POST", ENQUEUE), ("GET", "/v1/agl/health"), ("POST", "/v1/traces"), ("GET", "/v1/agl/rollouts")]:
            response = http.request(method, path, json={"rollouts": [{"input": 2}]})
            assert response.status_code == 403, (path, response.text)
            assert "read-only" in response.json()["detail"]
        assert http.get("/healthz").status_code == 200
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert server.metric(metrics.text, "lightning_sql_queue_depth", run=RUN) == 1
    store = SqlLightningStore(mp_backend.url, **mp_backend.options(run=RUN, read_only=True, create_run=False))
    try:
        assert [r.input for r in await store.query_rollouts()] == [{"task": 1}]
    finally:
        await store.close()


@pytest.fixture
def pg_reader_role(pg_backend: BackendSpec) -> Iterator[tuple[str, str]]:
    """A login role with the read-only grants of docs/operations.md on the test's schema."""
    import asyncio

    role = f"lsql_srv_reader_{uuid.uuid4().hex[:8]}"
    schema = pg_backend.schema
    asyncio.run(pg_execute(PG_URL, f"CREATE ROLE {role} LOGIN PASSWORD 'pw-{role}'"))
    try:
        yield PG_URL.replace("postgres@", f"{role}:pw-{role}@", 1), str(schema)
    finally:
        asyncio.run(pg_execute(PG_URL, f"DROP OWNED BY {role}; DROP ROLE IF EXISTS {role}"))


async def test_read_only_with_a_read_only_postgresql_role(pg_backend: BackendSpec, pg_reader_role: tuple[str, str]) -> None:
    reader_url, schema = pg_reader_role
    owner = pg_backend.open(run=RUN)
    try:
        rollout = await owner.enqueue_rollout({"task": "<script>x</script>"})
    finally:
        await owner.close()
    role = reader_url.split("//", 1)[1].split(":", 1)[0]
    await pg_execute(PG_URL, f"GRANT USAGE ON SCHEMA {schema} TO {role}; GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role};")
    with serve(ServerConfig(url=reader_url, run=RUN, schema=schema, read_only=True)) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/healthz").json() == {"status": "ok"}
            metrics = http.get("/metrics")
            assert metrics.status_code == 200
            assert server.metric(metrics.text, "lightning_sql_rollouts", run=RUN, status="queuing") == 1
            assert http.get("/").status_code == 200
            assert http.post(ENQUEUE, json={"rollouts": [{"input": 1}]}).status_code == 403
    check = pg_backend.open(run=RUN, read_only=True, create_run=False)
    try:
        assert [r.rollout_id for r in await check.query_rollouts()] == [rollout.rollout_id]
    finally:
        await check.close()


def test_no_cors_unless_configured(server_factory: Callable[..., RunningServer]) -> None:
    origin = {"Origin": "http://ui.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    plain = server_factory()
    with httpx.Client(base_url=plain.url, timeout=30) as http:
        response = http.get("/v1/agl/health", headers=origin)
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
        answer = http.options(ENQUEUE, headers=preflight)
        assert "access-control-allow-origin" not in answer.headers
    allowed = server_factory(cors_origins=("http://ui.example",), token=TOKEN)
    with httpx.Client(base_url=allowed.url, timeout=30) as http:
        answer = http.options(ENQUEUE, headers=preflight)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://ui.example"
        other = http.options(ENQUEUE, headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers  # neither the origin nor "*"
        assert http.get("/v1/agl/health", headers={**origin, **BEARER}).headers["access-control-allow-origin"] == (
            "http://ui.example"
        )


async def test_bodies_are_size_limited(server_factory: Callable[..., RunningServer], mp_backend: BackendSpec) -> None:
    server = server_factory(max_body_bytes=2048)
    big = {"rollouts": [{"input": "x" * 4096}]}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        declared = http.post(ENQUEUE, json=big)
        assert declared.status_code == 413 and "2048 bytes" in declared.json()["detail"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
            yield b'{"rollouts": [{"input": "'
            for _ in range(8):
                yield b"y" * 512
            yield b'"}]}'

        streamed = http.post(ENQUEUE, content=chunks(), headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413 and "limit" in streamed.json()["detail"]
        assert http.post(ENQUEUE, json={"rollouts": [{"input": "small"}]}).status_code == 201
    store = SqlLightningStore(mp_backend.url, **mp_backend.options(run=RUN, read_only=True, create_run=False))
    try:
        assert [r.input for r in await store.query_rollouts()] == ["small"]
    finally:
        await store.close()


def test_an_unexpected_error_is_a_json_500_without_traceback(
    server_factory: Callable[..., RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_factory()
    assert httpx.post(server.url + ENQUEUE, json={"rollouts": [{"input": 1}]}, timeout=30).status_code == 201

    async def broken(self: SqlLightningStore) -> None:
        raise RuntimeError("a bug in the server")

    monkeypatch.setattr(SqlLightningStore, "statistics", broken)
    response = httpx.get(server.url + "/v1/agl/statistics", timeout=30)
    assert response.status_code == 500
    assert response.json() == {"detail": "internal server error (details in the server log)", "error_type": "RuntimeError"}
    assert "Traceback" not in response.text and "a bug" not in response.text


def test_binds_loopback_by_default() -> None:
    config = ServerConfig(url="sqlite://")
    assert config.host == "127.0.0.1" and config.token is None and config.cors_origins == () and not config.read_only


async def _pg_schema_exists(schema: str) -> bool:
    import asyncpg

    conn = await asyncpg.connect(PG_URL.replace("postgresql://", "postgres://", 1), timeout=10)
    try:
        return bool(await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema))
    finally:
        await conn.close()


def _browse(server: RunningServer) -> None:
    """What a read-only server answers to: every page, probe and scrape (none may write)."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path in ["/healthz", "/metrics", "/", "/runs/1", "/runs/1/rollouts", "/v1/agl/statistics"]:
            assert http.get(path).status_code in (200, 403, 404, 503), path  # 503: no schema to read
        assert http.post(ENQUEUE, json={"rollouts": [{"input": 1}]}).status_code == 403


async def test_a_read_only_server_creates_migrates_and_sweeps_nothing(
    server_factory: Callable[..., RunningServer], mp_backend: BackendSpec, tmp_path: Path
) -> None:
    from lightning_sql import RolloutConfig

    # An empty database: no schema may appear.
    if mp_backend.is_postgres:
        assert mp_backend.schema is not None and not await _pg_schema_exists(mp_backend.schema)
    else:
        sqlite3.connect(mp_backend.url.removeprefix("sqlite:///")).close()
    _browse(server_factory(read_only=True, run="missing"))
    if mp_backend.is_postgres:
        assert not await _pg_schema_exists(str(mp_backend.schema))
    else:
        with sqlite3.connect(mp_backend.url.removeprefix("sqlite:///")) as conn:
            assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)

    # A run whose lease expired long ago, and a --run that does not exist: nothing changes.
    writer = SqlLightningStore(mp_backend.url, **mp_backend.options(run=RUN, clock=lambda: 1_000_000.0, clock_sync=False))
    try:
        await writer.enqueue_rollout({"task": 1}, config=RolloutConfig(unresponsive_seconds=1.0))
        claimed = await writer.dequeue_rollout(worker_id="w")
        assert claimed is not None
    finally:
        await writer.close()
    _browse(server_factory(read_only=True, run="missing"))
    _browse(server_factory(read_only=True, run=RUN))
    check = SqlLightningStore(mp_backend.url, **mp_backend.options(run=RUN, read_only=True, create_run=False))
    try:
        assert [r.name for r in await check.list_runs()] == [RUN]
        attempts = list(await check.query_attempts(claimed.rollout_id))
        assert [(a.status, a.end_time) for a in attempts] == [("preparing", None)]
        assert (await check.get_rollout_by_id(claimed.rollout_id)).status == "preparing"  # type: ignore[union-attr]
    finally:
        await check.close()


def test_the_login_cookie_never_opens_ingestion_and_cors_answers_only_its_origins(
    server_factory: Callable[..., RunningServer],
) -> None:
    server = server_factory(token=TOKEN, cors_origins=("http://ui.example",))
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as http:
        assert http.post("/login", data={"token": TOKEN}).status_code == 303 and http.cookies
        traces = http.post("/v1/traces", content=b"", headers={"Content-Type": "application/x-protobuf"})
        assert traces.status_code == 401  # a logged-in browser cannot ingest spans
        evil = {"Origin": "http://evil.example"}
        for answer in [
            http.options(ENQUEUE, headers={**evil, "Access-Control-Request-Method": "POST"}),
            http.get("/v1/agl/health", headers={**evil, **BEARER}),  # a simple cross-origin request
        ]:
            assert "access-control-allow-origin" not in answer.headers, answer.headers
            assert "access-control-allow-credentials" not in answer.headers
        good = http.get("/v1/agl/health", headers={"Origin": "http://ui.example", **BEARER})
        assert good.headers["access-control-allow-origin"] == "http://ui.example"


def test_the_cookie_is_secure_behind_https(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory(token=TOKEN)
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as http:
        plain = http.post("/login", data={"token": TOKEN}).headers["set-cookie"].lower()
        assert "secure" not in plain
        # uvicorn takes X-Forwarded-Proto from a proxy on this host (its default forwarded_allow_ips).
        forwarded = http.post("/login", data={"token": TOKEN}, headers={"X-Forwarded-Proto": "https"})
        assert "; secure" in forwarded.headers["set-cookie"].lower()


def test_the_default_body_limit_is_16_mib() -> None:
    from lightning_sql.server.config import DEFAULT_MAX_BODY_BYTES

    assert ServerConfig(url="sqlite://").max_body_bytes == DEFAULT_MAX_BODY_BYTES == 16 * 2**20


def test_a_public_address_warns_and_max_body_mb_converts_to_bytes(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys
    import time

    from benchmarks.server_startup import free_port

    port = free_port()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("LIGHTNING_SQL_TOKEN", None)
    args = ["--url", f"sqlite:///{tmp_path / 'w.db'}", "--host", "0.0.0.0", "--port", str(port), "--max-body-mb", "0.001"]
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_sql.server", *args, "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        big = httpx.post(f"http://127.0.0.1:{port}{ENQUEUE}", json={"rollouts": [{"input": "x" * 2000}]}, timeout=10)
        assert big.status_code == 413 and f"{int(0.001 * 2**20)} bytes" in big.json()["detail"]
    finally:
        process.terminate()
        _out, err = process.communicate(timeout=30)
    text = err.decode()
    assert "warning" in text and "0.0.0.0 without a token" in text, text
