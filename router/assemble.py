"""A non-streamed answer built from a stream, for engines that cannot stop a non-streamed
completion whose client left (`answers_assembled`; each engine's module says why it is so).

Such an engine generates a non-streamed answer to its end however early its client hung up,
and every request behind it waits; its streams, though, stop at the next token once the
connection closes. So for such engines the router asks for a stream and hands the client the
JSON answer the engine would have sent; closing the stream is then what stops the engine.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from nomad_driver import engines
from nomad_driver.safeload import LoadError, json_loads
from router.errors import RouterError, redacted
from router.proxy import EventTooLarge, StreamBroken, read_events

ASSEMBLED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Said on an assembled answer whose usage the router counted itself, because the engine's
# stream carried none (an engine that ignores `stream_options`): the completion tokens are
# the tokens streamed, and the prompt's tokens are not known.
USAGE_COUNTED = (b"x-llmgw-usage", b"counted")
# What an OpenAI stream chunk has; anything else is the engine's own.
CHUNK_FIELDS = frozenset(
    {"id", "object", "created", "model", "system_fingerprint", "choices", "usage", "error"}
)


def needs_stream(engine: str | None, path: str, request: dict[str, Any]) -> bool:
    """Whether a request goes upstream as a stream to be assembled for its client. A replica
    without a definition is passed through untouched: what its engine does is not known."""
    known = engines.find(engine)
    assembled = known is not None and known.answers_assembled
    return assembled and path in ASSEMBLED_PATHS and request.get("stream") is not True


def streamed_body(request: dict[str, Any]) -> bytes:
    """The request as a stream, asking for usage in its last event where the engine knows
    `stream_options`."""
    options = request.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return json.dumps({**request, "stream": True, "stream_options": options}).encode()


class Assembler:
    """Collects a chat or text completion stream's events into the non-streamed answer: every
    choice's text, tool calls and log probabilities joined in order, its finish reason, and the
    answer's id, creation time, model and usage."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.head: dict[str, Any] = {}
        self.choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None
        # Fields an engine adds of its own (llama-server's `timings`), as last sent: its
        # non-streamed answer carries them too, and clients that read them expect them.
        self.extra: dict[str, Any] = {}
        self.error: dict[str, Any] | None = None
        self.done = False

    def feed_event(self, event: bytes) -> None:
        """One server-sent event, whole (its `data:` lines; comments and other fields are
        ignored as a client would ignore them)."""
        data = b"\n".join(
            line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")
        )
        if not data:
            return
        if data.strip() == b"[DONE]":
            self.done = True
            return
        try:
            # Bounded: an engine's event nested ten thousand deep is a 502, not a RecursionError.
            chunk = json_loads(data, "an event the replica streamed")
        except LoadError as exc:
            raise AssemblyFailed(f"{exc}: {data[:200]!r}") from exc
        if not isinstance(chunk, dict):
            raise AssemblyFailed(f"the replica streamed a JSON {type(chunk).__name__}, not an object")
        if isinstance(chunk.get("error"), dict):
            self.error = chunk["error"]
            return
        self.feed(chunk)

    def feed(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "created", "model", "system_fingerprint"):
            if key not in self.head and chunk.get(key) is not None:
                self.head[key] = chunk[key]
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for key, value in chunk.items():
            if key not in CHUNK_FIELDS:
                self.extra[key] = value
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            into = self.choices.get(index)
            if into is None:
                into = self.choices[index] = _Choice(index)
            into.feed(choice, self.chat)

    def complete(self) -> bool:
        """The stream said it was done, or every choice has its finish reason."""
        return self.done or (
            bool(self.choices) and all(c.finish_reason is not None for c in self.choices.values())
        )

    def answer(self) -> tuple[dict[str, Any], bool]:
        """The non-streamed answer, and whether its usage was counted here (see USAGE_COUNTED)."""
        head = self.head
        body: dict[str, Any] = {
            "id": head.get("id", ""),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": head.get("created", 0),
            "model": head.get("model", ""),
        }
        if "system_fingerprint" in head:
            body["system_fingerprint"] = head["system_fingerprint"]
        body["choices"] = [self.choices[i].answer(self.chat) for i in sorted(self.choices)]
        counted = self.usage is None
        if self.usage is not None:
            body["usage"] = self.usage
        else:
            tokens = sum(choice.tokens for choice in self.choices.values())
            body["usage"] = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
        for key, value in self.extra.items():
            body.setdefault(key, value)
        return body, counted


