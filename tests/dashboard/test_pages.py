"""Every dashboard page over HTTP (uvicorn on a loopback port), on SQLite and PostgreSQL."""

from __future__ import annotations

import html
import re

import httpx
import pytest
from sqlalchemy import delete, text

from lightning_sql.server.dashboard import Dashboard
from lightning_sql.server.dashboard.rendering import visible
from lightning_sql.store.sql.schema import rollouts
from tests.dashboard.conftest import Served, serve
from tests.dashboard.seed import (
    DEMO_RUN,
    HOSTILE,
    PROMPT_TOKEN_IDS,
    RESPONSE_TOKEN_IDS,
    TEMPLATE_V1,
    TEMPLATE_V2,
)

SHOWN_HOSTILE = html.escape(visible(HOSTILE), quote=False)


def get(served: Served, path: str, status: int = 200) -> str:
    response = httpx.get(served.url(path), timeout=30)
    assert response.status_code == status, response.text[:2000]
    assert response.headers["content-type"].startswith("text/html")
    return response.text


def run_ids(served: Served) -> dict[str, int]:
    page = get(served, "/")
    found = re.findall(r'<tr data-run-id="(\d+)">\s*<td class="name"><a href="/runs/\d+"><bdi>(.*?)</bdi>', page, re.S)
    return {html.unescape(name): int(rid) for rid, name in found}


def data_values(page: str, attribute: str) -> list[str]:
    return re.findall(rf'{attribute}="([^"]*)"', page)


def test_runs_page_lists_runs_with_counts(served: Served) -> None:
    page = get(served, "/")
    ids = run_ids(served)
    assert set(ids) == {DEMO_RUN, html.unescape(SHOWN_HOSTILE)}
    row = page[page.index(f'data-run-id="{ids[DEMO_RUN]}"') :]
    row = row[: row.index("</tr>")]
    assert 'data-total="8"' in row
    for status, n in (("succeeded", 6), ("failed", 1), ("queuing", 1)):
        assert f'data-status="{status}" data-count="{n}"' in row
    assert "data-live-interval" in page  # the demo run still has a queued rollout


def test_run_page_figures_and_charts(served: Served) -> None:
    run_id = run_ids(served)[DEMO_RUN]
    page = get(served, f"/runs/{run_id}")
    assert 'data-stat="total">8<' in page
    assert 'data-stat="succeeded">6<' in page
    status_chart = page[page.index('id="chart-status"') : page.index('id="chart-reward"')]
    per_status: dict[str, float] = {}
    for label, value in re.findall(r'data-label="([^"]+)" data-value="([^"]+)"', status_chart):
        per_status[label] = per_status.get(label, 0) + float(value)
    assert per_status == {"succeeded": 6, "failed": 1, "queuing": 1}
    reward_chart = page[page.index('id="chart-reward"') : page.index('id="chart-version"')]
    series = dict(re.findall(r'data-series="([^"]+)">(.*?)</g>', reward_chart, re.S))
    assert set(series) == {"train", "val"}
    train = [(float(v), int(n)) for v, n in re.findall(r'data-value="([^"]+)" data-count="(\d+)"', series["train"])]
    val = [(float(v), int(n)) for v, n in re.findall(r'data-value="([^"]+)" data-count="(\d+)"', series["val"])]
    assert sum(v * n for v, n in train) / sum(n for _v, n in train) == pytest.approx(0.5)
    assert sum(v * n for v, n in val) / sum(n for _v, n in val) == pytest.approx(0.9)
    version_chart = page[page.index('id="chart-version"') : page.index('id="version-table"')]
    bars = {label: float(v) for label, v in re.findall(r'data-label="([^"]+)" data-value="([^"]+)"', version_chart)}
    assert bars == {"v1": pytest.approx(0.5), "v2": pytest.approx(0.9)}
    failures = page[page.index('id="failures"') : page.index('id="workers"')]
    assert 'data-kind="ValueError"' in failures
    assert 'data-count="1"' in failures
    assert served.seeded.failed_rollout in failures
    assert "bad input: boom" in failures
    workers = page[page.index('id="workers"') :]
    assert "worker-1" in workers and "worker-2" in workers


