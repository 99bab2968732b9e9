"""Server-sent events from an OpenAI-compatible upstream, assembled into the response they stream.

The proxy passes the upstream's bytes to the client unchanged and feeds a copy to ``StreamAssembler``,
which parses the ``data:`` events and folds the chunks into the shape of a non-streaming response:
message text, tool calls, finish reasons, usage, and vLLM's ``prompt_token_ids`` / per-choice
``token_ids`` (which a stream spreads over its chunks), so that a streamed call is recorded exactly like
a non-streamed one.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import orjson

__all__ = ["StreamAssembler", "CallKind"]

logger = logging.getLogger(__name__)

CallKind = Literal["chat", "completion"]


class _Choice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.logprobs_content: list[Any] = []
        self.completion_logprobs: dict[str, list[Any]] = {}

    def feed_chat(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        if isinstance(delta, dict):
            if isinstance(delta.get("role"), str):
                self.role = delta["role"]
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            reasoning = delta.get("reasoning_content", delta.get("reasoning"))
            if isinstance(reasoning, str):
                self.reasoning.append(reasoning)
            for call in delta.get("tool_calls") or []:
                if not isinstance(call, dict):
                    continue
                slot = self.tool_calls.setdefault(
                    int(call.get("index", len(self.tool_calls))),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                if call.get("type"):
                    slot["type"] = call["type"]
                function = call.get("function") or {}
                if isinstance(function.get("name"), str):
                    slot["function"]["name"] += function["name"]
                if isinstance(function.get("arguments"), str):
                    slot["function"]["arguments"] += function["arguments"]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            self.logprobs_content.extend(logprobs["content"])
        self._feed_common(choice)

    def feed_completion(self, choice: dict[str, Any]) -> None:
        if isinstance(choice.get("text"), str):
            self.content.append(choice["text"])
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            for key, value in logprobs.items():
                if isinstance(value, list):
                    self.completion_logprobs.setdefault(key, []).extend(value)
        self._feed_common(choice)

    def _feed_common(self, choice: dict[str, Any]) -> None:
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.token_ids.extend(ids)
        prompt_ids = choice.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and self.prompt_token_ids is None:
            self.prompt_token_ids = list(prompt_ids)

    def result(self, kind: CallKind, saw_token_ids: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason}
        if kind == "chat":
            message: dict[str, Any] = {"role": self.role or "assistant", "content": "".join(self.content)}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            if self.tool_calls:
                message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            out["message"] = message
            if self.logprobs_content:
                out["logprobs"] = {"content": self.logprobs_content}
        else:
            out["text"] = "".join(self.content)
            if self.completion_logprobs:
                out["logprobs"] = self.completion_logprobs
        if saw_token_ids:
            out["token_ids"] = self.token_ids
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out


class StreamAssembler:
    """Feed it the raw bytes of an SSE stream; ``result()`` is the equivalent non-streaming response."""

    def __init__(self, kind: CallKind) -> None:
        self.kind = kind
        self.done = False
        """The ``[DONE]`` sentinel arrived."""
        self.chunks = 0
        self._buffer = b""
        self._data: list[bytes] = []
        self._head: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: Any = None
        self._prompt_token_ids: list[int] | None = None
        self._saw_token_ids = False
        self.error: Any = None
        """An ``error`` object sent inside the stream, if any."""

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return
            line = self._buffer[:newline].rstrip(b"\r")
            self._buffer = self._buffer[newline + 1 :]
            self._line(line)

    def close(self) -> None:
        """The stream ended: a last event without its blank line still counts."""
        if self._buffer:
            self._line(self._buffer.rstrip(b"\r"))
            self._buffer = b""
        self._line(b"")

    def _line(self, line: bytes) -> None:
        if not line:
            if self._data:
                payload = b"\n".join(self._data)
                self._data = []
                self._event(payload)
            return
        if line.startswith(b"data:"):
            self._data.append(line[5:].lstrip(b" "))
        # other fields (event:, id:, retry:) and comments (":") carry nothing to record

    def _event(self, payload: bytes) -> None:
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            logger.debug("Ignoring a stream event that is not JSON: %r", payload[:200])
            return
        if not isinstance(chunk, dict):
            return
        self.chunks += 1
        if "error" in chunk and "choices" not in chunk:
            self.error = chunk["error"]
            return
        for key in ("id", "model", "created", "system_fingerprint"):
            if key in chunk and key not in self._head:
                self._head[key] = chunk[key]
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        prompt_ids = chunk.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and self._prompt_token_ids is None:
            self._prompt_token_ids = list(prompt_ids)
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if "token_ids" in choice:
                self._saw_token_ids = True
            index = int(choice.get("index", 0))
            slot = self._choices.get(index)
            if slot is None:
                slot = self._choices[index] = _Choice(index)
            if self.kind == "chat":
                slot.feed_chat(choice)
            else:
                slot.feed_completion(choice)

    def result(self) -> dict[str, Any]:
        """The response as a non-streaming call would have returned it (as far as it arrived)."""
        out: dict[str, Any] = dict(self._head)
        out["object"] = "chat.completion" if self.kind == "chat" else "text_completion"
        out["choices"] = [self._choices[i].result(self.kind, self._saw_token_ids) for i in sorted(self._choices)]
        if self._usage is not None:
            out["usage"] = self._usage
        if self._prompt_token_ids is not None:
            out["prompt_token_ids"] = self._prompt_token_ids
        return out
