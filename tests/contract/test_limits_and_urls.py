"""What a new user met first: id limits that differed by backend, long span names that could be
stored but never found, and store URLs that silently meant something else."""

from __future__ import annotations

import threading

import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.types import EnqueueRolloutRequest
from lightning_sql.types.jsonvalue import MAX_ID_BYTES
from tests.contract.test_spans import make_span


async def test_ids_are_limited_in_utf8_bytes_alike_on_every_backend(store):
    cjk = "日" * (MAX_ID_BYTES // 3 + 1)  # fewer characters than the limit, more bytes
    assert len(cjk) < MAX_ID_BYTES < len(cjk.encode())
    with pytest.raises(ValueError, match=r"idempotency_key: \d+ bytes \(UTF-8\) exceed the limit of 1024 bytes"):
        await store.enqueue_rollout({"q": 1}, idempotency_key=cjk)
    with pytest.raises(ValueError, match="worker_id: 1026 bytes"):
        await store.update_worker("é" * 513)
    assert (await store.query_rollouts()).total == 0 and (await store.query_workers()).total == 0
    # Right at the limit the id is stored, and found again, on every backend.
    at_limit = "日" * (MAX_ID_BYTES // 3) + "a" * (MAX_ID_BYTES % 3)
    assert len(at_limit.encode()) == MAX_ID_BYTES
    (rollout,) = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=1, idempotency_key=at_limit)])
    again = await store.enqueue_rollout({"q": 2}, idempotency_key=at_limit)
    assert again.rollout_id == rollout.rollout_id
    assert (await store.query_rollouts(idempotency_key_in=[at_limit])).total == 1


async def test_a_long_span_name_is_stored_and_found(store):
    ar = await store.start_rollout({"q": 1})
    name = "tool:" + "x" * 3000
    await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 1, name=name))
    assert [sp.name for sp in await store.query_spans(ar.rollout_id, name=name)] == [name]
    assert [sp.name for sp in await store.query_spans(ar.rollout_id, name_contains="x" * 2000)] == [name]
    assert (await store.query_spans(ar.rollout_id, name=name + "y")).total == 0


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sqlite://runs.db", "use sqlite:///runs.db"),
        ("sqlite://data/runs.db", "use sqlite:///data/runs.db"),
        ("runs.db", "is not a database URL"),
        ("sqlite:/runs.db", "is not a database URL"),
        ("mysql://u@h/db", "Unsupported database URL"),
    ],
)
def test_a_url_that_names_no_store_is_refused_with_the_forms_that_do(tmp_path, monkeypatch, url, says):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=says) as info:
        SqlLightningStore(url, run="r")
    assert "sqlite:///" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_the_pool_size_url_parameter_is_checked():
    with pytest.raises(ValueError, match="pool_size .* must be an integer"):
        SqlLightningStore("postgresql://u@h/db?pool_size=many", run="r")
    with pytest.raises(ValueError, match="pool_size .* must be >= 1"):
        SqlLightningStore("postgresql://u@h/db?pool_size=0", run="r")


async def test_an_aiosqlite_url_names_the_same_store_as_the_plain_sqlite_url(tmp_path):
    """``sqlite+aiosqlite:///f.db`` is normalised to ``sqlite:///f.db`` (docs/store-contract.md §4):
    the same database, served by the same executor (one writer thread for the file), which is why
    the contract suite does not run on it as a backend of its own."""
    path = tmp_path / "store.db"
    plain = SqlLightningStore(f"sqlite:///{path}", run="r")
    aio = SqlLightningStore(f"sqlite+aiosqlite:///{path}", run="r")
    try:
        (written,) = await aio.enqueue_many_rollouts([EnqueueRolloutRequest(input={"via": "aiosqlite"})])
        claimed = await plain.dequeue_rollout(worker_id="w")
        assert claimed is not None and claimed.rollout_id == written.rollout_id
        seen = await aio.get_rollout_by_id(written.rollout_id)
        assert seen is not None and seen.status == "preparing"
        writers = [t.name for t in threading.enumerate() if t.name.startswith("lightning-sql-sqlite[") and str(path) in t.name]
        assert writers == [f"lightning-sql-sqlite[sqlite:///{path}]"]
    finally:
        await aio.close()
        await plain.close()
    with pytest.raises(ValueError, match="In-memory databases are served by the plain sqlite:// URL"):
        SqlLightningStore("sqlite+aiosqlite://", run="r")


def test_libpq_connection_options_become_asyncpg_connection_arguments() -> None:
    from lightning_sql.store.sql.urls import normalise_url

    target = normalise_url("postgresql://u@h/db?connect_timeout=7&application_name=trainer&sslmode=require")
    assert target.options["connect_args"] == {"timeout": 7.0, "server_settings": {"application_name": "trainer"}}
    assert dict(target.url.query) == {"ssl": "require"}
    with pytest.raises(ValueError, match="connect_timeout .* must be seconds"):
        normalise_url("postgresql://u@h/db?connect_timeout=soon")
