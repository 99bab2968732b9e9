"""The LLM proxy's cost: latency added per call, concurrent streams, calls recorded per second.

``python -m benchmarks.proxy [--size small|full] [--store sqlite|postgres]``

Three processes: the stand-in model server (``lightning_sql.llm_proxy.testing``), the proxy
(``LLMProxy(launch_mode="mp")`` recording into the store) and this client (httpx, keep-alive).

* **overhead**: sequential non-streamed chat calls, alternating direct (client → stand-in) and proxied
  (client → proxy → stand-in, recorded under a rollout attempt); p50 of each and p50 of the pairwise
  difference (what the proxy adds, recording included).
* **streams**: N concurrent streamed calls through the proxy (the stand-in spaces its chunks so they
  overlap); errors, incomplete streams and spans missing their token ids are counted.
* **recording**: M non-streamed calls from C concurrent clients spread over A attempts; calls per second
  and, checked afterwards, that every call is stored once, in its attempt, with its token ids.  Beside
  it: the stand-in's own throughput at that concurrency, the proxy process's CPU per call, and the
  recorder alone (``SpanRecorder``: attribution, span building and storing, no HTTP) in this process.

Figures are printed, never asserted (tests/llm_proxy/test_benchmark_smoke.py runs it at a tiny size).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psutil

from lightning_sql import SqlLightningStore
from lightning_sql.llm_proxy import LLMProxy
from lightning_sql.llm_proxy.recorder import SpanRecorder
from lightning_sql.llm_proxy.spans import RAW_SPAN_NAME, CallRecord
from lightning_sql.llm_proxy.testing import reply, tokenize


@dataclasses.dataclass(frozen=True)
class ProxyBenchSize:
    overhead_calls: int
    streams: int
    record_calls: int
    record_clients: int
    record_attempts: int


SIZES = {
    "tiny": ProxyBenchSize(overhead_calls=10, streams=8, record_calls=40, record_clients=4, record_attempts=4),
    "small": ProxyBenchSize(overhead_calls=100, streams=50, record_calls=400, record_clients=32, record_attempts=16),
    "full": ProxyBenchSize(overhead_calls=500, streams=200, record_calls=3000, record_clients=64, record_attempts=64),
}
CHUNK_DELAY_S = 0.01  # the stand-in's pause between stream chunks: streams overlap
MESSAGES = [{"role": "user", "content": "What is 12 + 30?"}]
PROMPT = "<|user|> What is 12 + 30? <|assistant|>"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def stand_in_process(chunk_delay: float) -> AsyncIterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "lightning_sql.llm_proxy.testing", "--port", str(port),
           "--chunk-delay", str(chunk_delay)]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}/v1"
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(600):
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
            else:
                raise RuntimeError("the stand-in model server did not start")
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _body(stream: bool = False) -> dict[str, Any]:
    return {"model": "policy", "messages": MESSAGES, "stream": stream}


async def _timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


async def overhead(client: httpx.AsyncClient, direct: str, proxied: str, n: int) -> dict[str, float]:
    direct_body = {**_body(), "model": "stand-in", "return_token_ids": True}

    async def call_direct() -> None:
        (await client.post(direct + "/chat/completions", json=direct_body)).raise_for_status()

    async def call_proxied() -> None:
        (await client.post(proxied + "/v1/chat/completions", json=_body())).raise_for_status()

    for _ in range(10):  # warm up connections on both paths
        await call_direct()
        await call_proxied()
    pairs = [(await _timed(call_direct), await _timed(call_proxied)) for _ in range(n)]
    return {
        "direct_p50_ms": statistics.median(d for d, _ in pairs) * 1e3,
        "proxied_p50_ms": statistics.median(p for _, p in pairs) * 1e3,
        "overhead_p50_ms": statistics.median(p - d for d, p in pairs) * 1e3,
    }


async def streams(shards: list[Any], proxied: str, n: int) -> dict[str, float]:
    expected = reply(PROMPT)
    errors = 0
    incomplete = 0

    async def one(client: Any) -> None:
        nonlocal errors, incomplete
        try:
            text = []
            async with client.stream("POST", proxied + "/v1/chat/completions", json=_body(stream=True)) as response:
                if response.status_code != 200:
                    errors += 1
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = httpx.Response(200, content=line[6:]).json()
                        for choice in chunk.get("choices") or []:
                            text.append((choice.get("delta") or {}).get("content") or "")
            if "".join(text) != expected:
                incomplete += 1
        except httpx.HTTPError:
            errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(one(shards[i % len(shards)]) for i in range(n)))
    return {"streams": n, "errors": errors, "incomplete": incomplete, "wall_s": time.perf_counter() - started}


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def _spread(
    shards: list[httpx.AsyncClient], urls: list[str], body: dict[str, Any], calls: int, clients: int
) -> tuple[float, int]:
    """``calls`` POSTs from ``clients`` concurrent loops over ``urls``: (seconds, errors)."""
    errors = 0
    pending = iter(range(calls))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        for i in pending:
            response = await client.post(urls[i % len(urls)], json=body)
            errors += response.status_code != 200

    started = time.perf_counter()
    await asyncio.gather(*(worker(shards[i % len(shards)]) for i in range(clients)))
    return time.perf_counter() - started, errors


async def recording(
    shards: list[httpx.AsyncClient], direct: str, endpoints: list[str], proxy_pid: int, calls: int, clients: int
) -> dict[str, float]:
    direct_body = {**_body(), "model": "stand-in", "return_token_ids": True}
    direct_s, _ = await _spread(shards, [direct + "/chat/completions"], direct_body, calls, clients)
    cpu = _cpu_s(proxy_pid)
    elapsed, errors = await _spread(shards, [e + "/v1/chat/completions" for e in endpoints], _body(), calls, clients)
    return {
        "calls": calls,
        "errors": errors,
        "calls_per_s": calls / elapsed,
        "direct_calls_per_s": calls / direct_s,
        "proxy_cpu_ms_per_call": (_cpu_s(proxy_pid) - cpu) / calls * 1e3,
    }


async def run(size: ProxyBenchSize, url: str | None, schema: str | None) -> tuple[dict[str, dict[str, float]], list[str]]:
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as workdir:
        store_url = url or f"sqlite:///{workdir}/proxy-bench.db"
        options: dict[str, Any] = {"schema": schema} if schema else {}
        store = SqlLightningStore(store_url, run="proxy-bench", **options)
        results: dict[str, dict[str, float]] = {}
        async with stand_in_process(0.0) as fast_url, stand_in_process(CHUNK_DELAY_S) as slow_url:
            proxy = LLMProxy(
                model_list=[
                    {"model_name": "policy", "litellm_params": {"model": "hosted_vllm/stand-in", "api_base": fast_url}},
                    {"model_name": "policy-slow",
                     "litellm_params": {"model": "hosted_vllm/stand-in", "api_base": slow_url}},
                ],
                store=store, launch_mode="mp",
            )
            await proxy.start()
            # The client's connections are spread over several pools, as the proxy's are (httpcore's
            # pool costs grow with its size: one big pool would measure the client, not the proxy).
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            shards = [httpx.AsyncClient(limits=limits, timeout=60.0, trust_env=False) for _ in range(8)]
            client = shards[0]
            try:
                first = await store.start_rollout(input={"bench": "overhead"})
                base = proxy.as_resource(first.rollout_id, first.attempt.attempt_id, model="policy").endpoint
                results["overhead"] = await overhead(client, fast_url, base, size.overhead_calls)

                stream_rollout = await store.start_rollout(input={"bench": "streams"})
                stream_base = proxy.as_resource(
                    stream_rollout.rollout_id, stream_rollout.attempt.attempt_id, model="policy"
                ).endpoint
                results["streams"] = await streams([_ModelClient(c, "policy-slow") for c in shards], stream_base,
                                                   size.streams)

                attempts = [await store.start_rollout(input={"bench": i}) for i in range(size.record_attempts)]
                endpoints = [
                    proxy.as_resource(r.rollout_id, r.attempt.attempt_id, model="policy").endpoint for r in attempts
                ]
                assert proxy.server_pid is not None
                results["recording"] = await recording(
                    shards, fast_url, endpoints, proxy.server_pid, size.record_calls, size.record_clients
                )
                alone = [await store.start_rollout(input={"bench": f"recorder {i}"}) for i in range(size.record_attempts)]
                results["recorder"] = await recorder_alone(store, alone, size.record_calls, size.record_clients)
            finally:
                await asyncio.gather(*(c.aclose() for c in shards))
                await proxy.stop()
            problems += await _check(store, first.rollout_id, stream_rollout.rollout_id, attempts, size, results)
            problems += await _check_attempts(store, alone, size.record_calls, "recorder")
        await store.close()
    return results, problems


class _ModelClient:
    """An httpx client whose JSON bodies name another model (the stand-in that spaces its chunks)."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self._client, self._model = client, model

    def stream(self, method: str, url: str, json: dict[str, Any]) -> Any:
        return self._client.stream(method, url, json={**json, "model": self._model})


