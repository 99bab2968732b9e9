"""Adapters: turn an attempt's spans into training data (docs/store-contract.md §3.4).

``TracerTraceToTriplet`` reads these span attributes (documented in docs/distributed.md):

* LLM-call spans (name matching ``llm_call_match``), OpenTelemetry GenAI conventions:
  ``gen_ai.prompt.<i>.role`` / ``gen_ai.prompt.<i>.content`` (the prompt messages),
  ``gen_ai.completion.<i>.role`` / ``gen_ai.completion.<i>.content`` (the response messages),
  or the newer JSON-valued ``gen_ai.input.messages`` / ``gen_ai.output.messages``;
  token ids, when present, from ``prompt_token_ids`` / ``response_token_ids``;
  ``gen_ai.response.id`` and ``gen_ai.request.model`` / ``gen_ai.response.model`` go to metadata.
* Reward spans: ``agentlightning.annotation`` with ``agentlightning.reward.0.value`` (the first
  dimension), or the legacy ``agentlightning.reward`` span with a ``reward`` attribute.
* Agent spans (for ``agent_match``): the span name, or ``agent.name`` / ``gen_ai.agent.name``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from enum import StrEnum
from typing import Any, Generic, TypeVar

from lightning_sql.types import AGL_ANNOTATION, Span, Triplet, reward_value_key

__all__ = [
    "Adapter",
    "TraceAdapter",
    "TraceTree",
    "RewardMatchPolicy",
    "TracerTraceToTriplet",
]

T_from = TypeVar("T_from")
T_to = TypeVar("T_to")

_LEGACY_REWARD_SPAN = "agentlightning.reward"


class Adapter(Generic[T_from, T_to]):
    """Converts data from one form to another; call it or its ``adapt``."""

    def __call__(self, source: T_from, /) -> T_to:
        return self.adapt(source)

    def adapt(self, source: T_from, /) -> T_to:
        raise NotImplementedError(f"{type(self).__name__}.adapt is not implemented")


class TraceAdapter(Adapter[Sequence[Span], T_to], Generic[T_to]):
    """An adapter that consumes the spans of one attempt."""


class RewardMatchPolicy(StrEnum):
    """How reward spans are matched to LLM calls."""

    FIRST_SIBLING = "first_sibling"
    """A reward goes to the LLM call it directly follows among the siblings of one parent."""
    FIRST_OCCURRENCE = "first_occurrence"
    """A reward goes to the latest LLM call before it (in time) that has no reward yet."""


def reward_of(span: Span) -> float | None:
    """The first reward dimension carried by a span, or None."""
    if span.name == AGL_ANNOTATION:
        value = span.attributes.get(reward_value_key(0))
    elif span.name == _LEGACY_REWARD_SPAN:
        value = span.attributes.get("reward")
    else:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _start(span: Span) -> float:
    return span.start_time if span.start_time is not None else float("-inf")


def _end(span: Span) -> float:
    if span.end_time is not None:
        return span.end_time
    return span.start_time if span.start_time is not None else float("inf")


class TraceTree:
    """A span and its children; ``from_spans`` builds the forest of one trace under one root."""

    def __init__(self, id: str, span: Span, children: list[TraceTree] | None = None) -> None:
        self.id = id
        self.span = span
        self.children: list[TraceTree] = children or []
        self.is_virtual = False  # a synthetic root over several real roots

    @property
    def start_time(self) -> float:
        return _start(self.span)

    @property
    def end_time(self) -> float:
        return _end(self.span)

    def traverse(self) -> Iterator[TraceTree]:
        """Depth-first, children in time order."""
        yield self
        for child in self.children:
            yield from child.traverse()

    def size(self) -> int:
        return sum(1 for _ in self.traverse())

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.span.name, "children": [c.to_json() for c in self.children]}

    @classmethod
    def from_spans(cls, spans: Sequence[Span]) -> TraceTree:
        """Build the tree from ``span_id``/``parent_id``.

        Spans whose parent is missing become roots; several roots hang under a synthetic
        ``agentlightning.virtual`` root spanning them all.

        Raises:
            ValueError: no spans.
        """
        if not spans:
            raise ValueError("No spans provided to build the trace tree")
        nodes: dict[str, TraceTree] = {}
        for span in spans:
            nodes.setdefault(span.span_id, cls(span.span_id, span))
        roots: list[TraceTree] = []
        for node in nodes.values():
            parent = nodes.get(node.span.parent_id) if node.span.parent_id else None
            if parent is None or parent is node:
                roots.append(node)
            else:
                parent.children.append(node)
        for node in nodes.values():
            node.children.sort(key=lambda n: (n.start_time, n.span.sequence_id))
        roots.sort(key=lambda n: (n.start_time, n.span.sequence_id))
        if len(roots) == 1:
            return roots[0]
        first = roots[0].span
        starts = [r.span.start_time for r in roots if r.span.start_time is not None]
        ends = [r.span.end_time for r in roots if r.span.end_time is not None]
        virtual = Span.from_attributes(
            attributes={},
            rollout_id=first.rollout_id,
            attempt_id=first.attempt_id,
            sequence_id=first.sequence_id,
            trace_id=first.trace_id,
            start_time=min(starts) if starts else None,
            end_time=max(ends) if ends else None,
        )
        root = cls(virtual.span_id, virtual, roots)
        root.is_virtual = True
        return root

    def repair_hierarchy(self) -> None:
        """Re-attach each top-level subtree under the tightest other span whose time range contains it.

        Spans emitted from threads or other tracers often lose their parent; their timing still says
        which operation they belonged to.  Only a synthetic root has such subtrees.
        """
        if not self.is_virtual:
            return
        for orphan in list(self.children):
            best: TraceTree | None = None
            own = {id(n) for n in orphan.traverse()}
            for node in self.traverse():
                if node is self or id(node) in own:
                    continue
                if node.start_time <= orphan.start_time and orphan.end_time <= node.end_time:
                    if best is None or (node.end_time - node.start_time) < (best.end_time - best.start_time):
                        best = node
            if best is not None:
                self.children.remove(orphan)
                best.children.append(orphan)
                best.children.sort(key=lambda n: (n.start_time, n.span.sequence_id))


class TracerTraceToTriplet(TraceAdapter[list[Triplet]]):
    """Spans of one attempt → one ``Triplet`` per LLM call (prompt, response, reward)."""

    def __init__(
        self,
        repair_hierarchy: bool = True,
        llm_call_match: str = r"openai\.chat\.completion",
        agent_match: str | None = None,
        exclude_llm_call_in_reward: bool = True,
        reward_match: RewardMatchPolicy = RewardMatchPolicy.FIRST_OCCURRENCE,
    ) -> None:
        self.repair_hierarchy = repair_hierarchy
        self.llm_call_match = llm_call_match
        self.agent_match = agent_match
        self.exclude_llm_call_in_reward = exclude_llm_call_in_reward
        self.reward_match = RewardMatchPolicy(reward_match)

    def visualize(self, spans: Sequence[Span]) -> TraceTree:
        return self._tree(spans)

    def _tree(self, spans: Sequence[Span]) -> TraceTree:
        tree = TraceTree.from_spans(spans)
        if self.repair_hierarchy:
            tree.repair_hierarchy()
        return tree

    def adapt(self, source: Sequence[Span], /) -> list[Triplet]:
        """The triplets of one attempt's spans; none for an attempt with no spans (one whose agent
        failed before its first call), where Agent-Lightning's ``TracerTraceToTriplet`` raises
        ``ValueError`` and its ``LlmProxyTraceToTriplet`` returns ``[]``, as here."""
        if not source:
            return []
        tree = self._tree(source)
        llm_pattern = re.compile(self.llm_call_match)
        agent_pattern = re.compile(self.agent_match) if self.agent_match else None
        calls: list[TraceTree] = []
        self._find_llm_calls(tree, llm_pattern, agent_pattern, agent_pattern is None, False, calls)
        rewards = self._match_rewards(tree, calls)
        triplets = []
        for call in sorted(calls, key=lambda n: (n.end_time, n.span.sequence_id)):
            prompt, response = _prompt_and_response(call.span)
            triplets.append(
                Triplet(
                    prompt=prompt,
                    response=response,
                    reward=rewards.get(call.id),
                    metadata=_call_metadata(call.span),
                )
            )
        return triplets

    def _find_llm_calls(
        self,
        node: TraceTree,
        llm_pattern: re.Pattern[str],
        agent_pattern: re.Pattern[str] | None,
        in_agent: bool,
        in_reward: bool,
        out: list[TraceTree],
    ) -> None:
        span = node.span
        if agent_pattern is not None and not in_agent:
            names = [span.name, span.attributes.get("agent.name"), span.attributes.get("gen_ai.agent.name")]
            in_agent = any(isinstance(n, str) and agent_pattern.search(n) for n in names)
        in_reward = in_reward or reward_of(span) is not None
        if llm_pattern.search(span.name) and in_agent and not (in_reward and self.exclude_llm_call_in_reward):
            out.append(node)
            return  # an LLM call's children (HTTP spans, nested wrappers) are part of that call
        for child in node.children:
            self._find_llm_calls(child, llm_pattern, agent_pattern, in_agent, in_reward, out)

    def _match_rewards(self, tree: TraceTree, calls: list[TraceTree]) -> dict[str, float]:
        call_ids = {c.id for c in calls}
        matched: dict[str, float] = {}
        if self.reward_match == RewardMatchPolicy.FIRST_SIBLING:
            for node in tree.traverse():
                last_call: str | None = None
                for child in node.children:
                    if child.id in call_ids:
                        last_call = child.id
                        continue
                    value = reward_of(child.span)
                    if value is not None and last_call is not None and last_call not in matched:
                        matched[last_call] = value
            return matched
        events: list[tuple[float, int, int, TraceTree]] = []
        for node in tree.traverse():
            if node.id in call_ids:
                events.append((node.end_time, node.span.sequence_id, 0, node))
            elif reward_of(node.span) is not None:
                events.append((node.start_time, node.span.sequence_id, 1, node))
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        waiting: list[str] = []
        for _, _, kind, node in events:
            if kind == 0:
                waiting.append(node.id)
            elif waiting:
                value = reward_of(node.span)
                assert value is not None
                matched[waiting.pop()] = value
        return matched


def indexed_messages(attributes: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Collect ``<prefix>.<i>.<field>`` attributes into a list of dicts ordered by ``i``."""
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.(.+)$")
    messages: dict[int, dict[str, Any]] = {}
    for key, value in attributes.items():
        m = pattern.match(key)
        if m:
            messages.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return [messages[i] for i in sorted(messages)]