def test_rollouts_table_filters_sorts_and_pages(served: Served) -> None:
    run_id = run_ids(served)[DEMO_RUN]
    base = f"/runs/{run_id}/rollouts"

    def ids(query: str) -> list[str]:
        return data_values(get(served, base + query), "data-rollout-id")

    all_ids = ids("")
    assert len(all_ids) == 8
    assert all_ids[0] == served.seeded.queued_rollout  # newest first
    assert ids("?order=asc") == list(reversed(all_ids))
    assert ids("?status=failed") == [served.seeded.failed_rollout]
    assert len(ids("?mode=val")) == 2
    assert len(ids("?version=1")) == 4
    assert ids("?q=boom") == [served.seeded.failed_rollout]
    assert ids("?q=" + served.seeded.llm_rollout[3:9]) == [served.seeded.llm_rollout]
    assert ids("?status=succeeded&mode=val&version=2") == served.seeded.demo_rollouts[4:6][::-1]
    assert ids("?page=2") == []
    assert 'data-total="8"' in get(served, base)
    rewards = data_values(get(served, base + "?mode=train&status=succeeded"), "data-reward")
    assert sorted(float(r) for r in rewards) == [0.0, 0.5, 0.5, 1.0]
    for order in ("asc", "desc"):  # the unfinished ones last, in either direction, on both backends
        assert set(ids(f"?sort=end&order={order}")[-1:]) == {served.seeded.queued_rollout}
    by_attempts = ids("?sort=attempts&order=asc")
    assert by_attempts[0] == served.seeded.queued_rollout  # no attempt yet


@pytest.mark.parametrize(
    "query", ["?status=nope", "?mode=<b>", "?page=0", "?page=x", "?sort=secret", "?order=sideways", "?version=v2", "?q=" + "x" * 201]
)
def test_rollouts_table_rejects_bad_parameters(served: Served, query: str) -> None:
    run_id = run_ids(served)[DEMO_RUN]
    page = get(served, f"/runs/{run_id}/rollouts{query}", status=400)
    assert "Traceback" not in page


def test_rollout_page_shows_attempts_spans_and_reward(served: Served) -> None:
    run_id = run_ids(served)[DEMO_RUN]
    page = get(served, f"/runs/{run_id}/rollouts/{served.seeded.llm_rollout}")
    assert 'id="final-reward" data-value="0.0"' in page
    assert "&#34;question&#34;: &#34;q0&#34;" in page or "&quot;question&quot;: &quot;q0&quot;" in page
    names = re.findall(r'data-depth="(\d)"[^>]*>\s*<summary role="row">.*?<bdi>(.*?)</bdi>', page, re.S)
    assert names == [("0", "agent.run"), ("1", "openai.chat.completion"), ("1", "agentlightning.annotation")]
    assert page.count('class="mark reward"') == 1
    assert "accuracy = 0" in page
    assert len(data_values(page, "data-attempt-id")) == 1
    assert '<span class="k">Priority</span><span class="v">0</span>' in page
    assert 'id="not-before"' not in page  # never in back-off


def test_failed_rollout_page_shows_the_error(served: Served) -> None:
    run_id = run_ids(served)[DEMO_RUN]
    page = get(served, f"/runs/{run_id}/rollouts/{served.seeded.failed_rollout}")
    assert "ValueError" in page and "bad input: boom" in page and "Traceback..." in page
    assert "No span recorded." in page


def test_span_page_shows_llm_call_and_token_ids(served: Served) -> None:
    run_id = run_ids(served)[DEMO_RUN]
    rollout = get(served, f"/runs/{run_id}/rollouts/{served.seeded.llm_rollout}")
    pks = data_values(rollout, "data-span-pk")
    page = get(served, f"/runs/{run_id}/spans/{pks[1]}")
    assert '<bdi>openai.chat.completion</bdi>' in page
    assert "What is 2+2?" in page and "You are helpful." in page
    assert f'id="prompt-token-ids">{" ".join(map(str, PROMPT_TOKEN_IDS))}<' in page
    assert f'id="response-token-ids">{" ".join(map(str, RESPONSE_TOKEN_IDS))}<' in page
    reward = get(served, f"/runs/{run_id}/spans/{pks[2]}")
    assert 'data-reward="0.0"' in reward
    assert 'id="llm-call"' not in reward


