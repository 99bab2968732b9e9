"""Shared pieces of the fault, load and hostile-input scenarios (tests/faults).

Everything a child process runs lives here (importable by the forkserver), written against the public
store API only: the runner loop is the smallest thing that behaves like a runner (claim, stream spans,
heartbeat with ``touch_attempt``, report), so a scenario that kills it proves the store's guarantees
without depending on the runtime package.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time
import traceback
from collections.abc import Sequence
from typing import Any

from lightning_sql import RolloutConfig, SqlLightningStore, StoreUnavailableError
from lightning_sql.checker import check_invariants
from lightning_sql.types import Span
from tests.faults.servers import ThrowawayPostgres

# --- size knobs -------------------------------------------------------------------------------------


def knob(name: str, default: float) -> float:
    """A size knob from the environment (CI keeps the defaults; a full run raises them)."""
    raw = os.environ.get(name)
    return float(raw) if raw else float(default)


def int_knob(name: str, default: int) -> int:
    return int(knob(name, default))


FULL_SIZE = os.environ.get("LIGHTNING_SQL_FAULT_SIZE", "").lower() == "full"


def sized(name: str, ci: float, full: float) -> float:
    """A size knob with two defaults: ``ci`` (small, the default) and ``full`` (the issue's size, under
    LIGHTNING_SQL_FAULT_SIZE=full); the variable ``name`` overrides both."""
    return knob(name, full if FULL_SIZE else ci)


# --- store helpers ----------------------------------------------------------------------------------


def make_span(rollout_id: str, attempt_id: str, sequence_id: int, name: str = "step", **attrs: Any) -> Span:
    return Span.from_attributes(
        attributes={"step": sequence_id, **attrs},
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        name=name,
        start_time=time.time(),
        end_time=time.time(),
    )


async def assert_consistent(store: SqlLightningStore, *, lifecycle: bool = True, when: str = "") -> None:
    """Run the invariant checker on the store's run and fail with every violation it reports."""
    violations = await check_invariants(store, lifecycle=lifecycle)
    assert violations == [], f"invariants violated{(' ' + when) if when else ''}:\n" + "\n".join(violations)


