"""A stand-in model server: deterministic, OpenAI-compatible, returning token ids as vLLM does.

Used by the proxy's tests, ``examples/rl_proxy.py`` and ``benchmarks/proxy.py`` in place of a real vLLM.
It serves ``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE streams), ``/v1/models`` and
``/health``.  A word is a token: its id is a stable hash of the word.  With ``return_token_ids: true``
the answer carries ``prompt_token_ids`` (top level, in a stream's first chunk) and each choice's
``token_ids`` (a stream's chunks carry their own), like vLLM >= 0.10.2.  The reply to a chat whose
last message contains ``a + b`` (or ``-``, ``*``) is the result, off by one for some prompts, so an
agent's reward varies; any other prompt is echoed.

Knobs (attributes, changeable while it serves): ``delay`` (seconds before answering), ``chunk_delay``
(seconds between stream chunks), ``fail_status`` (answer every call with this status),
``fail_next`` (answer the next N calls with 500).  ``requests`` keeps every body received.

    python -m lightning_sql.llm_proxy.testing --port 8000     # serve until interrupted
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import threading
import time
import zlib
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["StandInModel", "StandInModelServer", "reply", "token_id", "tokenize"]

VOCAB = 50_000
_ARITHMETIC = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % VOCAB


def tokenize(text: str) -> list[int]:
    return [token_id(w) for w in text.split()]


def _chat_prompt(messages: list[dict[str, Any]]) -> str:
    parts = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            content = orjson.dumps(content).decode()
        parts.append(f"<|{message.get('role')}|> {content}")
    return " ".join(parts) + " <|assistant|>"


def reply(text: str, seed: int = 0) -> str:
    """The stand-in's answer to a prompt (its rendered chat template, for a chat)."""
    matches = list(_ARITHMETIC.finditer(text))
    if not matches:
        return "echo: " + " ".join(text.split()[-8:])
    match = matches[-1]
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    wrong = (zlib.crc32(f"{text}|{seed}".encode()) % 3) == 0
    return f"The answer is {value + 1 if wrong else value}"


class StandInModel:
    """The stand-in's behaviour and its Starlette app."""

    def __init__(self, model: str = "stand-in") -> None:
        self.model = model
        self.delay = 0.0
        self.chunk_delay = 0.0
        self.fail_status: int | None = None
        self.fail_next = 0
        self.requests: list[dict[str, Any]] = []
        self._counter = 0
        self._lock = threading.Lock()
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completion, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "test"}]})

    def _next_id(self, prefix: str) -> str:
        with self._lock:
            self._counter += 1
            return f"{prefix}-{self._counter}"

    async def _preamble(self, request: Request) -> tuple[dict[str, Any] | None, Response | None]:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return None, JSONResponse({"error": {"message": "bad json", "type": "invalid_request_error"}}, 400)
        self.requests.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)
        failing = self.fail_status
        if failing is None and self.fail_next > 0:
            self.fail_next -= 1
            failing = 500
        if failing is not None:
            return None, JSONResponse(
                {"error": {"message": f"stand-in failure {failing}", "type": "server_error", "code": failing}},
                status_code=failing,
            )
        return body, None

    async def chat(self, request: Request) -> Response:
        body, failure = await self._preamble(request)
        if failure is not None:
            return failure
        assert body is not None
        prompt = _chat_prompt(body.get("messages") or [])
        return self._answer(body, prompt, "chat")

    async def completion(self, request: Request) -> Response:
        body, failure = await self._preamble(request)
        if failure is not None:
            return failure
        assert body is not None
        prompt = body.get("prompt")
        return self._answer(body, prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode(), "completion")

    def _answer(self, body: dict[str, Any], prompt: str, kind: str) -> Response:
        words = reply(prompt, int(body.get("seed") or 0)).split()
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        finish = "stop"
        if isinstance(max_tokens, int) and len(words) > max_tokens:
            words, finish = words[:max_tokens], "length"
        text = " ".join(words)
        prompt_ids = tokenize(prompt)
        response_ids = tokenize(text)
        token_ids = bool(body.get("return_token_ids"))
        logprobs = bool(body.get("logprobs"))
        call_id = self._next_id("chatcmpl" if kind == "chat" else "cmpl")
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(response_ids),
                 "total_tokens": len(prompt_ids) + len(response_ids)}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                self._stream(kind, call_id, words, prompt_ids, token_ids, logprobs, finish, usage if include_usage else None),
                media_type="text/event-stream",
            )
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            if logprobs:
                choice["logprobs"] = {"content": [_logprob(w) for w in words]}
        else:
            choice["text"] = text
            if logprobs:
                choice["logprobs"] = {"tokens": words, "token_logprobs": [_logprob(w)["logprob"] for w in words]}
        if token_ids:
            choice["token_ids"] = response_ids
        out: dict[str, Any] = {
            "id": call_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": self.model, "choices": [choice], "usage": usage,
        }
        if token_ids:
            if kind == "chat":
                out["prompt_token_ids"] = prompt_ids
            else:
                choice["prompt_token_ids"] = prompt_ids
        return Response(orjson.dumps(out), media_type="application/json")

    async def _stream(
        self, kind: str, call_id: str, words: list[str], prompt_ids: list[int], token_ids: bool,
        logprobs: bool, finish: str, usage: dict[str, int] | None,
    ) -> Any:
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def event(choice: dict[str, Any] | None, **extra: Any) -> bytes:
            chunk: dict[str, Any] = {"id": call_id, "object": obj, "created": created, "model": self.model,
                                     "choices": [choice] if choice is not None else [], **extra}
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        first_extra: dict[str, Any] = {"prompt_token_ids": prompt_ids} if token_ids and kind == "chat" else {}
        if kind == "chat":
            yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                        **first_extra)
        for i, word in enumerate(words):
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            piece = word if i == 0 else " " + word
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if kind == "chat":
                choice["delta"] = {"content": piece}
                if logprobs:
                    choice["logprobs"] = {"content": [_logprob(word)]}
            else:
                choice["text"] = piece
                if token_ids and i == 0:
                    choice["prompt_token_ids"] = prompt_ids
            if token_ids:
                choice["token_ids"] = [token_id(word)]
            yield event(choice)
        last: dict[str, Any] = {"index": 0, "finish_reason": finish}
        last["delta" if kind == "chat" else "text"] = {} if kind == "chat" else ""
        if token_ids:
            last["token_ids"] = []
        yield event(last)
        if usage is not None:
            yield event(None, usage=usage)
        yield b"data: [DONE]\n\n"


def _logprob(word: str) -> dict[str, Any]:
    return {"token": word, "logprob": -round((token_id(word) % 1000) / 1000, 3), "bytes": None, "top_logprobs": []}


class StandInModelServer:
    """Serve a ``StandInModel`` with uvicorn in a daemon thread: ``with StandInModelServer() as s: s.url``."""

    def __init__(self, model: str = "stand-in", host: str = "127.0.0.1", port: int | None = None) -> None:
        self.stand_in = StandInModel(model)
        self.host = host
        if port is None:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
        self.port = port
        config = uvicorn.Config(self.stand_in.app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> StandInModelServer:
        self._thread = threading.Thread(target=self._server.run, name="stand-in-model", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"The stand-in model server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10.0)

    def __enter__(self) -> StandInModelServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the stand-in model until interrupted.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="stand-in")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between stream chunks")
    args = parser.parse_args(argv)
    stand_in = StandInModel(args.model)
    stand_in.chunk_delay = args.chunk_delay
    uvicorn.run(stand_in.app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
