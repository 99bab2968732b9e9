"""What one proxied call becomes in the store: a span with OpenTelemetry GenAI attributes.

Span name ``openai.chat.completion`` for ``/chat/completions`` (what lightning_sql's and Agent-Lightning's
``TracerTraceToTriplet`` match by default) and ``openai.completion`` for ``/completions``.  Attributes:

* ``gen_ai.operation.name`` (``chat`` / ``text_completion``), ``gen_ai.system`` (the provider),
  ``gen_ai.request.model`` (the name the client asked for) and the request parameters as the client
  sent them (``gen_ai.request.temperature``, ``top_p``, ``max_tokens``, ``seed``, ...);
* ``gen_ai.prompt.<i>.role`` / ``.content`` (the messages; a completion's prompt is one user message),
  ``gen_ai.completion.<i>.role`` / ``.content`` / ``.finish_reason`` / ``.tool_calls.<j>.*``;
* ``gen_ai.response.id`` / ``.model`` / ``.finish_reasons``, ``gen_ai.usage.input_tokens`` /
  ``.output_tokens``;
* ``prompt_token_ids`` and ``response_token_ids`` (lists of ints, the first choice's) and
  ``logprobs.content`` (JSON) when the upstream returned them; with token ids, a child span
  ``raw_gen_ai_request`` holds them again as LiteLLM records them (``build_raw_span``);
* text fields past ``MAX_RECORDED_CHARS`` (and token-id lists past ``MAX_RECORDED_TOKEN_IDS``) keep
  their head and a marker, listed in ``lightning_sql.proxy.truncated``;
* ``server.address`` / ``server.port`` of the upstream, ``http.response.status_code``, ``error.type``,
  and ``lightning_sql.proxy.*``: upstream name, stream flag, cancelled flag, tries, latency and time to
  first token (seconds), and for an unattributed call the rollout/attempt ids the URL named.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from lightning_sql.llm_proxy.config import Upstream
from lightning_sql.llm_proxy.streaming import CallKind

__all__ = ["CallRecord", "Attribution", "build_span", "build_raw_span", "SPAN_NAMES", "PROXY_PREFIX", "RAW_SPAN_NAME"]

SPAN_NAMES: dict[CallKind, str] = {"chat": "openai.chat.completion", "completion": "openai.completion"}
PROXY_PREFIX = "lightning_sql.proxy"
# The child span Agent-Lightning's LlmProxyTraceToTriplet reads token ids from (LiteLLM's name).
RAW_SPAN_NAME = "raw_gen_ai_request"
# A recorded text field longer than this keeps its head and a marker: a call whose request passed
# the body limit is still stored whole in the store's limit per span (MAX_JSON_BYTES).
MAX_RECORDED_CHARS = 1024 * 1024
# All recorded text fields of one call together; past it each is cut to an equal share.
MAX_RECORDED_TOTAL_CHARS = 8 * 1024 * 1024
TRUNCATED_MARKER = "…[truncated by lightning_sql.llm_proxy: {dropped} of {total} characters]"
# Token ids kept per list (about 8 bytes of JSON each).
MAX_RECORDED_TOKEN_IDS = 400_000
_RESOURCE = Resource.create({"service.name": "lightning_sql.llm_proxy"})
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)

# Request parameters recorded as gen_ai.request.<name> (semantic-convention names where they exist).
_REQUEST_PARAMS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "n": "choice.count",
    "stop": "stop_sequences",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "stream": "stream",
}


@dataclass
class Attribution:
    """Where a call's span goes."""

    rollout_id: str
    attempt_id: str
    attributed: bool = True
    """False: stored under the proxy's unattributed rollout."""
    requested: tuple[str, str] | None = None
    """The rollout and attempt ids the URL named (None for a bare route)."""


@dataclass
class CallRecord:
    """One call through the proxy, as it happened."""

    kind: CallKind
    request: dict[str, Any]
    """The JSON body as the client sent it."""
    stream: bool
    start_time: float = field(default_factory=time.time)
    end_time: float | None = None
    upstream: Upstream | None = None
    tries: int = 0
    status_code: int | None = None
    """The upstream's HTTP status (None: no response at all)."""
    response: dict[str, Any] | None = None
    """The (assembled) JSON response, for a successful call."""
    error_type: str | None = None
    error_message: str | None = None
    cancelled: bool = False
    first_chunk_time: float | None = None
    trace_parent: tuple[str, str] | None = None
    """(trace id, parent span id) from the request's W3C ``traceparent`` header."""
    span_id: str = field(default_factory=lambda: secrets.token_hex(8))
    """Fixed when the call starts, so storing the span twice stores it once."""

    def finish(self) -> None:
        if self.end_time is None:
            self.end_time = time.time()


