"""Dashboard page speed on a big store: seeds one run with bulk INSERTs, then times every page.

    python -m benchmarks.dashboard --rollouts 100000 --spans-per-rollout 10 --backend both

For each page it prints the median over ``--repeat`` requests of the time spent in the database
(statements timed with SQLAlchemy's cursor events, summed per request) and of the whole request
(queries plus rendering), after one warm-up request.  The dashboard's target is < 300 ms of queries
per page at 100,000 rollouts and 1,000,000 spans.  The default size is small so CI can run it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
from sqlalchemy import event, insert, select, text
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette

from lightning_sql import SqlLightningStore
from lightning_sql.server.dashboard import Dashboard
from lightning_sql.store.sql.schema import (
    attempts,
    resource_versions,
    resources,
    rollouts,
    runs,
    spans,
    workers,
)
from lightning_sql.store.sql.urls import normalise_url

PG_URL = os.environ.get("LIGHTNING_SQL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RUN = "dashboard-bench"
CHUNK = 5000
VERSIONS = 10
T0 = 1_800_000_000.0
STATUSES = ("succeeded",) * 16 + ("failed", "failed", "running", "queuing")
ERRORS = ("ValueError", "TimeoutError", "KeyError")


def _hex(rng: random.Random, n: int) -> str:
    return f"{rng.getrandbits(n * 4):0{n}x}"


def _rows(run_id: int, n_rollouts: int, spans_per_rollout: int) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(table name, rows) chunks for one run: rollouts, attempts and spans, deterministic (seed 7)."""
    rng = random.Random(7)
    ro_rows: list[dict[str, Any]] = []
    at_rows: list[dict[str, Any]] = []
    sp_rows: list[dict[str, Any]] = []
    for i in range(n_rollouts):
        rid = f"ro-{i:012x}"
        aid = f"at-{i:08x}"
        status = STATUSES[rng.randrange(len(STATUSES))]
        start = T0 + i * 0.5
        end = start + rng.uniform(1, 20) if status in ("succeeded", "failed") else None
        version = 1 + i * VERSIONS // n_rollouts
        queued = status == "queuing"
        ro_rows.append({
            "run_id": run_id, "rollout_id": rid, "input": {"question": f"question {i}", "id": i},
            "mode": "train" if i % 5 else "val", "resources_id": "rs-bench", "resources_version": version,
            "status": status, "timeout_seconds": None, "unresponsive_seconds": None, "max_attempts": 1,
            "retry_condition": [], "metadata": None, "idempotency_key": None, "start_time": start, "end_time": end,
            "queue_seq": i + 1 if queued else None, "span_seq": 0 if queued else spans_per_rollout,
            "create_seq": i + 1, "attempt_count": 0 if queued else 1,
        })
        if not queued:
            error = None
            if status == "failed":
                kind = ERRORS[i % len(ERRORS)]
                error = {"error": {"type": kind, "message": f"{kind} in step {i % 7}", "traceback": "Traceback ..."}}
            at_rows.append({
                "run_id": run_id, "rollout_id": rid, "attempt_id": aid, "sequence_id": 1,
                "status": status if status != "queuing" else "running", "worker_id": f"Worker-{i % 16}",
                "start_time": start + 0.1, "end_time": end, "last_heartbeat_time": end or start + 1,
                "metadata": error,
            })
            trace = _hex(rng, 32)
            root = _hex(rng, 16)
            for s in range(spans_per_rollout):
                sid = root if s == 0 else _hex(rng, 16)
                if s == spans_per_rollout - 1 and status == "succeeded":
                    name = "agentlightning.annotation"
                    attrs: dict[str, Any] = {"agentlightning.reward.0.value": rng.random() * version / VERSIONS}
                elif s == 0:
                    name, attrs = "agent.run", {"agent.name": "bench"}
                else:
                    name = "openai.chat.completion"
                    attrs = {"gen_ai.request.model": "bench-model", "gen_ai.usage.prompt_tokens": rng.randint(10, 900),
                             "gen_ai.usage.completion_tokens": rng.randint(1, 200),
                             "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "x" * rng.randint(20, 200)}
                t = start + 0.2 + s * 0.1
                sp_rows.append({
                    "run_id": run_id, "rollout_id": rid, "attempt_id": aid, "sequence_id": s + 1, "trace_id": trace,
                    "span_id": sid, "parent_id": None if s == 0 else root, "name": name, "status_code": "OK",
                    "start_time": t, "end_time": t + 0.05, "attributes": attrs, "events": [], "links": [],
                    "resource": {"attributes": {}, "schema_url": ""}, "extra": None,
                })
        if len(sp_rows) >= CHUNK or len(ro_rows) >= CHUNK:
            yield "rollouts", ro_rows
            yield "attempts", at_rows
            yield "spans", sp_rows
            ro_rows, at_rows, sp_rows = [], [], []
    yield "rollouts", ro_rows
    yield "attempts", at_rows
    yield "spans", sp_rows


async def seed(url: str, schema: str | None, n_rollouts: int, spans_per_rollout: int) -> None:
    """Create the store (migrations, the run) through the store, then bulk-insert the run's rows."""
    store = SqlLightningStore(url, run=RUN, **({"schema": schema} if schema else {}))
    await store.add_resources({})
    await store.close()
    target = normalise_url(url)
    engine_url = target.url if target.dialect == "postgresql" else target.url.set(drivername="sqlite+aiosqlite")
    options = {"schema_translate_map": {None: schema}} if schema else {}
    engine = create_async_engine(engine_url, execution_options=options)
    tables = {"rollouts": rollouts, "attempts": attempts, "spans": spans}
    try:
        async with engine.begin() as conn:
            run_id = (await conn.execute(select(runs.c.run_id).where(runs.c.name == RUN))).scalar_one()
            await conn.execute(resources.delete().where(resources.c.run_id == run_id))
            await conn.execute(resource_versions.delete().where(resource_versions.c.run_id == run_id))
            await conn.execute(insert(resources), [{
                "run_id": run_id, "resources_id": "rs-bench", "version": VERSIONS, "create_time": T0,
                "update_time": T0, "resources": _resource(VERSIONS), "create_seq": 1, "touch_seq": 1}])
            await conn.execute(insert(resource_versions), [
                {"run_id": run_id, "resources_id": "rs-bench", "version": v, "resources": _resource(v), "time": T0 + v}
                for v in range(1, VERSIONS + 1)])
            await conn.execute(insert(workers), [
                {"run_id": run_id, "worker_id": f"Worker-{w}", "status": "busy", "last_heartbeat_time": T0 + n_rollouts / 2,
                 "current_rollout_id": f"ro-{n_rollouts - 1 - w:012x}", "create_seq": w + 1} for w in range(16)])
        for name, rows in _rows(run_id, n_rollouts, spans_per_rollout):
            if rows:
                async with engine.begin() as conn:
                    await conn.execute(insert(tables[name]), rows)
        # What autovacuum does to a live store after a bulk load: statistics, and the visibility map
        # that lets PostgreSQL count through an index alone.
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            if target.dialect == "postgresql":
                for table in (runs, rollouts, attempts, spans, workers, resources, resource_versions):
                    await conn.execute(text(f'VACUUM ANALYZE "{schema}"."{table.name}"'))
            else:
                await conn.execute(text("ANALYZE"))
    finally:
        await engine.dispose()


def _resource(version: int) -> dict[str, Any]:
    return {"prompt": {"resource_type": "prompt_template", "engine": "f-string",
                       "template": f"You are a careful assistant (revision {version}).\nAnswer: {{question}}"}}


async def measure(url: str, schema: str | None, n_rollouts: int, repeat: int) -> list[tuple[str, float, float]]:
    dashboard = Dashboard(url, schema=schema, clock=lambda: T0 + n_rollouts / 2 + 30)
    spent: list[float] = []

    def before(conn: Any, cursor: Any, statement: Any, parameters: Any, context: Any, executemany: bool) -> None:
        conn.info["t"] = time.perf_counter()

    def after(conn: Any, cursor: Any, statement: Any, parameters: Any, context: Any, executemany: bool) -> None:
        spent.append(time.perf_counter() - conn.info.pop("t"))

    sync_engine = dashboard.db.engine.sync_engine
    event.listen(sync_engine, "before_cursor_execute", before)
    event.listen(sync_engine, "after_cursor_execute", after)
    app = Starlette(routes=dashboard.routes)
    run_id = None
    results = []
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
            home = await client.get("/")
            home.raise_for_status()
            async with dashboard.db.engine.connect() as conn:
                run_id = (await conn.execute(select(runs.c.run_id).where(runs.c.name == RUN))).scalar_one()
                span_pk, last = (await conn.execute(select(spans.c.id, spans.c.rollout_id).where(
                    spans.c.run_id == run_id).order_by(spans.c.id.desc()).limit(1))).one()
            pages = {
                "runs": "/",
                "run": f"/runs/{run_id}",
                "rollouts": f"/runs/{run_id}/rollouts",
                "rollouts status=failed": f"/runs/{run_id}/rollouts?status=failed",
                "rollouts mode+version": f"/runs/{run_id}/rollouts?mode=val&version=3",
                "rollouts text": f"/runs/{run_id}/rollouts?q=question+4242",
                "rollouts sort=end page 200": f"/runs/{run_id}/rollouts?sort=end&order=asc&page=200",
                "rollouts sort=status": f"/runs/{run_id}/rollouts?sort=status",
                "rollouts sort=attempts": f"/runs/{run_id}/rollouts?sort=attempts&order=asc",
                "rollout": f"/runs/{run_id}/rollouts/{last}",
                "span": f"/runs/{run_id}/spans/{span_pk}",
                "resources + diff": f"/runs/{run_id}/resources?id=rs-bench&a=3&b=7",
            }
            for label, path in pages.items():
                db_times, wall_times = [], []
                for i in range(repeat + 1):
                    spent.clear()
                    t = time.perf_counter()
                    response = await client.get(path)
                    wall = time.perf_counter() - t
                    if response.status_code != 200:
                        raise RuntimeError(f"{label}: HTTP {response.status_code}\n{response.text[:500]}")
                    if i:
                        db_times.append(sum(spent))
                        wall_times.append(wall)
                results.append((label, statistics.median(db_times) * 1000, statistics.median(wall_times) * 1000))
    finally:
        await dashboard.shutdown()
    return results


async def run_backend(
    backend: str, n_rollouts: int, spans_per_rollout: int, repeat: int, workdir: str, keep: bool
) -> None:
    """Seed (unless ``keep`` finds the store of an earlier ``--keep`` run) and measure."""
    schema = None
    if backend == "sqlite":
        path = os.path.join(workdir, f"dashboard-bench-{n_rollouts}x{spans_per_rollout}.db")
        url = f"sqlite:///{path}"
        reuse = keep and os.path.exists(path)
    else:
        schema = f"dashboard_bench_{n_rollouts}x{spans_per_rollout}" if keep else f"bench_{uuid.uuid4().hex[:10]}"
        url = PG_URL
        reuse = keep and await _schema_exists(schema)
    if reuse:
        print(f"\n{backend}: reusing the store seeded earlier ({n_rollouts} rollouts x {spans_per_rollout} spans)")
    else:
        t = time.perf_counter()
        await seed(url, schema, n_rollouts, spans_per_rollout)
        print(f"\n{backend}: seeded {n_rollouts} rollouts x {spans_per_rollout} spans in {time.perf_counter() - t:.1f} s")
    try:
        results = await measure(url, schema, n_rollouts, repeat)
    finally:
        if schema and not keep:
            engine = create_async_engine(normalise_url(url).url)
            async with engine.begin() as conn:
                await conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            await engine.dispose()
    print(f"{'page':<30}{'queries ms':>12}{'request ms':>12}")
    for label, db_ms, wall_ms in results:
        print(f"{label:<30}{db_ms:>12.1f}{wall_ms:>12.1f}")


async def _schema_exists(schema: str) -> bool:
    engine = create_async_engine(normalise_url(PG_URL).url)
    try:
        async with engine.connect() as conn:
            found = await conn.execute(
                text("SELECT 1 FROM information_schema.schemata WHERE schema_name = :s"), {"s": schema}
            )
            return found.first() is not None
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--spans-per-rollout", type=int, default=10)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="sqlite")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="keep the seeded stores (SQLite file in DIR, PostgreSQL schema dashboard_bench_<size>) and reuse them",
    )
    args = parser.parse_args(argv)
    backends = ("sqlite", "postgres") if args.backend == "both" else (args.backend,)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or tmp
        for backend in backends:
            asyncio.run(
                run_backend(backend, args.rollouts, args.spans_per_rollout, args.repeat, workdir, args.keep is not None)
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
