"""Fixtures of the LLM proxy tests: a stand-in model server and proxies in front of it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from lightning_sql.llm_proxy import LLMProxy
from lightning_sql.llm_proxy.spans import RAW_SPAN_NAME
from lightning_sql.llm_proxy.testing import StandInModelServer
from lightning_sql.store.base import LightningStore
from lightning_sql.types import Span

MODEL = "policy"


@pytest.fixture
def stand_in() -> Iterator[StandInModelServer]:
    with StandInModelServer() as server:
        yield server


def model_entry(api_base: str, name: str = MODEL, provider: str = "hosted_vllm") -> dict[str, Any]:
    return {"model_name": name, "litellm_params": {"model": f"{provider}/stand-in", "api_base": api_base}}


def closed_port_url() -> str:
    """A URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@pytest.fixture
async def make_proxy(
    stand_in: StandInModelServer, store: LightningStore
) -> AsyncIterator[Callable[..., Any]]:
    """``await make_proxy(**options)``: a started proxy in front of the stand-in, recording into ``store``."""
    proxies: list[LLMProxy] = []

    async def make(**options: Any) -> LLMProxy:
        options.setdefault("model_list", [model_entry(stand_in.url)])
        options.setdefault("store", store)
        proxy = LLMProxy(**options)
        await proxy.start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        if proxy.is_running():
            await proxy.stop()


async def spans_of(store: LightningStore, rollout_id: str, attempt_id: str | None = None) -> list[Span]:
    """The calls' own spans, without the raw_gen_ai_request child a call with token ids also stores."""
    return [s for s in await store.query_spans(rollout_id, attempt_id) if s.name != RAW_SPAN_NAME]


async def wait_for_spans(
    store: LightningStore, rollout_id: str, count: int, timeout: float = 10.0
) -> list[Span]:
    """Spans of a rollout once at least ``count`` are stored (a background record may lag the client)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        spans = await spans_of(store, rollout_id)
        if len(spans) >= count or asyncio.get_running_loop().time() > deadline:
            return spans
        await asyncio.sleep(0.05)
