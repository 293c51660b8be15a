"""Tool calls, the reply side: the model's text turned into OpenAI's ``tool_calls`` and the content left
around them, whole or as the text streams in.

One parser does both: ``ToolCallStream`` takes the text as it comes and gives back pieces -- content
text, or a complete ``ToolCall`` -- and ``ToolParser.parse`` is that stream run over the whole text, so a
streamed reply and a whole one always agree.  Per format (``router/tool_calls.py``):

    hermes        every <tool_call>{...}</tool_call> block is a call; text around the blocks is content
                  and streams as it comes, except a possible start of "<tool_call>" (held until it is
                  known) and a block itself (held until "</tool_call>", or the end of the text: a block
                  left open at the end is parsed too)
    llama3_json   a reply that starts with "{" (or Llama's <|python_tag|>) is held to its end and read as
                  calls -- {"name": ..., "parameters": {...}}, several separated by ";" as vLLM reads
                  them; any other reply is content and streams as it comes
    generic       the same, with {"name": ..., "arguments": {...}} or a JSON list of them

A list or a ";" series cut short (max_tokens) keeps its complete calls; the cut one stays content.

A call is a JSON object naming one of the request's tools, with an object of arguments (under
``arguments`` or ``parameters``; an object written as a JSON string is read too).  Anything else -- JSON
that does not parse, an unknown name -- stays content, exactly as the model wrote it.  With
``parallel_tool_calls: false`` only the first call is kept.  Whitespace between content and calls is
dropped; a reply without calls keeps every character.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from router.tool_calls import ToolCall, ToolFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

Piece = str | ToolCall  # content text, or one complete call


def new_call_id() -> str:
    """An id of OpenAI's shape (``call_`` and 24 characters) that the client sends back with the result."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # None when the reply is only calls
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolParser:
    """How one request's reply is read: its template's format, the tools it may call, how many calls."""

    format: ToolFormat
    names: frozenset[str]
    parallel: bool

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def parse(self, text: str) -> ParsedReply:
        stream = self.stream()
        pieces = stream.push(text) + stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = tuple(p for p in pieces if isinstance(p, ToolCall))
        return ParsedReply(content if content or not calls else None, calls)

    def call(self, value: Any) -> ToolCall | None:
        """``value`` (parsed JSON) as a call of one of the tools, or None."""
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters"))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


class _Prose:
    """Content text, with trailing whitespace held until it is known whether a call follows it."""

    def __init__(self) -> None:
        self.held = ""

    def text(self, s: str) -> str:
        s = self.held + s
        kept = s.rstrip()
        self.held = s[len(kept) :]
        return kept

    def call_starts(self) -> str:
        held, self.held = self.held, ""
        return held

    def end(self, any_calls: bool) -> str:
        held, self.held = self.held, ""
        return "" if any_calls else held


