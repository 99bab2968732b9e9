"""Span payloads of docs/performance.md: ~1.4 KB flat attributes (seed 1), ~5.4 KB nested with ``heavy``.

Spans are built from a few validated templates with ``model_copy`` so that building them costs the
same small, constant amount for every store under test (the store's own work is what is measured).
"""

from __future__ import annotations

import itertools
import random
import string
from typing import Any

TEMPLATE_COUNT = 64
_ALPHABET = string.ascii_letters + string.digits


def _word(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choices(_ALPHABET, k=rng.randint(low, high)))


def flat_attributes(rng: random.Random) -> dict[str, Any]:
    """8 random keys of 3-20 chars with string values of 5-300 chars (~1.4 KB of JSON on average)."""
    return {_word(rng, 3, 20): _word(rng, 5, 300) for _ in range(8)}


def nested_attributes(rng: random.Random) -> dict[str, Any]:
    """Nested attributes of ~5.4 KB: a prompt/completion shaped tree, as Agent-Lightning's scenario."""
    return {
        "gen_ai.prompt": [{"role": "user", "content": _word(rng, 200, 1200)} for _ in range(3)],
        "gen_ai.completion": [{"role": "assistant", "content": _word(rng, 200, 1200)}],
        "gen_ai.request": flat_attributes(rng),
        "gen_ai.usage": {"prompt_tokens": rng.randint(10, 4000), "completion_tokens": rng.randint(1, 800)},
    }


def span_dicts(heavy: bool = False, count: int = TEMPLATE_COUNT) -> list[dict[str, Any]]:
    """``count`` span payloads (ids left blank), deterministic (seed 1)."""
    rng = random.Random(1)
    out = []
    for i in range(count):
        trace_id = f"{rng.getrandbits(128):032x}"
        span_id = f"{rng.getrandbits(64):016x}"
        out.append(
            {
                "rollout_id": "",
                "attempt_id": "",
                "sequence_id": 0,
                "trace_id": trace_id,
                "span_id": span_id,
                "parent_id": None,
                "name": f"bench.span.{i % 4}",
                "status": {"status_code": "OK", "description": None},
                "attributes": nested_attributes(rng) if heavy else flat_attributes(rng),
                "events": [],
                "links": [],
                "start_time": 1_700_000_000.0 + i,
                "end_time": 1_700_000_000.5 + i,
                "context": {"trace_id": trace_id, "span_id": span_id, "is_remote": False, "trace_state": {}},
                "parent": None,
                "resource": {"attributes": {"service.name": "lightning-sql-bench"}, "schema_url": ""},
            }
        )
    return out


class SpanFactory:
    """Makes spans of one store's ``Span`` class for a (rollout, attempt, sequence id)."""

    _ids = itertools.count(1)

    def __init__(self, span_cls: type[Any], heavy: bool = False) -> None:
        self.templates = [span_cls.model_validate(d) for d in span_dicts(heavy)]

    def make(self, rollout_id: str, attempt_id: str, sequence_id: int) -> Any:
        n = next(self._ids)
        template = self.templates[n % len(self.templates)]
        span_id = f"{n:016x}"
        return template.model_copy(
            update={
                "rollout_id": rollout_id,
                "attempt_id": attempt_id,
                "sequence_id": sequence_id,
                "span_id": span_id,
            }
        )