async def _check(
    store: SqlLightningStore, overhead_rid: str, stream_rid: str, attempts: list[Any], size: ProxyBenchSize,
    results: dict[str, dict[str, float]],
) -> list[str]:
    problems = []
    prompt_ids, response_ids = tokenize(PROMPT), tokenize(reply(PROMPT))

    def complete(spans: list[Any]) -> bool:
        return all(s.attributes.get("prompt_token_ids") == prompt_ids
                   and s.attributes.get("response_token_ids") == response_ids for s in spans)

    overhead_spans = _calls(await store.query_spans(overhead_rid))
    if len(overhead_spans) != size.overhead_calls + 10 or not complete(overhead_spans):
        problems.append(f"overhead: {len(overhead_spans)} spans stored for {size.overhead_calls + 10} calls")
    stream_spans = _calls(await store.query_spans(stream_rid))
    if len(stream_spans) != size.streams or not complete(stream_spans):
        problems.append(f"streams: {len(stream_spans)} complete spans stored for {size.streams} streams")
    for key in ("errors", "incomplete"):
        if results["streams"][key]:
            problems.append(f"streams: {int(results['streams'][key])} {key}")
    problems += await _check_attempts(store, attempts, size.record_calls, "recording")
    if results["recording"]["errors"]:
        problems.append(f"recording: {int(results['recording']['errors'])} calls failed")
    return problems


