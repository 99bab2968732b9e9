"""Screenshots of the dashboard's main pages for docs/dashboard.md (docs/images/dashboard-*.png).

    python scripts/dashboard_screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

Seeds a demonstration store (a training run over three prompt versions, with failures, workers
and LLM calls) in a temporary SQLite file through the public store API, serves the dashboard on a
loopback port and photographs each page with headless Chromium (Playwright, system browser).
Needs the ``server`` and ``browser`` extras and Debian's ``chromium``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_sql import (  # noqa: E402
    OtelResource,
    PromptTemplate,
    Span,
    SpanContext,
    SqlLightningStore,
    TraceStatus,
)
from lightning_sql.server.dashboard import Dashboard  # noqa: E402

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC
PROMPTS = (
    "You are a math tutor.\nSolve: {question}\nAnswer with a number.",
    "You are a careful math tutor.\nThink step by step.\nSolve: {question}\nAnswer with a number.",
    "You are a careful math tutor.\nThink step by step, then check your work.\nSolve: {question}\n"
    "End with 'Answer: <number>'.",
)
MEAN_REWARD = (0.38, 0.57, 0.74)


class Clock:
    """The store's clock for the demonstration: moved by hand, so the pictures do not depend on today."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def _span(rid: str, aid: str, seq: int, name: str, start: float, end: float, trace: str, *,
          span_id: str | None = None, parent: str | None = None, attributes: dict[str, Any] | None = None) -> Span:
    span_id = span_id or secrets.token_hex(8)
    return Span(
        rollout_id=rid, attempt_id=aid, sequence_id=seq, trace_id=trace, span_id=span_id, parent_id=parent,
        name=name, status=TraceStatus(status_code="OK"), attributes=attributes or {}, events=[], links=[],
        start_time=start, end_time=end,
        context=SpanContext(trace_id=trace, span_id=span_id, is_remote=False, trace_state={}), parent=None,
        resource=OtelResource(attributes={"service.name": "math-agent"}, schema_url=""),
    )


async def _rollout(store: SqlLightningStore, clock: Clock, rng: random.Random, worker: str, version: int) -> None:
    claimed = await store.dequeue_rollout(worker_id=worker)
    assert claimed is not None
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    question = claimed.input["question"] if isinstance(claimed.input, dict) else "?"
    t = clock.advance(0.5)
    trace, root = secrets.token_hex(16), secrets.token_hex(8)
    spans = [_span(rid, aid, 1, "math_agent.run", t, t + 3.2, trace, span_id=root, attributes={"agent.name": "math"})]
    roll = rng.random()
    if roll < 0.06:
        await store.add_many_spans(spans)
        clock.advance(1.5)
        await store.update_attempt(rid, aid, status="failed", metadata={"error": {
            "type": "ValueError", "message": f"could not parse an answer from {question!r}",
            "traceback": "Traceback (most recent call last):\n  File \"agent.py\", line 42, in rollout\n"
                         "ValueError: could not parse an answer"}})
        return
    if roll < 0.09:
        clock.advance(2.0)
        await store.update_attempt(rid, aid, status="failed", metadata={"error": {
            "type": "TimeoutError", "message": "the model did not answer within 30 s", "traceback": "TimeoutError"}})
        return
    answer = str(rng.randint(2, 99))
    prompt_ids = [rng.randint(100, 32000) for _ in range(rng.randint(12, 24))]
    spans.append(_span(rid, aid, 2, "openai.chat.completion", t + 0.1, t + 2.6, trace, parent=root, attributes={
        "gen_ai.system": "openai", "gen_ai.request.model": "qwen2.5-1.5b-instruct",
        "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": PROMPTS[version - 1].split("\n")[0],
        "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": f"Solve: {question}",
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": f"Let me compute. Answer: {answer}",
        "gen_ai.usage.prompt_tokens": len(prompt_ids), "gen_ai.usage.completion_tokens": 7,
        "prompt_token_ids": prompt_ids, "response_token_ids": [rng.randint(100, 32000) for _ in range(7)],
    }))
    spans.append(_span(rid, aid, 3, "tool.calculator", t + 2.65, t + 2.8, trace, parent=root,
                       attributes={"tool.input": question, "tool.output": answer}))
    reward = min(1.0, max(0.0, rng.gauss(MEAN_REWARD[version - 1], 0.18)))
    spans.append(_span(rid, aid, 4, "agentlightning.annotation", t + 3.0, t + 3.01, trace, parent=root,
                       attributes={"agentlightning.reward.0.name": "exact_match",
                                   "agentlightning.reward.0.value": round(reward, 3)}))
    await store.add_many_spans(spans)
    clock.advance(3.0)
    await store.update_attempt(rid, aid, status="succeeded")


