"""Contract §2.13: resources, versions, history, "latest" by touch order, concurrent updates."""

from __future__ import annotations

import asyncio
import re

import pytest

from lightning_sql import LLM, PromptTemplate, ProxyLLM, ResourcesUpdate

T0 = 1_800_000_000.0


def llm(model: str = "m") -> LLM:
    return LLM(endpoint="http://llm/v1", model=model, sampling_parameters={"temperature": 0.5})


async def test_add_resources(store, clock):
    res = {"llm": llm(), "prompt": PromptTemplate(template="Hi {name}", engine="f-string")}
    got = await store.add_resources(res)
    assert isinstance(got, ResourcesUpdate)
    assert re.fullmatch(r"rs-[0-9a-f]{12}", got.resources_id)
    assert (got.version, got.create_time, got.update_time) == (1, clock(), clock())
    assert got.resources == res
    # Concrete classes are re-materialised on read.
    back = await store.get_resources_by_id(got.resources_id)
    assert back == got
    assert type(back.resources["llm"]) is LLM and type(back.resources["prompt"]) is PromptTemplate
    assert await store.get_latest_resources() == got
    other = await store.add_resources({"p": ProxyLLM(endpoint="http://p/v1", model="x")})
    assert other.resources_id != got.resources_id
    assert type((await store.get_latest_resources()).resources["p"]) is ProxyLLM


async def test_update_resources_versions_and_history(store, clock):
    first = await store.add_resources({"llm": llm("v1")})
    rid = first.resources_id
    clock.advance(10)
    second = await store.update_resources(rid, {"llm": llm("v2")})
    assert (second.version, second.create_time, second.update_time) == (2, T0, T0 + 10)
    clock.advance(10)
    third = await store.update_resources(rid, {"llm": llm("v3")})
    assert third.version == 3 and third.resources["llm"].model == "v3"
    assert await store.get_resources_by_id(rid) == third
    # History: each version as it was, create_time of the id, update_time = that version's time.
    v1 = await store.get_resources_by_id(rid, version=1)
    assert (v1.version, v1.create_time, v1.update_time, v1.resources["llm"].model) == (1, T0, T0, "v1")
    v2 = await store.get_resources_by_id(rid, version=2)
    assert (v2.version, v2.create_time, v2.update_time, v2.resources["llm"].model) == (2, T0, T0 + 10, "v2")
    assert await store.get_resources_by_id(rid, version=3) == third
    assert await store.get_resources_by_id(rid, version=4) is None
    assert await store.get_resources_by_id(rid, version=0) is None
    assert await store.get_resources_by_id("rs-missing") is None
    assert await store.get_resources_by_id("rs-missing", version=1) is None
    # total_resources counts ids, not history versions.
    assert (await store.statistics())["total_resources"] == 1


async def test_update_unknown_id_creates_version_1_with_caller_chosen_ids(store, clock):
    for rid in ("default", "v1"):
        got = await store.update_resources(rid, {"llm": llm()})
        assert (got.resources_id, got.version, got.create_time, got.update_time) == (rid, 1, clock(), clock())
        assert await store.get_resources_by_id(rid, version=1) == got
    assert [r.resources_id for r in await store.query_resources()] == ["default", "v1"]


async def test_latest_follows_touch_order_even_when_clocks_tie_or_step_back(store, clock):
    a = await store.add_resources({"x": llm("a")})
    b = await store.add_resources({"x": llm("b")})  # same clock reading
    assert (await store.get_latest_resources()).resources_id == b.resources_id
    await store.update_resources(a.resources_id, {"x": llm("a2")})  # same clock again
    assert (await store.get_latest_resources()).resources_id == a.resources_id
    clock.set(T0 - 1000)  # the clock steps back
    await store.update_resources(b.resources_id, {"x": llm("b2")})
    latest = await store.get_latest_resources()
    assert latest.resources_id == b.resources_id and latest.update_time == T0 - 1000
    clock.set(T0 - 2000)
    c = await store.add_resources({"x": llm("c")})
    assert (await store.get_latest_resources()).resources_id == c.resources_id
    # query_resources keeps first-creation order regardless of touches.
    assert [r.resources_id for r in await store.query_resources()] == [
        a.resources_id,
        b.resources_id,
        c.resources_id,
    ]


