"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright.

Setup: ``apt-get install -y chromium`` and ``pip install playwright`` (the browser is the system's,
never a download).  Without them these tests skip, unless ``LIGHTNING_SQL_REQUIRE_BROWSER=1`` (CI),
where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.server.dashboard.rendering import visible
from tests.dashboard.conftest import Served
from tests.dashboard.seed import DEMO_RUN, HOSTILE, PROMPT_TOKEN_IDS, reward_span

CHROMIUM = os.environ.get("LIGHTNING_SQL_CHROMIUM", "/usr/bin/chromium")
REQUIRE_BROWSER = os.environ.get("LIGHTNING_SQL_REQUIRE_BROWSER") == "1"


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        return f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    return None


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    """A fresh headless Chromium page; a dialog (an ``alert`` run by stored text) or a script error
    fails the test."""
    missing = _browser_missing()
    if missing:
        if REQUIRE_BROWSER:
            pytest.fail(f"LIGHTNING_SQL_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        page = await context.new_page()
        dialogs: list[str] = []
        errors: list[str] = []

        async def on_dialog(dialog: Any) -> None:
            dialogs.append(dialog.message)
            await dialog.dismiss()

        page.on("dialog", on_dialog)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(20_000)
        yield page
        await browser.close()
    assert dialogs == [], dialogs
    assert errors == [], errors


async def chart_values(page: Any, chart_id: str, selector: str) -> list[tuple[str, float]]:
    return await page.eval_on_selector_all(
        f"#{chart_id} {selector}",
        "els => els.map(e => [e.getAttribute('data-label') || e.closest('g').getAttribute('data-series'),"
        " parseFloat(e.getAttribute('data-value'))])",
    )


async def text_of(page: Any, selector: str) -> str:
    return str(await page.locator(selector).inner_text())


async def test_click_through_runs_run_rollout_span(served: Served, page: Any) -> None:
    await page.goto(served.base + "/")
    await page.get_by_role("link", name=DEMO_RUN, exact=True).click()
    await page.wait_for_url(re.compile(r"/runs/\d+$"))
    assert (await text_of(page, "h1")).startswith(DEMO_RUN)

    # The status chart draws one rectangle per (interval, status): its numbers add up to the counts.
    totals: dict[str, float] = {}
    for status, value in await chart_values(page, "chart-status", "rect"):
        totals[status] = totals.get(status, 0) + value
    assert totals == {"succeeded": 6, "failed": 1, "queuing": 1}
    assert (await page.locator("#chart-status rect").first.bounding_box())["height"] > 0
    bars = dict(await chart_values(page, "chart-version", "rect"))
    assert bars == {"v1": pytest.approx(0.5), "v2": pytest.approx(0.9)}
    points = await chart_values(page, "chart-reward", "circle")
    assert {series for series, _v in points} == {"train", "val"}
    # Hovering a bar shows its figure.
    assert await page.locator("#chart-version rect").first.locator("title").text_content() == "v1: 0.5"

    await page.get_by_role("link", name="Rollouts", exact=True).first.click()
    await page.wait_for_url(re.compile(r"/rollouts$"))
    assert await page.locator("#rollout-table tbody tr").count() == 8
    await page.select_option("select[name=status]", "failed")
    await page.get_by_role("button", name="Filter").click()
    await page.wait_for_url(re.compile(r"status=failed"))
    assert await page.locator("#rollout-table tbody tr").count() == 1
    await page.go_back()
    await page.get_by_role("link", name=served.seeded.llm_rollout).click()
    await page.wait_for_url(re.compile(served.seeded.llm_rollout))

    rows = page.locator(".span-row")
    assert await rows.count() == 3
    assert await text_of(page, "#final-reward") == "0"
    reward_row = page.locator(".span-row[data-reward]")
    assert await reward_row.count() == 1
    assert "accuracy = 0" in await reward_row.inner_text()
    # The waterfall bar of the LLM call sits inside the root's bar.
    root_box = await rows.nth(0).locator(".bar").bounding_box()
    llm_box = await rows.nth(1).locator(".bar").bounding_box()
    assert root_box["x"] <= llm_box["x"]
    assert llm_box["x"] + llm_box["width"] <= root_box["x"] + root_box["width"] + 1
    await rows.nth(1).locator("summary").click()
    assert await rows.nth(1).locator(".attrs").is_visible()
    assert "gen_ai.request.model" in await rows.nth(1).locator(".attrs").inner_text()
    await rows.nth(1).get_by_role("link", name="Open span").click()
    await page.wait_for_url(re.compile(r"/spans/\d+$"))
    assert await text_of(page, "#span-name") == "openai.chat.completion"
    assert await text_of(page, "#prompt-token-ids") == " ".join(map(str, PROMPT_TOKEN_IDS))
    assert "What is 2+2?" in await text_of(page, "#llm-call")


async def test_resources_diff_side_by_side(served: Served, page: Any) -> None:
    await page.goto(served.base + "/")
    await page.get_by_role("link", name=DEMO_RUN, exact=True).click()
    await page.get_by_role("link", name="Resources", exact=True).click()
    await page.wait_for_selector("#diff")
    assert await page.locator("#diff tr.d-changed").count() == 2
    left = await page.locator("#diff tr.d-changed td.l").first.inner_text()
    right = await page.locator("#diff tr.d-changed td.r").first.inner_text()
    assert left.strip() == "You are helpful." and right.strip() == "You are very helpful."
    await page.select_option("select[name=a]", "2")
    await page.get_by_role("button", name="Compare").click()
    await page.wait_for_url(re.compile(r"a=2"))
    assert await page.locator("#diff tr.d-changed").count() == 0


async def test_hostile_names_are_shown_as_text(served: Served, page: Any) -> None:
    shown = visible(HOSTILE)
    await page.goto(served.base + "/")
    link = page.locator("td.name a").filter(has_text="window.__pwned")
    assert await link.inner_text() == shown
    await link.click()
    await page.wait_for_url(re.compile(r"/runs/\d+$"))
    assert await text_of(page, "h1 bdi") == shown
    assert await text_of(page, "#failures td.name") == shown
    assert await text_of(page, "#workers td.name") == shown
    await page.get_by_role("link", name="Rollouts", exact=True).first.click()
    await page.locator("#rollout-table td.name a").first.click()
    await page.wait_for_url(re.compile(r"/rollouts/ro-"))
    assert await text_of(page, ".span-row .span-name bdi") == shown
    shown_input = await text_of(page, "#input pre")  # JSON: the ESC is \u001b there, quotes escaped
    assert '"question": "<script>window.__pwned=1</script> [/] \\u202eevil\\u202c עברית \\u001b[31m' in shown_input
    await page.locator(".span-row summary").click()
    await page.get_by_role("link", name="Open span").click()
    await page.wait_for_url(re.compile(r"/spans/\d+$"))
    assert await text_of(page, "#span-name") == shown
    assert await text_of(page, "#attributes th") == shown
    for url in (page.url, served.base + "/"):
        await page.goto(url)
        assert await page.evaluate("window.__pwned") is None
        assert await page.evaluate("document.scripts.length") == 1


async def test_a_running_run_page_updates_itself(served: Served, page: Any) -> None:
    await page.goto(served.base + "/")
    await page.get_by_role("link", name=DEMO_RUN, exact=True).click()
    await page.wait_for_url(re.compile(r"/runs/\d+$"))
    assert await text_of(page, "[data-stat=succeeded]") == "6"
    assert await text_of(page, "#live-toggle") == "live"

    opts: dict[str, Any] = {"clock": served.clock, "clock_sync": False}
    if served.backend.schema:
        opts["schema"] = served.backend.schema
    store = SqlLightningStore(served.backend.url, run=DEMO_RUN, **opts)
    try:
        claimed = await store.dequeue_rollout(worker_id="worker-3")
        assert claimed is not None and claimed.rollout_id == served.seeded.queued_rollout
        t = served.clock.advance(1.0)
        await store.add_span(reward_span(claimed.rollout_id, claimed.attempt.attempt_id, 1, 0.25, t))
        await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
    finally:
        await store.close()

    await page.wait_for_function(
        "document.querySelector('[data-stat=succeeded]').textContent === '7'", timeout=30_000
    )
    assert await page.locator("[data-stat=queuing]").count() == 0
    # Nothing is in flight any more: the page stops polling.
    await page.wait_for_function("document.getElementById('live-toggle').textContent === 'done'", timeout=30_000)