async def assemble(
    resp: aiohttp.ClientResponse, *, chat: bool, between_chunks_s: float
) -> tuple[int, bytes, bool]:
    """Read the replica's stream to its end: the status and JSON body to answer with, and
    whether the usage in it was counted here. Raises StreamBroken for a stream cut short and
    AssemblyFailed for one that is not a completion."""
    assembler = Assembler(chat)

    def last(event: bytes) -> bool:
        assembler.feed_event(event)
        return assembler.done

    try:
        await read_events(resp, last, between_chunks_s=between_chunks_s)
    except EventTooLarge as exc:
        raise AssemblyFailed(str(exc)) from exc
    if assembler.error is not None:
        # The engine's own error object, as it would have answered it without a stream.
        code = assembler.error.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return status, redacted(_dumps({"error": assembler.error})), False
    if not assembler.complete():
        raise StreamBroken("the replica's stream ended before its last event")
    body, counted = assembler.answer()
    return 200, _dumps(body), counted


def _dumps(body: dict[str, Any]) -> bytes:
    # As the engines' own JSON answers are written: compact, UTF-8 text left as it is.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class AssemblyFailed(Exception):
    """The replica's stream cannot be read as a completion."""

    def error(self, replica_id: str, model: str) -> RouterError:
        return RouterError(
            502,
            "upstream_failed",
            f"replica {replica_id} of model '{model}' sent a stream the router cannot read: {self}",
            type_="server_error",
        )


class _Choice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.role = "assistant"
        self.texts: dict[str, list[str]] = {}
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.function_call: dict[str, str] | None = None
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: Any = None
        # Events that carried generated text: llama-cpp-python streams one token per event
        # (two or three for a character split across tokens).
        self.tokens = 0

    def feed(self, choice: dict[str, Any], chat: bool) -> None:
        produced = False
        if chat:
            delta = choice.get("delta") or {}
            for key, value in delta.items():
                if key == "role":
                    if isinstance(value, str):
                        self.role = value
                elif key == "tool_calls":
                    produced |= self._tool_calls(value)
                elif key == "function_call":
                    produced |= self._function_call(value)
                elif isinstance(value, str):
                    # content, and what some engines stream beside it (reasoning_content)
                    self.texts.setdefault(key, []).append(value)
                    produced |= bool(value)
        else:
            text = choice.get("text")
            if isinstance(text, str):
                self.texts.setdefault("text", []).append(text)
                produced = bool(text)
        if produced:
            self.tokens += 1
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self._logprobs(logprobs)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def _tool_calls(self, calls: Any) -> bool:
        produced = False
        for call in calls or ():
            if not isinstance(call, dict):
                continue
            into = self.tool_calls.setdefault(call.get("index", len(self.tool_calls)), {})
            for key in ("id", "type"):
                if call.get(key):
                    into[key] = call[key]
            function = call.get("function") or {}
            into_function = into.setdefault("function", {"name": "", "arguments": ""})
            for key in ("name", "arguments"):
                part = function.get(key)
                if isinstance(part, str):
                    into_function[key] += part
                    produced |= bool(part)
        return produced

    def _function_call(self, call: Any) -> bool:
        if not isinstance(call, dict):
            return False
        into = self.function_call = self.function_call or {"name": "", "arguments": ""}
        produced = False
        for key in ("name", "arguments"):
            part = call.get(key)
            if isinstance(part, str):
                into[key] += part
                produced |= bool(part)
        return produced

    def _logprobs(self, logprobs: dict[str, Any]) -> None:
        # Chat: {"content": [...], "refusal": [...]}; text: parallel lists per token.
        into = self.logprobs = self.logprobs if self.logprobs is not None else {}
        for key, value in logprobs.items():
            if isinstance(value, list):
                into.setdefault(key, []).extend(value)
            elif key not in into:
                into[key] = value

    def answer(self, chat: bool) -> dict[str, Any]:
        if not chat:
            return {
                "text": "".join(self.texts.get("text", ())),
                "index": self.index,
                "logprobs": self.logprobs,
                "finish_reason": self.finish_reason,
            }
        content = self.texts.get("content", [])
        message: dict[str, Any] = {
            # An answer that is only tool calls has no content, as the engines write it.
            "content": "".join(content) if content or not (self.tool_calls or self.function_call) else None,
            "role": self.role,
        }
        for key, parts in self.texts.items():
            if key != "content":
                message[key] = "".join(parts)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if self.function_call is not None:
            message["function_call"] = self.function_call
        return {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }
