"""Sampling and text handling for the decode loop: pure functions, no engine state."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import torch


GREEDY_BELOW = 1e-4  # a temperature under this is greedy: dividing by it would overflow the logits


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
           generator: torch.Generator | None) -> int:
    """Next token from logits [V]: greedy at temperature 0, else top-k / top-p (nucleus) sampling."""
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the smallest set reaching top_p
        keep[0] = True  # and never empty (top_p 0 is greedy)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


class ChatTemplateError(ValueError):
    """A chat template that failed to render: its syntax, what it did, or what the sandbox refused."""


@functools.lru_cache(maxsize=1)
def _sandbox():
    """Jinja's immutable sandbox (no attribute writes, no unsafe calls, range() capped), also refusing
    operations whose result alone would exhaust memory: a string or list repeated, or a power, past a
    bound no chat template needs. Built once: every turn renders through it."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
                left, right = right, left
            if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
                if len(left) * right > _MAX_REPEAT:
                    raise SecurityError(f"the template repeats a sequence {right} times")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 64:
                raise SecurityError(f"the template raises to the power {right}")
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True)
    # What Hugging Face's apply_chat_template gives templates, which real templates call: a tojson that
    # does not HTML-escape (Jinja's own writes '<' as \u003c), raise_exception, and strftime_now.
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt))
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """A chat template compiled in the sandbox, once per distinct text: every turn and request renders it."""
    from jinja2.exceptions import TemplateSyntaxError
    try:
        return _sandbox().from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template, line {e.lineno}: {e.message}") from None
    except RecursionError:
        raise ChatTemplateError("chat template: nested too deeply to parse") from None
    except Exception as e:  # noqa: BLE001 - Jinja can emit Python that does not compile ({{ m['a':] }})
        raise ChatTemplateError(f"chat template could not be compiled: {type(e).__name__}: {e}") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    from jinja2.exceptions import TemplateError
    raise TemplateError(str(message))


_MAX_REPEAT = 1 << 20


class TextCodec:
    """The checkpoint's own tokenizer.json and chat template, copied into the model directory."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        self.chat_template = template
        self.special = {k: cfg.get(k) for k in ("bos_token", "eos_token", "pad_token")}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str | dict | None) -> int | None:
        """The id of a special token given as text (or as tokenizer_config's {"content": ...}), or None."""
        if isinstance(token, dict):
            token = token.get("content")
        return self.tokenizer.token_to_id(token) if token else None

    @property
    def end_of_turn_ids(self) -> list[int]:
        """The ids that end an assistant's turn: the chat template's eos_token, when the tokenizer has it."""
        return [i for i in (self.token_id(self.special.get("eos_token")),) if i is not None]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads a `tools` list (the checkpoint's own tool-call format)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text of a conversation, rendered by the checkpoint's template in a Jinja sandbox.

        messages are in the form Hugging Face templates take: {"role", "content"}, an assistant's
        "tool_calls" [{"type": "function", "function": {"name", "arguments"}}], and "tool" results. tools
        (OpenAI's {"type": "function", "function": {...}} form) are passed on when given.

        Raises:
            ChatTemplateError: there is no template, or it does not parse, fails while rendering (whatever
                it raised), or attempts what the sandbox refuses; the message says which.
        """
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; pass a plain prompt")
        special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in self.special.items()}
        template = _compile(self.chat_template)
        try:
            extra = {"tools": tools} if tools else {}
            return template.render(messages=messages, add_generation_prompt=True, **special, **extra)
        except RecursionError:
            raise ChatTemplateError("chat template failed: it recursed too deeply") from None
        except Exception as e:  # noqa: BLE001 - a template can raise anything its expressions can
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None


class Detokenizer:
    """Turns a growing list of ids into text increments without splitting a multi-byte character."""

    def __init__(self, codec: TextCodec):
        self.codec, self.ids, self.emitted = codec, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new

    def flush(self) -> str:
        """What is still held back when generation ends (an incomplete character decodes as U+FFFD)."""
        text = self.codec.decode(self.ids)
        new, self.emitted = text[len(self.emitted):], text
        return new


class StopText:
    """Streamed text cut before the first of some stop strings (which is not returned). Holds back as many
    characters as could be the start of a stop string still arriving."""

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in stops or () if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text, self.sent = "", 0
        self.stopped: str | None = None  # the stop string that ended the text

    def push(self, piece: str) -> str:
        """Add a piece; return what can be released now (nothing more once a stop string was seen)."""
        if self.stopped is not None:
            return ""
        self.text += piece
        hits = [(self.text.find(s, max(0, self.sent - len(s))), s) for s in self.stops]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            end, self.stopped = min(hits)
            return self._release(end)
        return self._release(len(self.text) - self.hold)

    def finish(self, piece: str = "") -> str:
        """The end of the text: the last piece, and everything held back."""
        out = self.push(piece)
        return out if self.stopped is not None else out + self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out