def _scalar(value: Any) -> Any:
    """A span attribute value: str/bool/int/float or a homogeneous list of them; else JSON text."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return value
    return orjson.dumps(value).decode()


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _message_attributes(attrs: dict[str, Any], prefix: str, index: int, message: dict[str, Any]) -> None:
    key = f"{prefix}.{index}"
    attrs[f"{key}.role"] = str(message.get("role") or "user")
    content = message.get("content")
    if content is not None:
        attrs[f"{key}.content"] = content if isinstance(content, str) else _scalar(content)
    for extra in ("name", "tool_call_id", "reasoning_content"):
        if isinstance(message.get(extra), str):
            attrs[f"{key}.{extra}"] = message[extra]
    for j, call in enumerate(message.get("tool_calls") or []):
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        attrs[f"{key}.tool_calls.{j}.id"] = str(call.get("id") or "")
        attrs[f"{key}.tool_calls.{j}.name"] = str(function.get("name") or "")
        attrs[f"{key}.tool_calls.{j}.arguments"] = _scalar(function.get("arguments") or "")


def _request_attributes(attrs: dict[str, Any], record: CallRecord) -> None:
    request = record.request
    attrs["gen_ai.request.model"] = str(request.get("model"))
    for key, name in _REQUEST_PARAMS.items():
        value = request.get(key)
        if value is not None:
            attrs[f"gen_ai.request.{name}"] = _scalar(value)
    if request.get("tools"):
        attrs["gen_ai.request.tools"] = _scalar(request["tools"])
    if record.kind == "chat":
        for i, message in enumerate(request.get("messages") or []):
            if isinstance(message, dict):
                _message_attributes(attrs, "gen_ai.prompt", i, message)
    else:
        prompt = request.get("prompt")
        attrs["gen_ai.prompt.0.role"] = "user"
        attrs["gen_ai.prompt.0.content"] = prompt if isinstance(prompt, str) else _scalar(prompt)


def _response_attributes(attrs: dict[str, Any], record: CallRecord) -> None:
    response = record.response or {}
    if response.get("id") is not None:
        attrs["gen_ai.response.id"] = str(response["id"])
    if response.get("model") is not None:
        attrs["gen_ai.response.model"] = str(response["model"])
    choices = [c for c in response.get("choices") or [] if isinstance(c, dict)]
    finish_reasons = [str(c.get("finish_reason")) for c in choices if c.get("finish_reason")]
    if finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = finish_reasons
    for i, choice in enumerate(choices):
        if record.kind == "chat":
            message = choice.get("message") or {}
            _message_attributes(attrs, "gen_ai.completion", i, {"role": "assistant", **message})
        else:
            attrs[f"gen_ai.completion.{i}.role"] = "assistant"
            attrs[f"gen_ai.completion.{i}.content"] = str(choice.get("text") or "")
        if choice.get("finish_reason"):
            attrs[f"gen_ai.completion.{i}.finish_reason"] = str(choice["finish_reason"])
        if i > 0 and _int_list(choice.get("token_ids")) is not None:
            attrs[f"gen_ai.completion.{i}.token_ids"] = choice["token_ids"]
    usage = response.get("usage")
    if isinstance(usage, dict):
        for key, name in (("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens")):
            if isinstance(usage.get(key), int):
                attrs[f"gen_ai.usage.{name}"] = usage[key]
    first = choices[0] if choices else {}
    prompt_ids = _int_list(response.get("prompt_token_ids")) or _int_list(first.get("prompt_token_ids"))
    if prompt_ids is not None:
        attrs["prompt_token_ids"] = prompt_ids
    response_ids = _int_list(first.get("token_ids"))
    if response_ids is not None:
        attrs["response_token_ids"] = response_ids
    logprobs = first.get("logprobs")
    if isinstance(logprobs, dict):
        content = logprobs.get("content") if record.kind == "chat" else logprobs
        if content:
            attrs["logprobs.content"] = orjson.dumps(content).decode()


def _cut(text: str, limit: int) -> str:
    marker = TRUNCATED_MARKER.format(dropped=len(text) - limit, total=len(text))
    return text[:limit] + marker


def truncate_attributes(attrs: dict[str, Any]) -> list[str]:
    """Cut oversized text and token-id attributes in place (each keeps its head and says so); the
    keys that were cut."""
    cut: list[str] = []
    texts = [k for k, v in attrs.items() if isinstance(v, str) and len(v) > 1024]
    total = sum(len(attrs[k]) for k in texts)
    limit = MAX_RECORDED_CHARS
    if total > MAX_RECORDED_TOTAL_CHARS:
        limit = min(limit, MAX_RECORDED_TOTAL_CHARS // len(texts))
    for key in texts:
        if len(attrs[key]) > limit:
            attrs[key] = _cut(attrs[key], limit)
            cut.append(key)
    for key, value in attrs.items():
        if isinstance(value, list) and len(value) > MAX_RECORDED_TOKEN_IDS:
            attrs[key] = value[:MAX_RECORDED_TOKEN_IDS]
            cut.append(key)
    return cut


def build_span(record: CallRecord, attribution: Attribution) -> ReadableSpan:
    """The span that stores ``record`` under ``attribution`` (an OpenTelemetry span: ``add_otel_span``
    gives it the rollout's next sequence id in the same transaction that stores it)."""
    record.finish()
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if record.kind == "chat" else "text_completion",
    }
    upstream = record.upstream
    if upstream is not None:
        attrs["gen_ai.system"] = upstream.provider
        parts = urlsplit(upstream.api_base)
        attrs["server.address"] = parts.hostname or ""
        if parts.port is not None:
            attrs["server.port"] = parts.port
        attrs[f"{PROXY_PREFIX}.upstream"] = upstream.name
    _request_attributes(attrs, record)
    if record.response is not None:
        _response_attributes(attrs, record)
    if record.status_code is not None:
        attrs["http.response.status_code"] = record.status_code
    attrs[f"{PROXY_PREFIX}.stream"] = record.stream
    attrs[f"{PROXY_PREFIX}.tries"] = record.tries
    assert record.end_time is not None
    attrs[f"{PROXY_PREFIX}.latency_s"] = max(record.end_time - record.start_time, 0.0)
    if record.first_chunk_time is not None:
        attrs[f"{PROXY_PREFIX}.time_to_first_chunk_s"] = max(record.first_chunk_time - record.start_time, 0.0)
    if record.cancelled:
        attrs[f"{PROXY_PREFIX}.cancelled"] = True
    if not attribution.attributed:
        attrs[f"{PROXY_PREFIX}.unattributed"] = True
        if attribution.requested is not None:
            attrs[f"{PROXY_PREFIX}.requested_rollout_id"] = attribution.requested[0]
            attrs[f"{PROXY_PREFIX}.requested_attempt_id"] = attribution.requested[1]
    truncated = truncate_attributes(attrs)
    if truncated:
        attrs[f"{PROXY_PREFIX}.truncated"] = truncated
    status = Status(StatusCode.OK)
    if record.error_type is not None:
        attrs["error.type"] = record.error_type
        if record.error_message:
            attrs[f"{PROXY_PREFIX}.error"] = record.error_message[:4000]
        status = Status(StatusCode.ERROR, record.error_message or record.error_type)
    trace_id, parent_id = record.trace_parent or (secrets.token_hex(16), None)
    context = SpanContext(int(trace_id, 16), int(record.span_id, 16), is_remote=False, trace_flags=_SAMPLED)
    parent = SpanContext(int(trace_id, 16), int(parent_id, 16), is_remote=True, trace_flags=_SAMPLED) if parent_id else None
    return ReadableSpan(
        name=SPAN_NAMES[record.kind],
        context=context,
        parent=parent,
        resource=_RESOURCE,
        attributes=attrs,
        kind=SpanKind.CLIENT,
        status=status,
        start_time=int(record.start_time * 1e9),
        end_time=int(record.end_time * 1e9),
    )


