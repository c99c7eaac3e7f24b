"""The harmony response format (gpt-oss): an answer is a sequence of messages, each on a channel.

    <|channel|>analysis<|message|>...reasoning...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>

The chat template renders the prompt (it ends on `<|start|>assistant`); the model writes the rest. The
`analysis` channel is its chain of thought, `final` the answer a user reads, `commentary` tool calls and
preambles. This module splits the generated tokens into channels as they stream, so a chat shows the final
channel and, on request, the analysis; a conversation keeps the two apart for the next turn's template
(which takes the analysis as a message's `thinking` and drops it from earlier turns).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .generate import Detokenizer, TextCodec

START, END, MESSAGE, CHANNEL, RETURN, CALL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                                              "<|call|>")
FINAL, ANALYSIS = "final", "analysis"
_FUNCTION = re.compile(r"to=functions\.([^\s<]+)")  # a message to a function: a tool call


def is_harmony(codec: TextCodec) -> bool:
    """Whether the tokenizer speaks harmony: it has the channel and message tokens."""
    return all(codec.token_id(t) is not None for t in (START, END, MESSAGE, CHANNEL))


@dataclass
class HarmonyStream:
    """Tokens in, (channel, text) pieces out. A message's header (after `<|start|>` or at the very start of
    the answer: role, `<|channel|>` name, a recipient) runs up to `<|message|>`; its text up to `<|end|>`,
    `<|return|>` or `<|call|>`. Text is detokenised per message, so a character split across tokens is
    never cut."""

    codec: TextCodec
    messages: list[tuple[str, str]] = field(default_factory=list)  # (channel, text) of each message so far
    functions: list[str | None] = field(default_factory=list)  # each message's function recipient, if any
    closed: int = 0  # messages ended (by <|end|>, <|return|>, <|call|> or the next <|start|>)
    _in_header: bool = True
    _header: list[int] = field(default_factory=list)
    _text: Detokenizer | None = None

    def __post_init__(self):
        token = self.codec.token_id
        self._start, self._message, self._channel = token(START), token(MESSAGE), token(CHANNEL)
        self._ends = {t for t in (token(END), token(RETURN), token(CALL)) if t is not None}

    @property
    def channel(self) -> str:
        """The channel of the message being written ("" before its header names one)."""
        ids = self._header
        if self._channel not in ids:
            return ""
        name = self.codec.decode(ids[ids.index(self._channel) + 1:], skip_special_tokens=False)
        return name.split(" ")[0].split("<|")[0].strip()  # "commentary to=functions.x" -> "commentary"

    def push(self, token: int) -> tuple[str, str] | None:
        """(channel, new text) when the token adds text to a message, else None."""
        if self._in_header:
            if token == self._message:
                self._in_header, self._text = False, Detokenizer(self.codec)
                self.messages.append((self.channel, ""))
                to = _FUNCTION.search(self.codec.decode(self._header, skip_special_tokens=False))
                self.functions.append(to[1] if to else None)
            elif token == self._start:
                self._header = []
            else:
                self._header.append(token)
            return None
        if token in self._ends or token == self._start:
            self._close()
            return None
        piece = self._text.push(token)
        return self._add(piece) if piece else None

    def flush(self) -> tuple[str, str] | None:
        """What the last message still holds back when generation stops."""
        if self._in_header or self._text is None:
            return None
        piece = self._text.flush()
        return self._add(piece) if piece else None

    def text(self, channel: str) -> str:
        """Every message of a channel so far, joined."""
        return "\n".join(t for c, t in self.messages if c == channel)

    def _add(self, piece: str) -> tuple[str, str]:
        channel, text = self.messages[-1]
        self.messages[-1] = (channel, text + piece)
        return channel, piece

    def close(self) -> None:
        """End the message being written (generation stopped inside it)."""
        self._close()

    def _close(self) -> None:
        if self._text is not None:
            tail = self._text.flush()
            if tail:
                self._add(tail)
            self.closed += 1
        self._in_header, self._header, self._text = True, [], None