def test_resources_history_and_diff(served: Served) -> None:
    run_id = run_ids(served)[DEMO_RUN]
    page = get(served, f"/runs/{run_id}/resources")
    assert data_values(page, "data-version") == ["2", "1"]
    diff = page[page.index('id="diff"') :]
    removed = [html.unescape(t) for t in re.findall(r'<td class="l"><bdi>(.*?)</bdi>', diff)]
    added = [html.unescape(t) for t in re.findall(r'<td class="r"><bdi>(.*?)</bdi>', diff)]
    for line in TEMPLATE_V1.splitlines():
        assert f"    {line}" in removed
    for line in TEMPLATE_V2.splitlines():
        assert f"    {line}" in added
    assert diff.count('class="d-changed"') == 2
    same = get(served, f"/runs/{run_id}/resources?id={served.seeded.resources_id}&a=1&b=1")
    assert 'class="d-changed"' not in same
    get(served, f"/runs/{run_id}/resources?id={served.seeded.resources_id}&a=1&b=7", status=404)
    get(served, f"/runs/{run_id}/resources?id=rs-missing", status=404)
    get(served, f"/runs/{run_id}/resources?id={served.seeded.resources_id}&a=x", status=400)


def test_hostile_names_are_text_everywhere(served: Served) -> None:
    run_id = run_ids(served)[html.unescape(SHOWN_HOSTILE)]
    rollout = get(served, f"/runs/{run_id}/rollouts/{served.seeded.hostile_rollout}")
    span_pk = data_values(rollout, "data-span-pk")[0]
    pages = [
        get(served, "/"),
        get(served, f"/runs/{run_id}"),
        get(served, f"/runs/{run_id}/rollouts"),
        rollout,
        get(served, f"/runs/{run_id}/spans/{span_pk}"),
        get(served, f"/runs/{run_id}/resources"),
    ]
    for page in pages:
        assert "<script>window" not in page
        assert "\x1b" not in page and "\u202e" not in page
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page
        assert page.count("<script") == 1  # the dashboard's own script tag only
    assert "\\x1b[31mred" in pages[1] and "\\u202eevil\\u202c" in pages[1] and "עברית" in pages[1]


def test_unknown_things_are_404_pages(served: Served) -> None:
    run_id = run_ids(served)[DEMO_RUN]
    for path in ("/runs/999", "/runs/99999999999", f"/runs/{run_id}/spans/99999999999999999999",
                 f"/runs/{run_id}/rollouts/ro-missing", f"/runs/{run_id}/spans/999999",
                 f"/runs/{run_id}/rollouts/{served.seeded.llm_rollout}?attempt=at-missing"):
        page = get(served, path, status=404)
        assert "Traceback" not in page
    other = run_ids(served)[html.unescape(SHOWN_HOSTILE)]
    # A span of another run is not shown under this one.
    pk = data_values(get(served, f"/runs/{run_id}/rollouts/{served.seeded.llm_rollout}"), "data-span-pk")[0]
    get(served, f"/runs/{other}/spans/{pk}", status=404)


def test_static_assets_are_served(served: Served) -> None:
    css = httpx.get(served.url("/static/dashboard/dashboard.css"), timeout=30)
    js = httpx.get(served.url("/static/dashboard/dashboard.js"), timeout=30)
    assert css.status_code == js.status_code == 200
    assert ".waterfall" in css.text and "DOMParser" in js.text


async def test_the_dashboard_cannot_write(served: Served) -> None:
    dashboard = Dashboard(served.backend.url, schema=served.backend.schema)
    try:
        with pytest.raises(Exception, match="(?i)read.?only|readonly"):
            await dashboard.db.rows(text("CREATE TABLE dashboard_probe (x INTEGER)"))
        with pytest.raises(Exception, match="(?i)read.?only|readonly"):
            await dashboard.db.rows(delete(rollouts))
    finally:
        await dashboard.shutdown()
    assert len(data_values(get(served, f"/runs/{run_ids(served)[DEMO_RUN]}/rollouts"), "data-rollout-id")) == 8


def test_an_unreachable_database_is_a_503_page() -> None:
    dashboard = Dashboard("postgresql://nobody@127.0.0.1:1/none")
    with serve(dashboard) as base:
        response = httpx.get(base + "/", timeout=30)
    assert response.status_code == 503
    assert "did not answer" in response.text and "Traceback" not in response.text


def test_urls_the_dashboard_cannot_read_are_refused() -> None:
    with pytest.raises(ValueError, match="in-memory"):
        Dashboard("sqlite://")
    with pytest.raises(ValueError, match="No SQLite database"):
        Dashboard("sqlite:////nonexistent/dir/store.db")
