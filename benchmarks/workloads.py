"""Workloads W1-W8 of docs/performance.md, written once against the public ``LightningStore`` API.

Every workload function takes an opened :class:`~benchmarks.targets.Target` and a :class:`Size` and
returns a :class:`Measurement`: its figures (the first one is the headline throughput) and the
correctness problems it found (an empty list when the store did the right thing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import multiprocessing
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from benchmarks import p0
from benchmarks.payload import SpanFactory
from benchmarks.targets import Target, close_store, open_remote, open_target

ENQUEUE_CHUNK = 2000  # rollouts per enqueue_many_rollouts call when a workload only sets up a queue


@dataclass(frozen=True)
class Size:
    """The knobs of one benchmark size."""

    lifecycle_n: int
    lifecycle_runners: tuple[int, ...]
    spans_per_rollout: int
    b2_lifecycle_n: int  # B2 runs ~30 rollouts/s: a smaller N keeps it in the time budget
    enqueue_many_n: int
    enqueue_single_n: int
    dequeue_n: int
    dequeue_claimers: tuple[int, ...]
    ingest_spans: int
    readback_rollouts: int
    query_rollouts_n: int
    query_rollouts_repeats: int
    scaleout_n: int
    b2_scaleout_n: int
    scaleout_processes: tuple[int, ...]
    memory_n: tuple[int, int]
    trace_spans: int = 10_000  # W6's long trace, read a page at a time
    trace_pages: int = 100
    heavy: bool = False


SIZES = {
    "full": Size(
        lifecycle_n=2000,
        lifecycle_runners=(8, 32),
        spans_per_rollout=10,
        b2_lifecycle_n=200,
        enqueue_many_n=10_000,
        enqueue_single_n=2000,
        dequeue_n=20_000,
        dequeue_claimers=(8, 32, 128),
        ingest_spans=10_000,
        readback_rollouts=2000,
        query_rollouts_n=20_000,
        query_rollouts_repeats=50,
        scaleout_n=2000,
        b2_scaleout_n=300,
        scaleout_processes=(1, 2, 4),
        memory_n=(1000, 100_000),
    ),
    # CI runs every workload at this size with no thresholds: it proves the code paths, not speed.
    "small": Size(
        lifecycle_n=40,
        lifecycle_runners=(8, 32),
        spans_per_rollout=10,
        b2_lifecycle_n=10,
        enqueue_many_n=500,
        enqueue_single_n=100,
        dequeue_n=300,
        dequeue_claimers=(8, 32, 128),
        ingest_spans=400,
        readback_rollouts=50,
        query_rollouts_n=500,
        query_rollouts_repeats=5,
        scaleout_n=40,
        b2_scaleout_n=10,
        # The goal's case only: each runner process imports its store (B2's: Agent-Lightning,
        # ~20 s on a 2-vCPU machine), which is most of this size's time.
        scaleout_processes=(4,),
        memory_n=(50, 500),
        trace_spans=300,
        trace_pages=10,
    ),
}


# Knobs that count work (scaled by ``--scale``); the others (runners, processes) are settings.
_COUNT_FIELDS = (
    "lifecycle_n",
    "b2_lifecycle_n",
    "enqueue_many_n",
    "enqueue_single_n",
    "dequeue_n",
    "ingest_spans",
    "readback_rollouts",
    "query_rollouts_n",
    "query_rollouts_repeats",
    "scaleout_n",
    "b2_scaleout_n",
    "trace_spans",
    "trace_pages",
)


def scaled(size: Size, factor: float) -> Size:
    """``size`` with every work count multiplied by ``factor`` (at least 1; W8's sizes too)."""
    if factor == 1:
        return size
    changes: dict[str, Any] = {name: max(1, round(getattr(size, name) * factor)) for name in _COUNT_FIELDS}
    changes["memory_n"] = tuple(max(1, round(n * factor)) for n in size.memory_n)
    return dataclasses.replace(size, **changes)


@dataclass
class Measurement:
    metrics: dict[str, float]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --- helpers ----------------------------------------------------------------------------------


class RssSampler:
    """Peak resident set size of this process while the block runs (sampled every 10 ms)."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


class CollectorTime:
    """Time this process spends in the garbage collector while the block runs (``gc.callbacks``),
    young collections (generations 0 and 1) and full ones apart, in seconds.  A store's objects in
    flight are what its young collections walk, so a store that keeps many of them alive pays here."""

    def __init__(self) -> None:
        self.young = 0.0
        self.full = 0.0
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            elapsed, self._started = time.perf_counter() - self._started, None
            if info["generation"] == 2:
                self.full += elapsed
            else:
                self.young += elapsed

    def __enter__(self) -> CollectorTime:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def fill_queue(target: Target, n: int, prefix: str = "task") -> list[str]:
    ids: list[str] = []
    for start in range(0, n, ENQUEUE_CHUNK):
        requests = [
            target.request_cls(input={"task": f"{prefix}-{i}"}) for i in range(start, min(n, start + ENQUEUE_CHUNK))
        ]
        ids.extend(r.rollout_id for r in await target.store.enqueue_many_rollouts(requests))
    return ids


def check_claims(claimed: list[str], expected: int, what: str) -> list[str]:
    problems = []
    duplicates = len(claimed) - len(set(claimed))
    if duplicates:
        problems.append(f"{what}: {duplicates} rollouts claimed more than once")
    if len(set(claimed)) != expected:
        problems.append(f"{what}: {len(set(claimed))} distinct rollouts claimed, expected {expected}")
    return problems


def check_span_order(spans: Any, expected: int, rollout_id: str) -> str | None:
    return check_sequence_ids([sp.sequence_id for sp in spans], expected, rollout_id)


def check_sequence_ids(seqs: list[int], expected: int, rollout_id: str) -> str | None:
    if len(seqs) != expected:
        return f"query_spans({rollout_id}) returned {len(seqs)} spans, expected {expected}"
    if seqs != sorted(seqs):
        return f"query_spans({rollout_id}) is not in sequence_id order: {seqs}"
    return None


async def check_all_succeeded(store: Any, expected_ids: list[str]) -> list[str]:
    """Every expected rollout succeeded."""
    by_id = {r.rollout_id: r.status for r in await store.query_rollouts()}
    bad = [rid for rid in expected_ids if by_id.get(rid) != "succeeded"]
    if bad:
        sample = {rid: by_id.get(rid) for rid in bad[:5]}
        return [f"{len(bad)} of {len(expected_ids)} rollouts did not succeed (e.g. {sample})"]
    return []


# --- W1 / W2: lifecycle -----------------------------------------------------------------------


async def runner_loop(
    store: Any, factory: SpanFactory, worker_id: str, spans_per_rollout: int, batch: bool, claimed: Any
) -> int:
    """One runner: claim, reserve sequence ids, write spans, finish; until the queue is empty.
    Each claimed rollout id is appended to ``claimed`` (a list, or W8's ``_ClaimCount``)."""
    done = 0
    while True:
        ar = await store.dequeue_rollout(worker_id=worker_id)
        if ar is None:
            return done
        rid, aid = ar.rollout_id, ar.attempt.attempt_id
        claimed.append(rid)
        seqs = await store.get_many_span_sequence_ids([(rid, aid)] * spans_per_rollout)
        spans = [factory.make(rid, aid, seq) for seq in seqs]
        if batch:
            await store.add_many_spans(spans)
        else:
            for span in spans:
                await store.add_span(span)
        await store.update_attempt(rid, aid, status="succeeded")
        done += 1


async def lifecycle(
    target: Target,
    size: Size,
    *,
    runners: int,
    batch: bool,
    n: int | None = None,
    lean: bool = False,
    page: int = ENQUEUE_CHUNK,
) -> Measurement:
    """W1 (batch) / W2 (single spans): enqueue, R runners until empty, then read every rollout back.

    ``lean`` (W8) keeps the harness's own memory flat in N (``_lean_lifecycle``, in chunks of ``page``).
    """
    if lean:
        return await _lean_lifecycle(target, size, runners=runners, batch=batch, n=n or size.lifecycle_n, page=page)
    store = target.store
    if n is None:
        n = size.b2_lifecycle_n if target.name == "B2" else size.lifecycle_n
    s = size.spans_per_rollout
    factory = SpanFactory(target.span_cls, size.heavy)
    claimed: list[str] = []
    problems: list[str] = []
    started = time.perf_counter()
    requests = [target.request_cls(input={"task": i}) for i in range(n)]
    ids = [r.rollout_id for r in await store.enqueue_many_rollouts(requests)]
    await asyncio.gather(*(runner_loop(store, factory, f"runner-{i}", s, batch, claimed) for i in range(runners)))
    for rid in ids:
        spans = await store.query_spans(rid, "latest")
        problem = check_span_order(spans, s, rid)
        if problem and len(problems) < 5:
            problems.append(problem)
    elapsed = time.perf_counter() - started
    problems += check_claims(claimed, n, "lifecycle")
    problems += await check_all_succeeded(store, ids)
    return Measurement({"rollouts/s": n / elapsed, "spans/s": n * s / elapsed}, problems, [f"N={n}"])


class _ClaimCount:
    """Stands in for the list of claimed ids where the harness must not hold N ids (W8)."""

    def __init__(self) -> None:
        self.count = 0

    def append(self, _rollout_id: str) -> None:
        self.count += 1


async def _lean_lifecycle(
    target: Target, size: Size, *, runners: int, batch: bool, n: int, page: int
) -> Measurement:
    """W1 with the harness's memory independent of N, so that W8 measures the store: the queue is
    filled in chunks of ``page`` rollouts, runners count their claims instead of listing them, and
    the read-back walks the rollouts in pages of ``page``. The checks are the same in substance:
    claims add up to N and every rollout succeeded with exactly ONE attempt (a rollout claimed twice
    would have two, or leave another unclaimed), with its spans in order."""
    store = target.store
    s = size.spans_per_rollout
    factory = SpanFactory(target.span_cls, size.heavy)
    claims = _ClaimCount()
    problems: list[str] = []
    started = time.perf_counter()
    for start in range(0, n, page):
        count = min(n, start + page) - start
        await store.enqueue_many_rollouts([target.request_cls(input={"task": start + i}) for i in range(count)])
    await asyncio.gather(*(runner_loop(store, factory, f"runner-{i}", s, batch, claims) for i in range(runners)))
    seen = bad = 0
    offset = 0
    while True:
        rollouts = await store.query_rollouts(limit=page, offset=offset)
        for rollout in rollouts:
            seen += 1
            attempt = getattr(rollout, "attempt", None) or await store.get_latest_attempt(rollout.rollout_id)
            if rollout.status != "succeeded" or attempt is None or attempt.sequence_id != 1:
                bad += 1
                if len(problems) < 5:
                    problems.append(
                        f"rollout {rollout.rollout_id}: status {rollout.status}, "
                        f"attempts {None if attempt is None else attempt.sequence_id} (expected succeeded, 1)"
                    )
            spans = await store.query_spans(rollout.rollout_id, "latest")
            problem = check_span_order(spans, s, rollout.rollout_id)
            if problem and len(problems) < 5:
                problems.append(problem)
        if len(rollouts) < page:
            break
        offset += page
    elapsed = time.perf_counter() - started
    if claims.count != n or seen != n:
        problems.append(f"lean lifecycle: {claims.count} claims and {seen} rollouts, expected {n} of each")
    if bad:
        problems.append(f"lean lifecycle: {bad} of {n} rollouts not succeeded with exactly one attempt")
    return Measurement({"rollouts/s": n / elapsed, "spans/s": n * s / elapsed}, problems, [f"N={n}"])


# --- W3: enqueue ------------------------------------------------------------------------------


async def enqueue_many(target: Target, size: Size) -> Measurement:
    n = size.enqueue_many_n
    requests = [target.request_cls(input={"task": i}) for i in range(n)]
    started = time.perf_counter()
    result = await target.store.enqueue_many_rollouts(requests)
    elapsed = time.perf_counter() - started
    return Measurement({"rollouts/s": n / elapsed}, await _check_queued(target, [r.rollout_id for r in result]))


async def enqueue_single(target: Target, size: Size) -> Measurement:
    n = size.enqueue_single_n
    ids = []
    started = time.perf_counter()
    for i in range(n):
        ids.append((await target.store.enqueue_rollout(input={"task": i})).rollout_id)
    elapsed = time.perf_counter() - started
    return Measurement({"rollouts/s": n / elapsed}, await _check_queued(target, ids))


async def _check_queued(target: Target, ids: list[str]) -> list[str]:
    rollouts = await target.store.query_rollouts(status_in=["queuing"])
    found = [r.rollout_id for r in rollouts]
    if sorted(found) != sorted(ids) or len(set(ids)) != len(ids):
        return [f"enqueue: {len(found)} queuing rollouts found, {len(set(ids))} distinct ids returned, expected {len(ids)}"]
    return []


# --- W4: dequeue contention -------------------------------------------------------------------


async def dequeue_contention(target: Target, size: Size, *, claimers: int) -> Measurement:
    n = size.dequeue_n
    ids = await fill_queue(target, n)
    store = target.store
    claimed: list[str] = []
    latencies: list[float] = []

    async def claimer(worker_id: str) -> None:
        while True:
            t0 = time.perf_counter()
            ar = await store.dequeue_rollout(worker_id=worker_id)
            if ar is None:
                return
            latencies.append(time.perf_counter() - t0)
            claimed.append(ar.rollout_id)

    started = time.perf_counter()
    await asyncio.gather(*(claimer(f"claimer-{i}") for i in range(claimers)))
    elapsed = time.perf_counter() - started
    problems = check_claims(claimed, len(ids), "dequeue")
    return _claim_measurement(len(claimed), elapsed, latencies, claimed, problems)


def _claim_measurement(count: int, elapsed: float, latencies: list[float], claimed: list[str], problems: list[str]) -> Measurement:
    return Measurement(
        {
            "claims/s": count / elapsed,
            "p50_ms": percentile(latencies, 0.5) * 1000,
            "p99_ms": percentile(latencies, 0.99) * 1000,
            "duplicates": float(len(claimed) - len(set(claimed))),
        },
        problems,
    )


async def p0_claims(target: Target, size: Size) -> Measurement:
    """P0 on the target's own database: the raw driver claiming from a queue the store filled."""
    ids = await fill_queue(target, size.dequeue_n)
    run_id = await p0.run_id_of(target)
    if target.name == "postgres":
        from benchmarks.targets import pg_dsn

        result = await p0.pg_claim_loop(pg_dsn(), target.extra["schema"], run_id)
    else:
        result = await asyncio.to_thread(p0.sqlite_claim_loop, target.extra["path"], run_id)
    claimed = result["claimed"]
    problems = check_claims(claimed, len(ids), "P0 claims")
    return _claim_measurement(len(claimed), result["elapsed"], result["latencies"], claimed, problems)


# --- W5: span ingest --------------------------------------------------------------------------


async def _claimed_attempts(target: Target, count: int) -> list[tuple[str, str]]:
    await fill_queue(target, count)
    claimed = await target.store.dequeue_many_rollouts(limit=count, worker_id="ingest")
    return [(ar.rollout_id, ar.attempt.attempt_id) for ar in claimed]


async def _check_span_total(target: Target, pairs: list[tuple[str, str]], expected: int) -> list[str]:
    total = 0
    problems = []
    for rid, _aid in pairs:
        spans = await target.store.query_spans(rid, "latest")
        total += len(spans)
        problem = check_span_order(spans, len(spans), rid)
        if problem:
            problems.append(problem)
    if total != expected:
        problems.append(f"span ingest: {total} spans stored, expected {expected}")
    return problems


async def ingest_concurrent(target: Target, size: Size, *, writers: int = 8, per_call: int = 10) -> Measurement:
    """8 concurrent writers, each ``add_many_spans`` of 10 spans into its own attempt."""
    pairs = await _claimed_attempts(target, writers)
    factory = SpanFactory(target.span_cls, size.heavy)
    calls_per_writer = max(1, size.ingest_spans // (writers * per_call))

    async def writer(rid: str, aid: str) -> None:
        seq = 0
        for _ in range(calls_per_writer):
            spans = [factory.make(rid, aid, seq + k + 1) for k in range(per_call)]
            seq += per_call
            await target.store.add_many_spans(spans)

    started = time.perf_counter()
    await asyncio.gather(*(writer(rid, aid) for rid, aid in pairs))
    elapsed = time.perf_counter() - started
    total = calls_per_writer * per_call * writers
    return Measurement({"spans/s": total / elapsed}, await _check_span_total(target, pairs, total))


async def ingest_bulk(target: Target, size: Size, *, rollouts: int = 10) -> Measurement:
    """One ``add_many_spans`` call of all the spans (spread over 10 attempts)."""
    pairs = await _claimed_attempts(target, rollouts)
    factory = SpanFactory(target.span_cls, size.heavy)
    per = size.ingest_spans // rollouts
    spans = [factory.make(rid, aid, k + 1) for rid, aid in pairs for k in range(per)]
    started = time.perf_counter()
    await target.store.add_many_spans(spans)
    elapsed = time.perf_counter() - started
    return Measurement({"spans/s": len(spans) / elapsed}, await _check_span_total(target, pairs, len(spans)))


async def ingest_single(target: Target, size: Size, *, rollouts: int = 10) -> Measurement:
    """``add_span`` one span at a time, from one writer."""
    pairs = await _claimed_attempts(target, rollouts)
    factory = SpanFactory(target.span_cls, size.heavy)
    per = size.ingest_spans // rollouts
    spans = [factory.make(rid, aid, k + 1) for rid, aid in pairs for k in range(per)]
    started = time.perf_counter()
    for span in spans:
        await target.store.add_span(span)
    elapsed = time.perf_counter() - started
    return Measurement({"spans/s": len(spans) / elapsed}, await _check_span_total(target, pairs, len(spans)))


# --- W6: readback -----------------------------------------------------------------------------


async def _readback_setup(target: Target, size: Size) -> tuple[list[str], list[str]]:
    """A run of ``size.readback_rollouts`` claimed rollouts with their spans, written through the
    store: the rollout ids, and the problems of the set-up."""
    n, s = size.readback_rollouts, size.spans_per_rollout
    await fill_queue(target, n)
    factory = SpanFactory(target.span_cls, size.heavy)
    ids: list[str] = []
    while True:
        batch = await target.store.dequeue_many_rollouts(limit=100, worker_id="setup")
        if not batch:
            break
        spans = [factory.make(ar.rollout_id, ar.attempt.attempt_id, k + 1) for ar in batch for k in range(s)]
        await target.store.add_many_spans(spans)
        ids.extend(ar.rollout_id for ar in batch)
    problems = [] if len(ids) == n else [f"readback: {len(ids)} rollouts set up, expected {n}"]
    return ids, problems


def _readback_measurement(count: int, spans_each: int, elapsed: float, problems: list[str]) -> Measurement:
    return Measurement({"rollouts/s": count / elapsed, "spans/s": count * spans_each / elapsed}, problems)


async def readback_spans(target: Target, size: Size, *, use_fields: bool = False) -> Measurement:
    """``query_spans(rid, "latest")`` for every rollout of a run with 10 spans per rollout; with
    ``use_fields``, the caller also reads every span's JSON-held fields (attributes, status, events,
    links, context, resource), which the store decodes only when they are read."""
    ids, problems = await _readback_setup(target, size)
    s = size.spans_per_rollout
    started = time.perf_counter()
    for rid in ids:
        spans = await target.store.query_spans(rid, "latest")
        if use_fields:
            for sp in spans:
                sp.attributes, sp.status, sp.events, sp.links, sp.context, sp.resource  # noqa: B018
        problem = check_span_order(spans, s, rid)
        if problem and len(problems) < 5:
            problems.append(problem)
    elapsed = time.perf_counter() - started
    return _readback_measurement(len(ids), s, elapsed, problems)


async def trace_pages(target: Target, size: Size, *, page: int = 10) -> Measurement:
    """Pages of ``page`` spans of one long trace (``size.trace_spans`` spans of one attempt), at
    seeded random offsets, each with its total: what a trace viewer asks.  The trace is written
    just before, so PostgreSQL's statistics may not describe it yet (the store analyses its tables
    as they grow, ADR 0006), as for a trace being written while someone looks at it."""
    ((rid, aid),) = await _claimed_attempts(target, 1)
    factory = SpanFactory(target.span_cls, size.heavy)
    n = max(size.trace_spans, page)
    for start in range(0, n, 1000):
        await target.store.add_many_spans([factory.make(rid, aid, k + 1) for k in range(start, min(n, start + 1000))])
    rng = random.Random(1)
    offsets = [rng.randrange(0, n - page + 1) for _ in range(size.trace_pages)]
    offsets[0] = 0  # the first page, which a viewer always asks for
    problems: list[str] = []
    started = time.perf_counter()
    for offset in offsets:
        got = await target.store.query_spans(rid, "latest", limit=page, offset=offset)
        seqs = [sp.sequence_id for sp in got]
        if (seqs != list(range(offset + 1, offset + page + 1)) or got.total != n) and len(problems) < 5:
            problems.append(f"page at offset {offset}: sequence ids {seqs[:3]}..., total {got.total} of {n}")
    elapsed = time.perf_counter() - started
    return Measurement({"pages/s": len(offsets) / elapsed}, problems)


async def p0_readback(target: Target, size: Size) -> Measurement:
    """P0 of ``readback_spans`` on the target's own database: the raw driver running the same SELECT
    and decoding the JSON columns, no models (``p0.pg_readback_loop`` / ``p0.sqlite_readback_loop``)."""
    ids, problems = await _readback_setup(target, size)
    run_id = await p0.run_id_of(target)
    if target.name == "postgres":
        from benchmarks.targets import pg_dsn

        result = await p0.pg_readback_loop(pg_dsn(), target.extra["schema"], run_id, ids)
    else:
        result = p0.sqlite_readback_loop(target.extra["path"], run_id, ids)  # in this thread, as inline reads
    for rid in ids:
        problem = check_sequence_ids(result["sequences"][rid], size.spans_per_rollout, rid)
        if problem and len(problems) < 5:
            problems.append(problem)
    return _readback_measurement(len(ids), size.spans_per_rollout, result["elapsed"], problems)


async def query_rollouts_status(target: Target, size: Size, *, matching: int = 200) -> Measurement:
    """``query_rollouts(status_in=[...])`` over a run of 20k rollouts, 200 of which match."""
    await fill_queue(target, size.query_rollouts_n)
    claimed = await target.store.dequeue_many_rollouts(limit=matching, worker_id="setup")
    expected = {ar.rollout_id for ar in claimed}
    problems: list[str] = []
    repeats = size.query_rollouts_repeats
    started = time.perf_counter()
    for _ in range(repeats):
        result = await target.store.query_rollouts(status_in=["preparing", "running"])
        if {r.rollout_id for r in result} != expected and not problems:
            problems.append(f"query_rollouts returned {len(result)} rollouts, expected the {len(expected)} claimed")
    elapsed = time.perf_counter() - started
    return Measurement({"queries/s": repeats / elapsed}, problems)


# --- W7: scale-out ----------------------------------------------------------------------------


def _scaleout_child(
    remote: tuple[Any, ...], runners: int, spans_per_rollout: int, heavy: bool, ready: Any, start: Any, results: Any
) -> None:
    asyncio.run(_scaleout_child_main(remote, runners, spans_per_rollout, heavy, ready, start, results))


async def _scaleout_child_main(
    remote: tuple[Any, ...], runners: int, spans_per_rollout: int, heavy: bool, ready: Any, start: Any, results: Any
) -> None:
    store = await open_remote(remote)
    try:
        if remote[0] == "sql":
            from lightning_sql.types import Span
        else:
            from agentlightning.types import Span
        factory = SpanFactory(Span, heavy)
        await store.statistics()  # connect (and for SQL: open the run) before the clock starts
        ready.put(os.getpid())
        await asyncio.to_thread(start.wait)
        claimed: list[str] = []
        await asyncio.gather(
            *(runner_loop(store, factory, f"p{os.getpid()}-runner-{i}", spans_per_rollout, True, claimed) for i in range(runners))
        )
        results.put(("ok", claimed, time.time()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(exc).__name__}: {exc}", time.time()))
    finally:
        await close_store(store)


async def scaleout(target: Target, size: Size, *, processes: int, runners_per_process: int = 8) -> Measurement:
    """W1 (batch) with the runners in ``processes`` spawned processes; the algorithm reads back here."""
    assert target.remote is not None
    n = size.b2_scaleout_n if target.name == "B2" else size.scaleout_n
    s = size.spans_per_rollout
    mp = multiprocessing.get_context("spawn")
    ready, results, start = mp.Queue(), mp.Queue(), mp.Event()
    procs = [
        mp.Process(
            target=_scaleout_child,
            args=(target.remote, runners_per_process, s, size.heavy, ready, start, results),
            daemon=True,
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    problems: list[str] = []
    claimed: list[str] = []
    try:
        for _ in procs:
            await asyncio.to_thread(ready.get, True, 300)
        ids = [r.rollout_id for r in await target.store.enqueue_many_rollouts([target.request_cls(input={"task": i}) for i in range(n)])]
        started = time.perf_counter()
        start.set()
        for _ in procs:
            status, payload, _t = await asyncio.to_thread(results.get, True, 600)
            if status != "ok":
                problems.append(f"runner process failed: {payload}")
            else:
                claimed.extend(payload)
        for rid in ids:
            spans = await target.store.query_spans(rid, "latest")
            problem = check_span_order(spans, s, rid)
            if problem and len(problems) < 5:
                problems.append(problem)
        elapsed = time.perf_counter() - started
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    problems += check_claims(claimed, n, "scale-out")
    problems += await check_all_succeeded(target.store, ids)
    return Measurement({"rollouts/s": n / elapsed}, problems, [f"N={n}"])


# --- W8: memory -------------------------------------------------------------------------------


def _memory_child(target_name: str, n: int, size: Size, results: Any) -> None:
    # Sampled, not ru_maxrss: on Linux ru_maxrss survives exec, so a spawned child would report its
    # parent's peak.  Every size enqueues and reads back in chunks of the same size, at most the
    # smallest N: with chunks of 2,000 the small N's one chunk was smaller than the large N's, and the
    # larger transient peak of the calls' 2,000 models (arena high-water marks) made most of the
    # "growth" (docs/performance.md, W8).
    page = min(ENQUEUE_CHUNK, *size.memory_n)

    async def main() -> None:
        with tempfile.TemporaryDirectory(prefix="bench-mem-") as workdir, RssSampler() as rss:
            async with open_target(target_name, workdir) as target:
                m = await lifecycle(target, size, runners=8, batch=True, n=n, lean=True, page=page)
        results.put((m.metrics["rollouts/s"], rss.peak_mb, m.problems))

    try:
        asyncio.run(main())
    except BaseException as exc:  # noqa: BLE001
        results.put((0.0, 0.0, [f"memory child failed: {type(exc).__name__}: {exc}"]))


async def memory(target: Target, size: Size) -> Measurement:
    """W1 at a small and a large N, each in a fresh process: peak RSS of the process holding the store."""
    mp = multiprocessing.get_context("spawn")
    figures: dict[str, float] = {}
    problems: list[str] = []
    for n in size.memory_n:
        results = mp.Queue()
        proc = mp.Process(target=_memory_child, args=(target.name, n, size, results), daemon=True)
        proc.start()
        rate, rss_mb, child_problems = await asyncio.to_thread(results.get, True, 3600)
        await asyncio.to_thread(proc.join, 60)
        figures[f"rss_mb@{n}"] = rss_mb
        figures[f"rollouts/s@{n}"] = rate
        problems += child_problems
    small, large = size.memory_n
    growth = figures[f"rss_mb@{large}"] / figures[f"rss_mb@{small}"] if figures[f"rss_mb@{small}"] else float("nan")
    return Measurement({"rss_growth": growth, **figures}, problems)


# --- the registry -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One row of the results: a workload at one setting, run on several targets."""

    workload: str
    label: str
    run: Callable[[Target, Size], Awaitable[Measurement]]
    targets: tuple[str, ...]
    # Reference targets of the ratios: each SQL target's headline is divided by theirs.
    references: tuple[str, ...] = ("B1",)
    # False: the workload opens its stores itself (in child processes); it gets an unopened Target.
    opens_store: bool = True
    # False: its stores' work runs in child processes (the collector's time of this one means
    # nothing). A case that does not open its stores (W8) reports no collector's time either.
    in_process: bool = True
    # What the P0-sqlite / P0-postgres targets of the case run: the raw driver's version of ``run``.
    p0: Callable[[Target, Size], Awaitable[Measurement]] | None = None


SQL = ("sqlite", "postgres")


def cases(size: Size) -> dict[str, list[Case]]:
    def bind(fn: Callable[..., Awaitable[Measurement]], **kw: Any) -> Callable[[Target, Size], Awaitable[Measurement]]:
        async def call(target: Target, sz: Size) -> Measurement:
            return await fn(target, sz, **kw)

        return call

    out: dict[str, list[Case]] = {
        "W1": [
            Case("W1", f"lifecycle-batch R={r}", bind(lifecycle, runners=r, batch=True), (*SQL, "B1", "B2"), ("B1", "B2"))
            for r in size.lifecycle_runners
        ],
        "W2": [
            Case("W2", f"lifecycle-single R={r}", bind(lifecycle, runners=r, batch=False), (*SQL, "B1", "B2"), ("B1", "B2"))
            for r in size.lifecycle_runners
        ],
        "W3": [
            Case("W3", f"enqueue_many x{size.enqueue_many_n}", enqueue_many, (*SQL, "B1")),
            Case("W3", f"enqueue_rollout x{size.enqueue_single_n}", enqueue_single, (*SQL, "B1")),
        ],
        "W4": [
            Case(
                "W4",
                f"dequeue R={r}",
                bind(dequeue_contention, claimers=r),
                (*SQL, "B1", "P0-sqlite", "P0-postgres") if r == size.dequeue_claimers[0] else (*SQL, "B1"),
                ("P0", "B1") if r == size.dequeue_claimers[0] else ("B1",),
                p0=p0_claims,
            )
            for r in size.dequeue_claimers
        ],
        "W5": [
            Case("W5", "add_many_spans 8 writers x10", ingest_concurrent, (*SQL, "B1")),
            Case("W5", f"add_many_spans bulk {size.ingest_spans}", ingest_bulk, (*SQL, "B1")),
            Case("W5", f"add_span x{size.ingest_spans}", ingest_single, (*SQL, "B1")),
        ],
        "W6": [
            Case(
                "W6",
                f"query_spans x{size.readback_rollouts}",
                readback_spans,
                (*SQL, "B1", "P0-sqlite", "P0-postgres"),
                ("B1", "P0"),
                p0=p0_readback,
            ),
            Case(
                "W6",
                f"query_spans x{size.readback_rollouts}, every span's fields read",
                bind(readback_spans, use_fields=True),
                (*SQL, "B1", "P0-sqlite", "P0-postgres"),
                ("B1", "P0"),
                p0=p0_readback,
            ),
            Case("W6", f"query_rollouts(status_in) over {size.query_rollouts_n}", query_rollouts_status, (*SQL, "B1")),
            Case(
                "W6",
                f"query_spans pages of 10 of a {size.trace_spans}-span trace x{size.trace_pages}",
                trace_pages,
                (*SQL, "B1"),
            ),
        ],
        "W7": [
            Case("W7", f"scale-out P={p}", bind(scaleout, processes=p), ("postgres", "B2"), ("B2",), in_process=False)
            for p in size.scaleout_processes
        ],
        "W8": [Case("W8", f"memory N={size.memory_n[0]}->{size.memory_n[1]}", memory, (*SQL, "B1"), (), opens_store=False)],
    }
    return out


def median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")
