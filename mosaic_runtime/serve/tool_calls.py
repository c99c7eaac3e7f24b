"""Tool calls in a model's streamed output: Qwen3's (and Hermes') `<tool_call>{"name", "arguments"}</tool_call>`
blocks, separated from the text around them as the text arrives; a harmony answer's (gpt-oss) function
calls written as such blocks (HarmonyText)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from ..generate import TextCodec
from ..harmony import FINAL, START, HarmonyStream

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def parse_call(body: str, id_prefix: str = "call_") -> ToolCall | None:
    """A block's JSON as a call, or None when it is not one ({"name": str, "arguments": object or its JSON})."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], args, call_id(id_prefix))


class ToolCallStream:
    """Feeds on text pieces; gives back plain text (str) and ToolCall items in order.

    Holds back what could be the start of `<tool_call>`, and whitespace that may only separate calls. A
    block whose JSON is not a call comes back as the text it was, tags included: nothing the model said is
    lost. A block left open when the output ends is parsed as if closed (a model cut short by max_tokens, or
    one that forgets the closing tag)."""

    def __init__(self, id_prefix: str = "call_"):
        self.id_prefix = id_prefix
        self.pending = ""  # text not yet given back
        self.inside = False  # within a block: pending is its body so far
        self.calls = 0
        self._space = ""  # whitespace after the last text, given back only if more text follows
        self._after_call = False
        self._before = ""  # whitespace held before the open block, given back if it is not a call

    def push(self, piece: str) -> list[str | ToolCall]:
        self.pending += piece
        out: list[str | ToolCall] = []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    return out
                self._close(self.pending[:end], out, closed=True)
                self.pending = self.pending[end + len(CLOSE):]
            else:
                start = self.pending.find(OPEN)
                if start < 0:
                    keep = _partial_suffix(self.pending, OPEN)
                    self._text(self.pending[:len(self.pending) - keep], out)
                    self.pending = self.pending[len(self.pending) - keep:]
                    return out
                self._text(self.pending[:start], out)
                self._before, self._space = self._space, ""  # whitespace before a call only separates it
                self.pending, self.inside = self.pending[start + len(OPEN):], True

    def finish(self, cut_short: bool = False) -> list[str | ToolCall]:
        """The end of the text. cut_short: it ended at max_tokens, so a block left open is a call only if its
        JSON is whole as it stands (not completed with braces it never got)."""
        out: list[str | ToolCall] = []
        if self.inside:
            self._close(self.pending, out, closed=False, repair=not cut_short)
        else:
            self._text(self.pending, out)
            if not self.calls and self._space:
                out.append(self._space)
        self.pending, self.inside, self._space = "", False, ""
        return out

    def _text(self, text: str, out: list) -> None:
        if self._after_call:  # whitespace after a call only separates it
            text = text.lstrip()
        if not text:
            return
        self._after_call = False
        body = text.rstrip()
        if body:
            out.append(self._space + body)
            self._space = text[len(body):]
        else:
            self._space += text

    def _close(self, body: str, out: list, closed: bool, repair: bool = False) -> None:
        self.inside = False
        # A model that forgot the closing tag may have left out its last braces too.
        tails = ("", "}", "}}") if repair else ("",)
        call = next(filter(None, (parse_call(body.strip() + tail, self.id_prefix) for tail in tails)), None)
        if call is None:
            self._text(self._before + OPEN + body + (CLOSE if closed else ""), out)
            return
        self.calls += 1
        self._space, self._after_call = "", True
        out.append(call)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class AnswerParts:
    """A generation's text as protocol parts: text and tool calls when the request parses tools, else text.
    forced: what the server put at the start of the answer (a tool call's opening, for tool_choice)."""

    def __init__(self, parse_tools: bool, forced: str = "", id_prefix: str = "call_"):
        self.stream = ToolCallStream(id_prefix) if parse_tools else None
        if self.stream is not None and forced:
            self.stream.push(forced)

    def push(self, text: str) -> list[str | ToolCall]:
        return self.stream.push(text) if self.stream is not None else [text] if text else []

    def finish(self, cut_short: bool = False) -> list[str | ToolCall]:
        return self.stream.finish(cut_short) if self.stream is not None else []


class HarmonyText:
    """A Detokenizer's interface (push a token, get new text; flush) over a harmony answer (gpt-oss): the
    final channel's text, and each message to `functions.NAME` (harmony's tool call, whose text is the
    arguments' JSON) as a `<tool_call>` block once it ends, for ToolCallStream to find like any other.
    The analysis channel is left out. An answer that never opens a message (a model not writing harmony)
    comes back as its plain text when it ends: nothing it said is lost."""

    def __init__(self, codec: TextCodec, prompt_ids: list[int] = ()):
        """prompt_ids: the answer continues the prompt's last message header (after its last <|start|>):
        `assistant`, and any opening a forced tool call put there."""
        self.codec, self.stream, self.given = codec, HarmonyStream(codec), 0  # messages looked at for calls
        self.answer: list[int] = []
        start = codec.token_id(START)
        last = max((i for i, t in enumerate(prompt_ids) if t == start), default=None)
        for token in prompt_ids[last:] if last is not None else ():
            self.stream.push(token)

    def push(self, token: int) -> str:
        self.answer.append(token)
        return self._final(self.stream.push(token)) + self._calls()

    def flush(self) -> str:
        text = self._final(self.stream.flush())
        self.stream.close()
        if not self.stream.messages:
            return self.codec.decode(self.answer)
        return text + self._calls()

    def _calls(self) -> str:
        out = []
        for i in range(self.given, self.stream.closed):
            name = self.stream.functions[i]
            if name:
                out.append(OPEN + json.dumps({"name": name, "arguments": self.stream.messages[i][1]},
                                             ensure_ascii=False) + CLOSE)
        self.given = self.stream.closed
        return "".join(out)

    @staticmethod
    def _final(got: tuple[str, str] | None) -> str:
        return got[1] if got is not None and got[0] == FINAL else ""