def _calls(spans: Any) -> list[Any]:
    """The calls' own spans (each call with token ids also stores a raw_gen_ai_request child)."""
    return [s for s in spans if s.name != RAW_SPAN_NAME]


async def _check_attempts(store: SqlLightningStore, attempts: list[Any], calls: int, phase: str) -> list[str]:
    """Every call stored once, in its attempt, numbered 1..n, with its token ids."""
    problems = []
    prompt_ids, response_ids = tokenize(PROMPT), tokenize(reply(PROMPT))
    stored = 0
    for r in attempts:
        spans = _calls(await store.query_spans(r.rollout_id, r.attempt.attempt_id))
        stored += len(spans)
        sequence_ids = [s.sequence_id for s in spans]
        complete = all(s.attributes.get("prompt_token_ids") == prompt_ids
                       and s.attributes.get("response_token_ids") == response_ids for s in spans)
        if sequence_ids != list(range(1, len(spans) + 1)) or not complete:
            problems.append(f"{phase}: rollout {r.rollout_id} has sequence ids {sequence_ids[:10]}…")
    if stored != calls:
        problems.append(f"{phase}: {stored} spans stored for {calls} calls")
    return problems


async def recorder_alone(store: SqlLightningStore, attempts: list[Any], calls: int, clients: int) -> dict[str, float]:
    """Calls per second the recorder stores (attribution + span + add_otel_span), without HTTP."""
    recorder = SpanRecorder(lambda: store, "record")
    answer = reply(PROMPT)
    response = {
        "id": "chatcmpl-bench", "model": "stand-in", "prompt_token_ids": tokenize(PROMPT),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer},
                     "token_ids": tokenize(answer)}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11},
    }
    pending = iter(range(calls))

    async def worker() -> None:
        for i in pending:
            target = attempts[i % len(attempts)]
            record = CallRecord(kind="chat", request=_body(), stream=False, status_code=200, response=response)
            record.finish()
            attribution = await recorder.attribute((target.rollout_id, target.attempt.attempt_id))
            assert attribution is not None
            await recorder.record(record, attribution)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return {"calls": calls, "calls_per_s": calls / (time.perf_counter() - started)}


def format_results(results: dict[str, dict[str, float]]) -> str:
    o, s, r = results["overhead"], results["streams"], results["recording"]
    return "\n".join([
        f"overhead   p50 direct {o['direct_p50_ms']:.2f} ms, proxied {o['proxied_p50_ms']:.2f} ms "
        f"(x{o['proxied_p50_ms'] / o['direct_p50_ms']:.2f}), added {o['overhead_p50_ms']:.2f} ms "
        "(p50 of pairwise differences; goal < 2 ms)",
        f"streams    {int(s['streams'])} concurrent: {int(s['errors'])} errors, {int(s['incomplete'])} incomplete, "
        f"{s['wall_s']:.2f} s",
        f"recording  {int(r['calls'])} calls: {r['calls_per_s']:.0f} calls/s recorded (goal >= 1000 on SQLite); "
        f"the stand-in alone answers {r['direct_calls_per_s']:.0f} calls/s "
        f"(x{r['calls_per_s'] / r['direct_calls_per_s']:.2f}); proxy CPU "
        f"{r['proxy_cpu_ms_per_call']:.2f} ms per call (capacity of one core: "
        f"{1e3 / max(r['proxy_cpu_ms_per_call'], 1e-9):.0f} calls/s)",
        f"recorder   alone (no HTTP): {results['recorder']['calls_per_s']:.0f} calls/s stored",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--url", help="store URL (default: a temporary SQLite file)")
    parser.add_argument("--schema", help="PostgreSQL schema for --url")
    args = parser.parse_args(argv)
    results, problems = asyncio.run(run(SIZES[args.size], args.url, args.schema))
    print(format_results(results))
    for problem in problems:
        print(f"CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
