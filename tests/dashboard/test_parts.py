"""The dashboard's pure parts: span trees, LLM-call extraction, rewards, diffs, charts, escaping."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_sql.server.dashboard import charts
from lightning_sql.server.dashboard.diffs import resource_lines, side_by_side
from lightning_sql.server.dashboard.rendering import fmt_duration, make_environment, visible
from lightning_sql.server.dashboard.traces import build_tree, llm_call, rewards_of


def row(pk: int, span_id: str, parent: str | None, name: str = "s", **attrs: Any) -> SimpleNamespace:
    return SimpleNamespace(
        id=pk, sequence_id=pk, span_id=span_id, parent_id=parent, name=name, status_code="OK",
        start_time=float(pk), end_time=float(pk) + 1, attributes=attrs,
    )


def test_tree_orders_depth_first_and_survives_orphans_and_cycles() -> None:
    rows = [row(1, "a", None), row(2, "b", "a"), row(3, "c", "b"), row(4, "d", "a"), row(5, "e", "missing"),
            row(6, "x", "y"), row(7, "y", "x")]
    roots, ordered = build_tree(rows)
    assert [n.span_id for n in ordered][:5] == ["a", "b", "c", "d", "e"]
    assert [n.depth for n in ordered][:5] == [0, 1, 2, 1, 0]
    assert {n.span_id for n in ordered} == {"a", "b", "c", "d", "e", "x", "y"}
    assert len(ordered) == 7
    assert [r.span_id for r in roots] == ["a", "e"]


def test_llm_call_reads_indexed_and_json_messages_and_token_ids() -> None:
    indexed = llm_call({
        "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi",
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "hello",
        "prompt_token_ids": [1, 2], "response_token_ids": "[3, 4]", "gen_ai.usage.prompt_tokens": 2,
        "gen_ai.request.model": "m",
    })
    assert indexed.prompt == [{"role": "user", "content": "hi"}]
    assert indexed.response == [{"role": "assistant", "content": "hello"}]
    assert indexed.prompt_token_ids == [1, 2] and indexed.response_token_ids == [3, 4]
    assert indexed.usage == {"prompt_tokens": 2} and indexed.model == "m"
    as_json = llm_call({"gen_ai.input.messages": '[{"role": "user", "content": "q"}]',
                        "gen_ai.output.messages": "not json"})
    assert as_json.prompt == [{"role": "user", "content": "q"}]
    assert as_json.response == [] and as_json.prompt_token_ids is None


def test_rewards_of_annotation_and_legacy_spans() -> None:
    attrs = {"agentlightning.reward.1.value": 2.0, "agentlightning.reward.0.value": 0.5,
             "agentlightning.reward.0.name": "acc"}
    assert rewards_of("agentlightning.annotation", attrs) == [("acc", 0.5), ("reward 1", 2.0)]
    assert rewards_of("agentlightning.reward", {"reward": 1}) == [("reward", 1)]
    assert rewards_of("tool", attrs) == []


def test_diff_lines_split_multiline_strings_and_pair_changes() -> None:
    left = resource_lines({"p": {"template": "a\nb\nc", "engine": "jinja"}})
    right = resource_lines({"p": {"template": "a\nB\nc\nd", "engine": "jinja"}})
    assert left == ["[p]", '  engine: "jinja"', "  template:", "    a", "    b", "    c"]
    kinds = [(r.kind, r.left, r.right) for r in side_by_side(left, right) if r.kind != "same"]
    assert kinds == [("changed", "    b", "    B"), ("added", "", "    d")]
    assert resource_lines([1, 2]) == ["[", "  1,", "  2", "]"]


def test_status_bars_stack_to_the_counts() -> None:
    chart = charts.stacked_status_bars({(0, "succeeded"): 3, (0, "failed"): 1, (2, "queuing"): 2}, 4, 0.0, 10.0)
    assert chart.legend == ["queuing", "succeeded", "failed"]
    first = [r for r in chart.rects if r.x < charts.PAD_LEFT + 10]
    assert sum(r.h for r in first) == pytest.approx(
        (charts.HEIGHT - charts.PAD_TOP - charts.PAD_BOTTOM) * 4 / charts._nice_max(4)  # noqa: SLF001
    )
    assert {(r.label, r.value) for r in chart.rects} == {("succeeded", 3), ("failed", 1), ("queuing", 2)}
    assert charts.stacked_status_bars({}, 4, 0.0, 1.0).empty


def test_lanes_place_items_on_one_axis() -> None:
    lanes, t0, total = charts.lanes([("a", "a", "x", 10.0, 20.0, 0), ("b", "b", "x", 15.0, None, 1)], now=18.0)
    assert t0 == 10.0 and total == 10.0
    assert (lanes[0].left, lanes[0].width) == (0.0, 1.0)
    assert lanes[1].left == pytest.approx(0.5) and lanes[1].open_ended


def test_visible_writes_out_controls_and_bidi_overrides() -> None:
    assert visible("a\x1b[31mb\u202ec\td\n") == "a\\x1b[31mb\\u202ec\td\n"
    assert visible("עברית") == "עברית"
    env = make_environment()
    out = env.from_string("<p>{{ x }}</p>").render(x="<script>alert(1)</script>\x07")
    assert out == "<p>&lt;script&gt;alert(1)&lt;/script&gt;\\x07</p>"


@pytest.mark.parametrize(("seconds", "text"), [(0.25, "250 ms"), (3.0, "3.0 s"), (125, "2 min 5 s"), (None, "—")])
def test_durations(seconds: float | None, text: str) -> None:
    assert fmt_duration(seconds) == text
