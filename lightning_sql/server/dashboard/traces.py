"""An attempt's spans as the rollout page shows them: a tree in sequence order, LLM calls with their
messages and token ids, reward spans with their values (the conventions of ``docs/schema.md``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_sql.runtime.adapter import indexed_messages
from lightning_sql.store.sql.views import LLM_CALL_SPAN_NAME, REWARD_KEY_PREFIX, REWARD_SPAN_NAME

_REWARD_VALUE = re.compile(re.escape(REWARD_KEY_PREFIX) + r"(\d+)\.value$")
_LEGACY_REWARD_SPAN = "agentlightning.reward"


@dataclass
class SpanNode:
    pk: int
    sequence_id: int
    span_id: str
    parent_id: str | None
    name: str
    status_code: str
    start_time: float | None
    end_time: float | None
    attributes: Mapping[str, Any]
    depth: int = 0
    children: list[SpanNode] = field(default_factory=list)

    @property
    def rewards(self) -> list[tuple[str, Any]]:
        return rewards_of(self.name, self.attributes)

    @property
    def is_llm_call(self) -> bool:
        return is_llm_call(self.name, self.attributes)

    @property
    def duration(self) -> float | None:
        if self.start_time is None or self.end_time is None:
            return None
        return self.end_time - self.start_time


def rewards_of(name: str, attributes: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(dimension name, value) of every reward a span carries."""
    out: list[tuple[int, str, Any]] = []
    if name == REWARD_SPAN_NAME:
        for key, value in attributes.items():
            m = _REWARD_VALUE.match(key)
            if m:
                dim = int(m.group(1))
                label = attributes.get(f"{REWARD_KEY_PREFIX}{dim}.name") or f"reward {dim}"
                out.append((dim, str(label), value))
    elif name == _LEGACY_REWARD_SPAN and "reward" in attributes:
        out.append((0, "reward", attributes["reward"]))
    return [(label, value) for _d, label, value in sorted(out, key=lambda t: t[0])]


def is_llm_call(name: str, attributes: Mapping[str, Any]) -> bool:
    return LLM_CALL_SPAN_NAME in name or any(key.startswith("gen_ai.") for key in attributes)


def build_tree(rows: Sequence[Any]) -> tuple[list[SpanNode], list[SpanNode]]:
    """The roots of the span forest, and every node in display order (depth-first, children in
    sequence order).  A span whose parent is not among ``rows`` is a root."""
    nodes = [
        SpanNode(
            pk=row.id,
            sequence_id=row.sequence_id,
            span_id=row.span_id,
            parent_id=row.parent_id,
            name=row.name,
            status_code=row.status_code,
            start_time=row.start_time,
            end_time=row.end_time,
            attributes=row.attributes if isinstance(row.attributes, Mapping) else {},
        )
        for row in rows
    ]
    by_id: dict[str, SpanNode] = {}
    for node in nodes:
        by_id.setdefault(node.span_id, node)
    roots: list[SpanNode] = []
    for node in nodes:
        parent = by_id.get(node.parent_id) if node.parent_id else None
        if parent is None or parent is node:
            roots.append(node)
        else:
            parent.children.append(node)
    ordered: list[SpanNode] = []
    seen: set[int] = set()
    stack = [(root, 0) for root in reversed(roots)]
    while stack:
        node, depth = stack.pop()
        if node.pk in seen:  # a cycle of parent ids: show each span once
            continue
        seen.add(node.pk)
        node.depth = depth
        ordered.append(node)
        stack.extend((child, depth + 1) for child in reversed(node.children))
    for node in nodes:  # spans only reachable through a cycle
        if node.pk not in seen:
            node.depth = 0
            ordered.append(node)
    return roots, ordered


@dataclass
class LlmCall:
    prompt: list[Mapping[str, Any]]
    response: list[Mapping[str, Any]]
    prompt_token_ids: list[Any] | None
    response_token_ids: list[Any] | None
    model: str | None
    usage: dict[str, Any]


def _json_list(value: Any) -> list[Mapping[str, Any]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    if isinstance(value, list):
        return [m if isinstance(m, Mapping) else {"content": m} for m in value]
    return []


def _token_ids(attributes: Mapping[str, Any], *keys: str) -> list[Any] | None:
    for key in keys:
        value = attributes.get(key)
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, str) and value.startswith("["):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if isinstance(parsed, list):
                return parsed
    return None


def llm_call(attributes: Mapping[str, Any]) -> LlmCall:
    """The messages, response, token ids, model and usage an LLM-call span carries."""
    prompt = indexed_messages(attributes, "gen_ai.prompt") or _json_list(attributes.get("gen_ai.input.messages"))
    response = indexed_messages(attributes, "gen_ai.completion") or _json_list(attributes.get("gen_ai.output.messages"))
    usage = {k.removeprefix("gen_ai.usage."): v for k, v in attributes.items() if k.startswith("gen_ai.usage.")}
    model = attributes.get("gen_ai.response.model") or attributes.get("gen_ai.request.model")
    return LlmCall(
        prompt=[m for m in prompt if m.keys() - {"token_ids"}],
        response=[m for m in response if m.keys() - {"token_ids"}],
        prompt_token_ids=_token_ids(attributes, "prompt_token_ids", "gen_ai.prompt.token_ids"),
        response_token_ids=_token_ids(attributes, "response_token_ids", "gen_ai.completion.token_ids"),
        model=str(model) if model is not None else None,
        usage=usage,
    )