def build_raw_span(record: CallRecord, parent: ReadableSpan) -> ReadableSpan | None:
    """The call's token ids as LiteLLM's ``raw_gen_ai_request`` child span, which Agent-Lightning's
    ``LlmProxyTraceToTriplet`` reads (``llm.hosted_vllm.*``); None when the call has no token ids.

    The ids are also on the call's own span, where ``TracerTraceToTriplet`` and lightning_sql's
    adapter read them: the two adapters select spans by different names and read only the selected
    span's attributes, so one copy cannot serve both.
    """
    attrs = parent.attributes or {}
    prompt_ids, response_ids = attrs.get("prompt_token_ids"), attrs.get("response_token_ids")
    if not isinstance(prompt_ids, Sequence) or not isinstance(response_ids, Sequence) or not prompt_ids or not response_ids:
        return None
    raw: dict[str, Any] = {
        "llm.hosted_vllm.prompt_token_ids": list(prompt_ids),
        # LiteLLM's shape: one list per choice, as text (span attributes hold no nested lists).
        "llm.hosted_vllm.response_token_ids": orjson.dumps([list(response_ids)]).decode(),
    }
    if attrs.get("gen_ai.response.id") is not None:
        raw["llm.hosted_vllm.id"] = attrs["gen_ai.response.id"]
    context = parent.context
    assert context is not None and record.end_time is not None
    child = SpanContext(context.trace_id, int(secrets.token_hex(8), 16), is_remote=False, trace_flags=_SAMPLED)
    return ReadableSpan(
        name=RAW_SPAN_NAME,
        context=child,
        parent=context,
        resource=_RESOURCE,
        attributes=raw,
        kind=SpanKind.INTERNAL,
        status=Status(StatusCode.OK),
        start_time=parent.start_time,
        end_time=parent.end_time,
    )