async def test_no_resources(store):
    assert await store.get_latest_resources() is None
    assert len(await store.query_resources()) == 0


async def test_query_resources_filters(store):
    for rid in ("alpha", "beta", "alphabet", "Alpha"):
        await store.update_resources(rid, {})
    await store.update_resources("alpha", {"p": PromptTemplate(template="t", engine="jinja")})
    got = await store.query_resources()
    assert [r.resources_id for r in got] == ["alpha", "beta", "alphabet", "Alpha"]  # current rows only
    assert got[0].version == 2
    assert [r.resources_id for r in await store.query_resources(resources_id="alpha")] == ["alpha"]
    assert [r.resources_id for r in await store.query_resources(resources_id_contains="lpha")] == [
        "alpha",
        "alphabet",
        "Alpha",
    ]
    assert [r.resources_id for r in await store.query_resources(resources_id_contains="alpha")] == [
        "alpha",
        "alphabet",
    ]
    # Always AND-ed.
    assert [
        r.resources_id
        for r in await store.query_resources(resources_id="beta", resources_id_contains="alpha")
    ] == []
    assert [r.resources_id for r in await store.query_resources(sort_by="version", sort_order="desc")][
        0
    ] == "alpha"


async def test_rollouts_record_resources_version(store):
    assert (await store.enqueue_rollout(1)).resources_version is None
    a = await store.update_resources("a", {"x": llm("1")})
    r1 = await store.enqueue_rollout(1)  # resources_id=None -> latest id and its version
    assert (r1.resources_id, r1.resources_version) == ("a", 1)
    await store.update_resources("a", {"x": llm("2")})
    r2 = await store.enqueue_rollout(2, resources_id="a")
    assert (r2.resources_id, r2.resources_version) == ("a", 2)
    started = await store.start_rollout(3)
    assert (started.resources_id, started.resources_version) == ("a", 2)
    unknown = await store.enqueue_rollout(4, resources_id="nope")
    assert (unknown.resources_id, unknown.resources_version) == ("nope", None)
    # update_rollout(resources_id=...) re-resolves; the old rollout keeps what it recorded otherwise.
    await store.update_resources("a", {"x": llm("3")})
    assert (await store.get_rollout_by_id(r1.rollout_id)).resources_version == 1
    moved = await store.update_rollout(unknown.rollout_id, resources_id="a")
    assert moved.resources_version == 3
    cleared = await store.update_rollout(r1.rollout_id, resources_id=None)
    assert (cleared.resources_id, cleared.resources_version) == (None, None)
    assert a.version == 1


async def test_concurrent_updates_of_one_id_serialise(store):
    n = 20
    await store.update_resources("shared", {"x": llm("init")})
    results = await asyncio.gather(*(store.update_resources("shared", {"x": llm(f"m{i}")}) for i in range(n)))
    assert sorted(r.version for r in results) == list(range(2, n + 2))
    current = await store.get_resources_by_id("shared")
    assert current.version == n + 1
    history = [await store.get_resources_by_id("shared", version=v) for v in range(1, n + 2)]
    assert all(h is not None for h in history)
    assert {h.resources["x"].model for h in history[1:]} == {f"m{i}" for i in range(n)}
    # Each result's resources are what that version recorded (none lost, none swapped).
    for r in results:
        assert (await store.get_resources_by_id("shared", version=r.version)).resources == r.resources


async def test_concurrent_updates_of_distinct_ids_all_persist(store):
    results = await asyncio.gather(
        *(store.update_resources(f"id-{i}", {"x": llm(str(i))}) for i in range(20))
    )
    assert all(r.version == 1 for r in results)
    got = await store.query_resources()
    assert sorted(r.resources_id for r in got) == sorted(f"id-{i}" for i in range(20))
    latest = await store.get_latest_resources()
    assert latest.resources_id in {r.resources_id for r in results}


async def test_resources_validation(store):
    with pytest.raises((TypeError, ValueError)):
        await store.add_resources({"x": {"resource_type": "nope"}})
    with pytest.raises(TypeError):
        await store.add_resources(["not", "a", "dict"])
    with pytest.raises(TypeError, match="version"):
        await store.get_resources_by_id("x", version="1")
    assert len(await store.query_resources()) == 0
