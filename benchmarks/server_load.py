"""Many Agent-Lightning clients against one ``lightning-sql serve``: errors by kind, call latency, leases.

Spawns ``python -m lightning_sql.server`` on the database, enqueues rollouts with a lease
(``unresponsive_seconds``), and runs ``--clients`` Agent-Lightning ``LightningStoreClient``s at once
in this process, each a runner: claim a rollout, send its span, finish its attempt, until the queue
is empty or ``--seconds`` pass.  Prints p50/p99 per call and errors by exception type, and checks that
no lease expired while its client was alive (no attempt became ``unresponsive`` or ``timeout``).

    python -m benchmarks.server_load --url sqlite:///load.db --clients 512 --rollouts 2048
    python -m benchmarks.server_load --url postgresql://postgres@127.0.0.1/postgres --clients 512

Bounded: every client stops at the deadline, and the server is stopped afterwards.  Nothing is asserted
here; ``tests/server/test_load.py`` runs it at a small size and checks the mechanism.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from benchmarks.server_startup import GIVE_UP_S, free_port

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # agentlightning imports offline

LEASE_S = 30.0


@dataclass
class LoadResult:
    clients: int
    rollouts: int
    finished: int
    seconds: float
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    expired: int = 0

    def percentile(self, call: str, q: float) -> float:
        values = sorted(self.latencies.get(call, []))
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    def report(self) -> str:
        lines = [
            f"{self.clients} clients, {self.finished}/{self.rollouts} rollouts in {self.seconds:.1f} s; "
            f"expired leases: {self.expired}; errors: {dict(self.errors) or 'none'}"
        ]
        for call, values in sorted(self.latencies.items()):
            lines.append(
                f"  {call:<14} n={len(values):<6} p50 {self.percentile(call, 0.5) * 1000:8.1f} ms   "
                f"p99 {self.percentile(call, 0.99) * 1000:8.1f} ms   mean {statistics.fmean(values) * 1000:8.1f} ms"
            )
        return "\n".join(lines)


def _spawn(url: str, run: str, schema: str | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = [sys.executable, "-m", "lightning_sql.server", "--url", url, "--run", run, "--port", str(port), "--log-level", "warning"]
    if schema:
        args += ["--schema", schema]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=1) as answer:
                if answer.status == 200:
                    return process, base
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() - began > GIVE_UP_S:
            process.kill()
            raise RuntimeError(f"the server did not start: {process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        time.sleep(0.05)


async def _client(base: str, index: int, deadline: float, result: LoadResult) -> None:
    from agentlightning.store.client_server import LightningStoreClient
    from agentlightning.types import OtelResource, Span, TraceStatus

    client = LightningStoreClient(base, retry_delays=(0.5, 1.0), health_retry_delays=(0.5,))
    worker = f"load-{index}"

    async def timed(call: str, coro: Any) -> Any:
        started = time.perf_counter()
        try:
            return await coro
        except Exception as exc:  # noqa: BLE001 - counted by kind, the client goes on
            result.errors[type(exc).__name__] += 1
            return None
        finally:
            result.latencies.setdefault(call, []).append(time.perf_counter() - started)

    try:
        while time.monotonic() < deadline:
            claimed = await timed("dequeue", client.dequeue_rollout(worker_id=worker))
            if claimed is None:
                if not result.errors:
                    return  # the queue is empty
                await asyncio.sleep(0.05)
                continue
            attempt_id = claimed.attempt.attempt_id
            span = Span(
                rollout_id=claimed.rollout_id, attempt_id=attempt_id, sequence_id=1, trace_id=uuid.uuid4().hex,
                span_id=uuid.uuid4().hex[:16], parent_id=None, name="load", status=TraceStatus(status_code="OK"),
                attributes={"worker": worker}, events=[], links=[], start_time=time.time(), end_time=time.time(),
                context=None, parent=None, resource=OtelResource(attributes={}, schema_url=""),
            )  # fmt: skip
            await timed("add_span", client.add_span(span))
            await timed("update_attempt", client.update_attempt(claimed.rollout_id, attempt_id, status="succeeded"))
            result.finished += 1
    finally:
        await client.close()


async def _run(url: str, clients: int, rollouts: int, seconds: float, schema: str | None) -> LoadResult:
    from lightning_sql import RolloutConfig, SqlLightningStore
    from lightning_sql.types import EnqueueRolloutRequest

    run = f"load-{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {"run": run}
    if schema:
        options["schema"] = schema
    store = SqlLightningStore(url, **options)
    lease = RolloutConfig(unresponsive_seconds=LEASE_S, max_attempts=3, retry_condition=["unresponsive"])
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}, config=lease) for i in range(rollouts)])
    process, base = await asyncio.to_thread(_spawn, url, run, schema)
    result = LoadResult(clients=clients, rollouts=rollouts, finished=0, seconds=0.0)
    try:
        began = time.monotonic()
        deadline = began + seconds
        await asyncio.gather(*(_client(base, i, deadline, result) for i in range(clients)))
        result.seconds = time.monotonic() - began
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)
    await store.sweep()  # a lease that ran out while its client was alive shows now
    for rollout in await store.query_rollouts():
        for attempt in await store.query_attempts(rollout.rollout_id):
            result.expired += attempt.status in ("unresponsive", "timeout")
    await store.delete_run(run)
    await store.close()
    return result


def run_load(url: str, clients: int, rollouts: int, seconds: float, schema: str | None = None) -> LoadResult:
    return asyncio.run(_run(url, clients, rollouts, seconds, schema))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--schema")
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--rollouts", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=120.0, help="every client stops by then")
    args = parser.parse_args(argv)
    print(run_load(args.url, args.clients, args.rollouts, args.seconds, args.schema).report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