def mp_context() -> Any:
    """A forkserver context: children fork from a clean, single-threaded server with the store preloaded.

    Cheaper than spawn (no interpreter start per child) and safer than forking the pytest process,
    whose store I/O threads would be copied mid-flight.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["lightning_sql", "tests.faults.support"])
    return ctx


LEASE_CONFIG_KW = {"max_attempts": 5, "retry_condition": ["unresponsive", "timeout"]}


def lease_config(unresponsive_seconds: float) -> RolloutConfig:
    return RolloutConfig(unresponsive_seconds=unresponsive_seconds, **LEASE_CONFIG_KW)  # type: ignore[arg-type]


# --- child: a minimal runner ------------------------------------------------------------------------


def runner_main(store: SqlLightningStore, worker_id: str, steps: int, step_s: float, errors: Any) -> None:
    """Claim rollouts until the run has no unfinished rollout; each attempt streams ``steps`` spans."""
    try:
        asyncio.run(_runner(store, worker_id, steps, step_s))
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"{worker_id}: {traceback.format_exc()}")
        raise


async def _runner(store: SqlLightningStore, worker_id: str, steps: int, step_s: float) -> None:
    while True:
        claimed = await store.dequeue_rollout(worker_id=worker_id)
        if claimed is None:
            unfinished = await store.query_rollouts(
                status_in=["queuing", "requeuing", "preparing", "running"], limit=0
            )
            if unfinished.total == 0:
                break
            await asyncio.sleep(0.05)
            continue
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
        lost = False
        for step in range(1, steps + 1):
            await store.add_span(make_span(rid, aid, step, worker=worker_id))
            attempt = await store.touch_attempt(rid, aid)
            if attempt.status in ("unresponsive", "timeout"):
                lost = True  # our lease expired: someone else owns the rollout now; abandon it
                break
            await asyncio.sleep(step_s)
        if not lost:
            await store.update_attempt(rid, aid, status="succeeded")
    await store.close()


# --- child: random operations for the kill-at-random-points scenario ----------------------------


def chaos_main(store: SqlLightningStore, seed: int, ready: Any) -> None:
    """Loop forever over every kind of write (until SIGKILLed); sets ``ready`` after the first round."""
    asyncio.run(_chaos(store, seed, ready))


async def _chaos(store: SqlLightningStore, seed: int, ready: Any) -> None:
    rng = random.Random(seed)
    worker_id = f"chaos-{seed % 3}"
    lease = lease_config(0.5)
    held: list[tuple[str, str]] = []
    first = True
    while True:
        op = rng.random()
        if op < 0.15 or first:
            await store.enqueue_many_rollouts(
                [{"input": {"n": rng.randrange(1000)}, "config": lease} for _ in range(rng.randrange(1, 6))]
            )
        if op < 0.45 or first:
            many = await store.dequeue_many_rollouts(limit=rng.randrange(1, 4), worker_id=worker_id)
            held.extend((c.rollout_id, c.attempt.attempt_id) for c in many)
        if held:
            rid, aid = held[rng.randrange(len(held))]
            choice = rng.random()
            if choice < 0.4:
                base = rng.randrange(1, 50)
                await store.add_many_spans([make_span(rid, aid, base + k) for k in range(rng.randrange(1, 8))])
            elif choice < 0.5:
                await store.get_many_span_sequence_ids([(rid, aid)] * rng.randrange(1, 4))
            elif choice < 0.6:
                await store.touch_attempt(rid, aid)
            elif choice < 0.85:
                status = rng.choice(["succeeded", "failed", "running", "unresponsive"])
                await store.update_attempt(rid, aid, status=status, metadata={"by": worker_id})
                if status in ("succeeded", "failed"):
                    held.remove((rid, aid))
            elif choice < 0.9:
                await store.start_attempt(rid, worker_id=worker_id)
                held.remove((rid, aid))
            elif choice < 0.93:
                # The lifecycle's cancel (it ends the attempt in flight in the same unit), so the
                # checker's lifecycle family, "a cancelled rollout has no attempt in flight"
                # included, holds after a kill anywhere in it.
                await store.cancel_rollout(rid)
                held.remove((rid, aid))
            else:
                await store.update_rollout(rid, metadata={"touched": rng.random()})
        if rng.random() < 0.1:
            await store.update_resources(f"res-{rng.randrange(3)}", {})
        if rng.random() < 0.1:
            await store.update_worker(worker_id, heartbeat_stats={"held": len(held)})
        if rng.random() < 0.05:
            await store.sweep()
        if first:
            ready.set()
            first = False


# --- child: SQLite under pressure -----------------------------------------------------------------


def pressure_main(store: SqlLightningStore, worker_id: str, seconds: float, results: Any) -> None:
    """Write as fast as possible for ``seconds``; put (ops, errors) on ``results``."""
    ops, errors = asyncio.run(_pressure(store, worker_id, seconds))
    results.put((worker_id, ops, errors))


async def _pressure(store: SqlLightningStore, worker_id: str, seconds: float) -> tuple[int, list[str]]:
    ops = 0
    errors: list[str] = []
    deadline = time.monotonic() + seconds
    rng = random.Random(worker_id)

    async def guarded(coro: Any) -> Any:
        nonlocal ops
        try:
            result = await coro
        except Exception as exc:  # noqa: BLE001 - every error is a finding here
            errors.append(f"{type(exc).__name__}: {exc}")
            return None
        ops += 1
        return result

    while time.monotonic() < deadline:
        await guarded(store.enqueue_many_rollouts([{"input": {"w": worker_id}} for _ in range(4)]))
        for _ in range(4):
            claimed = await guarded(store.dequeue_rollout(worker_id=worker_id))
            if claimed is None:
                continue
            rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
            await guarded(store.add_many_spans([make_span(rid, aid, k) for k in range(1, 4)]))
            await guarded(store.touch_attempt(rid, aid))
            await guarded(store.update_attempt(rid, aid, status=rng.choice(["succeeded", "failed"])))
        await guarded(store.update_worker(worker_id, heartbeat_stats={"ops": ops}))
    await store.close()
    return ops, errors


# --- PostgreSQL backends ---------------------------------------------------------------------------


async def terminate_backends(url: str, *, every_other: bool = False) -> int:
    """``pg_terminate_backend`` the client backends of the database (all, or every other one)."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        pids: Sequence[int] = [
            r["pid"]
            for r in await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                "AND backend_type = 'client backend' ORDER BY pid"
            )
        ]
        victims = pids[::2] if every_other else pids
        for pid in victims:
            await conn.execute("SELECT pg_terminate_backend($1)", pid)
        return len(victims)
    finally:
        await conn.close()


__all__ = [
    "StoreUnavailableError",
    "ThrowawayPostgres",
    "assert_consistent",
    "chaos_main",
    "int_knob",
    "knob",
    "lease_config",
    "make_span",
    "mp_context",
    "pressure_main",
    "runner_main",
    "sized",
    "terminate_backends",
]