class ToolCallStream:
    """One reply's text in, pieces out (see the module docstring)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.calls = 0
        self._prose = _Prose()
        self._buf = ""
        # hermes: "text" or "call" (inside a block); JSON formats: "start" (only whitespace yet),
        # "json" (the reply is held to its end) or "text"
        self._state = "text" if parser.format == "hermes" else "start"

    def push(self, text: str) -> list[Piece]:
        if self.parser.format == "hermes":
            return self._push_hermes(text)
        return self._push_json(text)

    def finish(self) -> list[Piece]:
        """The pieces still held, at the end of the reply."""
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        if self._state == "call":  # a block left open at the end
            out += self._block(buf, OPEN + buf)
        elif self._state == "json":
            read = self._json_calls(buf)
            if read is None:
                out += self._content(buf)
            else:  # the calls, then what follows the last complete one (a call cut by max_tokens)
                out += self._keep(read[0])
                out += self._content_raw(read[1])
        else:
            out += self._content(buf)
        out += self._content_raw(self._prose.end(self.calls > 0))
        return out

    def _push_hermes(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._state == "text":
                k = self._buf.find(OPEN)
                if k < 0:  # hold what could still become "<tool_call>"
                    keep = _prefix_overlap(self._buf, OPEN)
                    out += self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out += self._content(self._buf[:k])
                self._buf, self._state = self._buf[k + len(OPEN) :], "call"
                continue
            k = self._buf.find(CLOSE)
            if k < 0:
                return out
            body, self._buf, self._state = self._buf[:k], self._buf[k + len(CLOSE) :], "text"
            out += self._block(body, OPEN + body + CLOSE)

    def _block(self, body: str, raw: str) -> list[Piece]:
        """One hermes block: a call, or (not one) its text as content, with the whitespace before it."""
        held = self._prose.call_starts()
        try:
            call = self.parser.call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return self._content(held + raw)
        return self._keep([call])

    def _push_json(self, text: str) -> list[Piece]:
        if self._state == "text":
            return self._content(text)
        self._buf += text
        if self._state == "json":
            return []
        head = self._buf.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and self.parser.format == "llama3_json"):
            return []  # not known yet
        opens = ("{", PYTHON_TAG) if self.parser.format == "llama3_json" else ("{", "[")
        if head.startswith(opens):
            self._state = "json"
            return []
        self._state, buf, self._buf = "text", self._buf, ""
        return self._content(buf)

    def _json_calls(self, text: str) -> tuple[list[ToolCall], str] | None:
        """The held reply as calls, and the text after the last complete one: a list or a ";" series cut
        short (max_tokens) keeps its complete calls, the cut one left as the model wrote it.  None when
        the reply is not calls."""
        text = text.strip()
        if self.parser.format == "generic" and not text.startswith("["):
            try:
                values, rest = [json.loads(text)], ""
            except json.JSONDecodeError:
                return None
        elif self.parser.format == "generic":
            values, rest = _json_series(text, 1, ",", "]")
        else:
            values, rest = _json_series(text.removeprefix(PYTHON_TAG).lstrip(), 0, ";", "")
        calls = [self.parser.call(v) for v in values]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None], rest

    def _keep(self, calls: list[ToolCall]) -> list[Piece]:
        """The calls this reply may still make (one in all without parallel calls)."""
        if not self.parser.parallel:
            calls = calls[: max(0, 1 - self.calls)]
        self.calls += len(calls)
        return list(calls)

    def _content(self, text: str) -> list[Piece]:
        return self._content_raw(self._prose.text(text)) if text else []

    @staticmethod
    def _content_raw(text: str) -> list[Piece]:
        return [text] if text else []


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a start of ``tag`` (shorter than it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_series(text: str, at: int, separator: str, close: str) -> tuple[list[Any], str]:
    """The JSON values of ``text`` from ``at`` on, one ``separator`` between two, to ``close`` (or the
    end of the text where ``close`` is ""): a JSON list (",", "]") or Llama 3's parallel calls (";", as
    vLLM reads them).  Returns the values read and the text from the first that is not complete -- ""
    when the series is whole; all of ``text`` when anything but a cut value breaks it."""
    decoder, values = json.JSONDecoder(), list[Any]()
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if close and text.startswith(close, at) and not values and not text[at + 1 :].strip():
            return values, ""  # an empty list
        start = at
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            return (values, text[start:]) if _ended_inside(text, exc) else ([], text)
        values.append(value)
        rest = text[at:].lstrip()
        if not rest:  # whole, or (a list) cut right after a value
            return values, ""
        if close and rest.startswith(close) and not rest[1:].strip():
            return values, ""
        if not rest.startswith(separator):
            return [], text
        at = len(text) - len(rest) + 1


def _ended_inside(text: str, exc: json.JSONDecodeError) -> bool:
    """Whether the text ended inside the value ``exc`` failed on (cut, not malformed): it failed at the
    end, in a string left open, or in a literal cut short (``tr``)."""
    tail = text[exc.pos :]
    return (
        exc.pos >= len(text)
        or exc.msg.startswith("Unterminated string")
        or any(word.startswith(tail) for word in ("true", "false", "null"))
    )