def _json_messages(value: Any) -> list[Any] | None:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return parsed if isinstance(parsed, list) else None
    return None


def _token_ids(attributes: dict[str, Any], *keys: str) -> list[int]:
    for key in keys:
        value = attributes.get(key)
        if isinstance(value, (list, tuple)):
            return [int(v) for v in value]
    return []


def _prompt_and_response(span: Span) -> tuple[dict[str, Any], dict[str, Any]]:
    attrs = dict(span.attributes)
    prompt_messages: Any = indexed_messages(attrs, "gen_ai.prompt") or _json_messages(attrs.get("gen_ai.input.messages"))
    response_messages: Any = indexed_messages(attrs, "gen_ai.completion") or _json_messages(
        attrs.get("gen_ai.output.messages")
    )
    prompt = {
        "token_ids": _token_ids(attrs, "prompt_token_ids", "gen_ai.prompt.token_ids"),
        "raw_content": prompt_messages or None,
    }
    response = {
        "token_ids": _token_ids(attrs, "response_token_ids", "gen_ai.completion.token_ids"),
        "raw_content": response_messages or None,
    }
    return prompt, response


def _call_metadata(span: Span) -> dict[str, Any]:
    meta: dict[str, Any] = {"span_id": span.span_id, "sequence_id": span.sequence_id, "name": span.name}
    for key, out in (
        ("gen_ai.response.id", "response_id"),
        ("gen_ai.request.model", "request_model"),
        ("gen_ai.response.model", "response_model"),
    ):
        if key in span.attributes:
            meta[out] = span.attributes[key]
    return meta