async def seed_demo(url: str, clock: Clock) -> None:
    rng = random.Random(3)
    store = SqlLightningStore(url, run="math-agent", clock=clock, clock_sync=False)
    try:
        resources = await store.add_resources({"prompt": PromptTemplate(template=PROMPTS[0], engine="f-string")})
        for version in (1, 2, 3):
            if version > 1:
                await store.update_resources(
                    resources.resources_id, {"prompt": PromptTemplate(template=PROMPTS[version - 1], engine="f-string")}
                )
            for i in range(70):
                mode = "val" if i % 5 == 4 else "train"
                a, b = rng.randint(2, 60), rng.randint(2, 40)
                await store.enqueue_rollout(input={"question": f"{a} + {b}"}, mode=mode)
                await _rollout(store, clock, rng, f"runner-{i % 4}", version)
                clock.advance(rng.uniform(4, 14))
        for i in range(6):
            await store.enqueue_rollout(input={"question": f"{i} * 7"}, mode="train")
        for worker in ("runner-0", "runner-1"):
            claimed = await store.dequeue_rollout(worker_id=worker)
            assert claimed is not None
            await store.add_span(_span(claimed.rollout_id, claimed.attempt.attempt_id, 1, "math_agent.run",
                                       clock.now, clock.now + 1.0, secrets.token_hex(16)))
    finally:
        await store.close()
    baseline_clock = Clock(T0 - 86400)
    baseline = SqlLightningStore(url, run="math-agent-baseline", clock=baseline_clock, clock_sync=False)
    try:
        for i in range(12):
            baseline_clock.advance(30.0)
            await baseline.enqueue_rollout(input={"question": f"{i} + 1"}, mode="val")
            claimed = await baseline.dequeue_rollout(worker_id="runner-0")
            assert claimed is not None
            await baseline.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
    finally:
        await baseline.close()


@contextlib.contextmanager
def serve(dashboard: Dashboard) -> Iterator[str]:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await dashboard.shutdown()

    server = uvicorn.Server(uvicorn.Config(Starlette(routes=dashboard.routes, lifespan=lifespan),
                                           host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the dashboard did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def photograph(base: str, out: Path, chromium: str) -> list[Path]:
    from playwright.sync_api import sync_playwright

    shots: list[Path] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 860}, device_scale_factor=1)

        def shot(name: str, full_page: bool = True, height: int | None = None) -> None:
            path = out / f"dashboard-{name}.png"
            clip = {"x": 0, "y": 0, "width": 1280, "height": height} if height else None
            page.screenshot(path=str(path), full_page=full_page and clip is None, clip=clip)
            shots.append(path)

        page.goto(base + "/")
        shot("runs", height=300)
        page.get_by_role("link", name="math-agent", exact=True).click()
        page.wait_for_selector("#chart-status")
        shot("run")
        page.get_by_role("link", name="Rollouts", exact=True).first.click()
        page.wait_for_selector("#rollout-table")
        shot("rollouts", full_page=False)
        page.locator("#rollout-table tbody tr", has=page.locator(".badge.s-succeeded")).first.locator("td.name a").click()
        page.wait_for_selector(".span-row")
        page.locator(".span-row").nth(1).locator("summary").click()
        shot("rollout")
        page.locator(".span-row").nth(1).get_by_role("link", name="Open span").click()
        page.wait_for_selector("#llm-call")
        shot("span")
        page.goto(page.url.split("/spans/")[0] + "/resources")
        page.wait_for_selector("#diff")
        page.select_option("select[name=a]", "1")
        page.get_by_role("button", name="Compare").click()
        page.wait_for_url("**a=1**")
        shot("resources", height=480)
        browser.close()
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "images")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'demo.db'}"
        clock = Clock(T0)
        asyncio.run(seed_demo(url, clock))
        dashboard = Dashboard(url, clock=lambda: clock.now + 20.0)
        with serve(dashboard) as base:
            for path in photograph(base, args.out, args.chromium):
                print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
