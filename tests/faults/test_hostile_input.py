"""Hostile input in every string and JSON field (docs/operations.md, "Hostile input").

Guarantees, on every backend:
* SQL metacharacters, quotes, LIKE wildcards, control characters and any Unicode round-trip exactly in
  every string field and JSON value, match literally in filters, and harm nothing;
* a NUL character or a lone surrogate anywhere → ValueError naming the field, nothing written; reads
  whose id or filter contains one match nothing;
* JSON: NaN/±Infinity → ValueError; nesting deeper than MAX_JSON_DEPTH → ValueError naming the path;
  a value larger than MAX_JSON_BYTES → ValueError naming the field, its size and the limit;
* sort and filter field names are looked up in an allow-list (filters.py): anything else, including
  real columns that are not model fields (``run_id``, ``queue_seq``, ``id``), → ValueError.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from lightning_sql import RolloutConfig, SqlLightningStore
from lightning_sql.store.sql import filters as f
from lightning_sql.types import PromptTemplate
from lightning_sql.types.jsonvalue import MAX_JSON_BYTES, MAX_JSON_DEPTH
from tests.faults.support import assert_consistent, make_span

HOSTILE = [
    "'; DROP TABLE rollouts; --",
    '" OR "1"="1',
    "Robert'); DELETE FROM spans WHERE ('1'='1",
    "%",
    "_",
    "\\%\\_\\\\",
    "$1 :name ? %s %(x)s {0}",
    "ünïcødé — 中文 — עברית \u202e — 😀 𝔘𝔫𝔦",
    "tab\tnew\nline\rcr\x1b[31m",
    "NULL",
    " ",
]


async def _counts(store: SqlLightningStore) -> dict[str, Any]:
    stats = dict(await store.statistics())
    stats.pop("uptime")
    return stats


async def test_metacharacters_and_unicode_round_trip_everywhere(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory(run="'; DROP TABLE runs; -- 😀", run_metadata={"h": HOSTILE})
    for i, text in enumerate(HOSTILE):
        payload = {text: [text, {"nested " + text: text}], "i": i}
        res = await store.update_resources(f"res {text}", {"prompt": PromptTemplate(template=text, engine="f-string")})
        rollout = await store.enqueue_rollout(
            payload, mode="train", resources_id=res.resources_id, metadata={text: text}, idempotency_key=f"key {text}"
        )
        worker = f"worker {text}"
        claimed = await store.dequeue_rollout(worker_id=worker)
        assert claimed is not None and claimed.rollout_id == rollout.rollout_id
        aid = claimed.attempt.attempt_id
        span = make_span(rollout.rollout_id, aid, 1, name=text, **{text: text})
        await store.add_span(span)
        await store.update_attempt(rollout.rollout_id, aid, status="succeeded", metadata={"why": text})
        await store.update_worker(worker, heartbeat_stats={text: text})

        got = await store.get_rollout_by_id(rollout.rollout_id)
        assert got is not None
        assert (got.input, got.metadata, got.idempotency_key, got.resources_id) == (
            payload_roundtrip(payload), {text: text}, f"key {text}", f"res {text}"
        )
        assert got.attempt.metadata == {"why": text}  # type: ignore[union-attr]
        (stored_span,) = await store.query_spans(rollout.rollout_id)
        assert stored_span.name == text and stored_span.attributes[text] == text
        w = await store.get_worker_by_id(worker)
        assert w is not None and w.heartbeat_stats == {text: text}
        r = await store.get_resources_by_id(f"res {text}")
        assert r is not None and r.resources["prompt"].template == text  # type: ignore[union-attr]
        # Filters match literally: a LIKE wildcard or a quote is just a character.
        assert [x.rollout_id for x in await store.query_rollouts(idempotency_key_in=[f"key {text}"])] == [
            rollout.rollout_id
        ]
        assert [x.worker_id for x in await store.query_workers(worker_id_contains=text)] == [
            x for x in (f"worker {t}" for t in HOSTILE[: i + 1]) if text in x
        ]
        assert [s.name for s in await store.query_spans(rollout.rollout_id, name_contains=text)] == [text]
    run = await store.get_run("'; DROP TABLE runs; -- 😀")
    assert run is not None and run.metadata == {"h": HOSTILE}
    stats = await store.statistics()
    assert stats["total_rollouts"] == len(HOSTILE) and stats["total_spans"] == len(HOSTILE)
    await assert_consistent(store)


def payload_roundtrip(value: Any) -> Any:
    return value  # dicts of lists of str round-trip as they are


NUL_CASES = ["nul\x00byte", "lone \ud800 surrogate"]


def _writes(store: SqlLightningStore, bad: str, ctx: dict[str, str]) -> dict[str, Callable[[], Awaitable[Any]]]:
    rid, aid = ctx["rid"], ctx["aid"]
    return {
        "input": lambda: store.enqueue_rollout({"x": bad}),
        "input key": lambda: store.enqueue_rollout({bad: 1}),
        "metadata": lambda: store.enqueue_rollout({}, metadata={"m": [bad]}),
        "resources_id": lambda: store.enqueue_rollout({}, resources_id=bad),
        "idempotency_key": lambda: store.enqueue_rollout({}, idempotency_key=bad),
        "batch": lambda: store.enqueue_many_rollouts([{"input": 1}, {"input": {"x": bad}}]),
        "worker_id (dequeue)": lambda: store.dequeue_rollout(worker_id=bad),
        "worker_id (update_worker)": lambda: store.update_worker(bad),
        "heartbeat_stats": lambda: store.update_worker("w", heartbeat_stats={"s": bad}),
        "attempt metadata": lambda: store.update_attempt(rid, aid, metadata={"m": bad}),
        "attempt worker_id": lambda: store.update_attempt(rid, aid, worker_id=bad),
        "rollout update": lambda: store.update_rollout(rid, metadata={"m": bad}),
        "span name": lambda: store.add_span(make_span(rid, aid, 1, name=bad)),
        "span attribute": lambda: store.add_span(make_span(rid, aid, 1, a=bad)),
        "span batch": lambda: store.add_many_spans([make_span(rid, aid, 1), make_span(rid, aid, 2, name=bad)]),
        "resources id": lambda: store.update_resources(bad, {}),
        "resources payload": lambda: store.add_resources({"p": PromptTemplate(template=bad, engine="f-string")}),
    }


async def test_nul_and_surrogates_are_rejected_before_any_write(
    store_factory: Callable[..., SqlLightningStore],
) -> None:
    store = store_factory()
    r = await store.enqueue_rollout({})
    claimed = await store.dequeue_rollout()
    assert claimed is not None
    ctx = {"rid": r.rollout_id, "aid": claimed.attempt.attempt_id}
    before = await _counts(store)
    for bad in NUL_CASES:
        await _rejected_everywhere(store, bad, ctx, r.rollout_id)
    assert await _counts(store) == before
    await assert_consistent(store)


async def _rejected_everywhere(store: SqlLightningStore, bad: str, ctx: dict[str, str], rid: str) -> None:
    for label, call in _writes(store, bad, ctx).items():
        with pytest.raises(ValueError) as info:
            await call()
        message = str(info.value)
        assert "NUL" in message or "surrogate" in message, (label, message)
    # Reads with such ids match nothing (no driver error).
    assert await store.get_rollout_by_id(bad) is None
    assert await store.get_worker_by_id(bad) is None
    assert await store.get_resources_by_id(bad) is None
    assert (await store.query_rollouts(rollout_id_in=[bad])).total == 0
    assert (await store.query_rollouts(rollout_id_contains=bad)).total == 0
    assert (await store.query_spans(rid, name=bad)).total == 0
    assert (await store.query_workers(worker_id_contains=bad)).total == 0
    assert (await store.query_resources(resources_id_contains=bad)).total == 0
    with pytest.raises(ValueError):
        SqlLightningStore("sqlite://", run=bad)


async def test_non_finite_numbers_in_json_are_rejected(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory()
    r = await store.enqueue_rollout({})
    claimed = await store.dequeue_rollout()
    assert claimed is not None
    rid, aid = r.rollout_id, claimed.attempt.attempt_id
    before = await _counts(store)

    def calls(bad: float) -> list[Callable[[], Awaitable[Any]]]:
        return [
            lambda: store.enqueue_rollout({"x": [1.0, bad]}),
            lambda: store.enqueue_rollout({}, metadata={"m": bad}),
            lambda: store.update_worker("w", heartbeat_stats={"load": bad}),
            lambda: store.add_span(make_span(rid, aid, 1, reward=bad)),
            lambda: store.update_attempt(rid, aid, metadata={"m": bad}),
        ]

    for bad in (math.nan, math.inf, -math.inf):
        for call in calls(bad):
            with pytest.raises(ValueError, match="NaN|Infinity"):
                await call()
    assert await _counts(store) == before


async def test_nan_in_float_fields_is_rejected(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory()
    r = await store.enqueue_rollout({})
    claimed = await store.dequeue_rollout()
    assert claimed is not None
    with pytest.raises(ValueError):
        await store.update_attempt(r.rollout_id, claimed.attempt.attempt_id, last_heartbeat_time=math.nan)
    with pytest.raises(ValueError):
        await store.enqueue_rollout({}, config=RolloutConfig(unresponsive_seconds=math.nan))


async def test_nesting_limit(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory()

    def nested(depth: int) -> Any:
        value: Any = "leaf"
        for _ in range(depth):
            value = [value]
        return value

    ok = await store.enqueue_rollout(nested(MAX_JSON_DEPTH))
    assert (await store.get_rollout_by_id(ok.rollout_id)).input == nested(MAX_JSON_DEPTH)  # type: ignore[union-attr]
    for depth in (MAX_JSON_DEPTH + 1, 100_000):  # far past the limit: still a ValueError, not a RecursionError
        with pytest.raises(ValueError, match=f"input.*maximum depth of {MAX_JSON_DEPTH}"):
            await store.enqueue_rollout(nested(depth))
    with pytest.raises(ValueError, match=r"metadata\['a'\].*maximum depth"):
        await store.enqueue_rollout({}, metadata={"a": nested(MAX_JSON_DEPTH + 5)})


async def test_payload_size_limit(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory()
    r = await store.enqueue_rollout({})
    claimed = await store.dequeue_rollout()
    assert claimed is not None
    big_ok = "x" * (1 << 20)  # 1 MiB: far below the limit, stored and read back whole
    ok = await store.enqueue_rollout({"blob": big_ok})
    assert (await store.get_rollout_by_id(ok.rollout_id)).input == {"blob": big_ok}  # type: ignore[union-attr]
    before = await _counts(store)
    too_big = "y" * (MAX_JSON_BYTES + 1)
    for field, call in (
        ("input", lambda: store.enqueue_rollout({"blob": too_big})),
        ("attributes", lambda: store.add_span(make_span(r.rollout_id, claimed.attempt.attempt_id, 1, blob=too_big))),
        ("heartbeat_stats", lambda: store.update_worker("w", heartbeat_stats={"blob": too_big})),
    ):
        with pytest.raises(ValueError, match=f"{field}.*exceeds the limit of {MAX_JSON_BYTES} bytes") as info:
            await call()
        assert too_big not in str(info.value)  # the message names the size, it does not echo the payload
    assert await _counts(store) == before


async def test_huge_ids_get_a_clear_error_on_every_backend(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory()
    huge = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(100_000))  # incompressible
    for call in (
        lambda: store.update_worker(huge),
        lambda: store.enqueue_rollout({}, idempotency_key=huge),
        lambda: store.update_resources(huge, {}),
    ):
        with pytest.raises(ValueError):
            await call()


# --- the sort / filter allow-list ------------------------------------------------------------------

INJECTED_FIELDS = [
    "rollout_id; DROP TABLE rollouts",
    "1",
    "(SELECT 1)",
    "rollout_id DESC, (SELECT pg_sleep(10))",
    "run_id",
    "queue_seq",
    "id",
    "",
    "ROLLOUT_ID",
]


async def test_sort_fields_come_from_the_allow_list(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory()
    r = await store.enqueue_rollout({})

    def calls(sort_by: str) -> list[Callable[[], Awaitable[Any]]]:
        return [
            lambda: store.query_rollouts(sort_by=sort_by),
            lambda: store.query_attempts(r.rollout_id, sort_by=sort_by),
            lambda: store.query_spans(r.rollout_id, sort_by=sort_by),
            lambda: store.query_workers(sort_by=sort_by),
            lambda: store.query_resources(sort_by=sort_by),
        ]

    for sort_by in INJECTED_FIELDS:
        for call in calls(sort_by):
            with pytest.raises(ValueError, match="Failed to sort items by"):
                await call()
    assert (await store.statistics())["total_rollouts"] == 1


async def test_order_and_logic_are_literals(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = store_factory()
    # Upstream's texts (docs/store-contract.md §0.6: a ValueError naming the value).
    for bad in ("asc; DROP TABLE rollouts", "ASC", "descending", ""):
        with pytest.raises(ValueError, match=re.escape(f"Unsupported sort order {bad!r}")):
            await store.query_rollouts(sort_by="rollout_id", sort_order=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=re.escape(f"Unsupported filter aggregate {bad!r}")):
            await store.query_rollouts(filter_logic=bad)  # type: ignore[arg-type]
    # Filter values are bound parameters: a hostile status is simply a status nobody has.
    await store.enqueue_rollout({})
    assert (await store.query_rollouts(status_in=["queuing' OR '1'='1"])).total == 0  # type: ignore[list-item]
    assert (await store.query_rollouts(status_in=["queuing"])).total == 1


def test_allow_lists_name_only_model_fields() -> None:
    """Every sortable name is a scalar field of its model and a column of its table."""
    from lightning_sql.types import Attempt, ResourcesUpdate, Rollout, Span, Worker

    models = {"Rollout": Rollout, "Attempt": Attempt, "Span": Span, "ResourcesUpdate": ResourcesUpdate, "Worker": Worker}
    for spec in (f.ROLLOUT_SORT, f.ATTEMPT_SORT, f.SPAN_SORT, f.RESOURCES_SORT, f.WORKER_SORT):
        fields = set(models[spec.model].model_fields)
        assert set(spec.scalar) <= fields, spec.model
        assert set(spec.scalar) <= set(spec.table.c.keys()), spec.model
        assert not set(spec.scalar) & set(spec.non_scalar)
        for internal in ("run_id", "queue_seq", "span_seq", "create_seq", "touch_seq", "attempt_count", "id"):
            assert internal not in spec.scalar, (spec.model, internal)
