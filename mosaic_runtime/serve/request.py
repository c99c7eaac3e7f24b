"""What both protocols' requests become, and the validation helpers their parsers share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOKENS_LIMIT = 1_000_000  # a max_tokens past this is a client bug, not a long answer
STOP_LIMIT = 16  # stop strings per request
NOT_READ = "[an image or file was here: this model reads text only]"  # in place of what it cannot read


class RequestError(ValueError):
    """A request the server refuses: HTTP status, message, the offending parameter, and the error kind
    ("invalid_request", "authentication", "not_found", "too_large", "engine"), shaped per protocol."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, kind: str = "invalid_request"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # "auto", "none", "required" (some tool), "function" (the named one)
    name: str | None = None


@dataclass
class Generation:
    """One generation, whichever protocol asked: a chat (messages in Hugging Face template form) or a raw
    prompt, how to sample, and when to stop."""

    model: str
    max_tokens: int
    messages: list[dict] | None = None
    prompt: str | None = None
    tools: list[dict] = field(default_factory=list)  # OpenAI form: {"type": "function", "function": {...}}
    tool_choice: ToolChoice = ToolChoice()
    temperature: float | None = None  # None: the model's generation_config.json, else 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"


_TYPES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
          dict: "an object"}


def field_of(body: dict, name: str, kind: type, *, required: bool = False, default=None, low=None, high=None,
             where: str | None = None):
    """body[name] checked to be of kind (bool is not an int, an int is a float) and within [low, high]."""
    label = f"{where}.{name}" if where else name
    if name not in body or body[name] is None:
        if required:
            raise RequestError(f"'{label}' is required", param=label)
        return default
    value = body[name]
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise RequestError(f"'{label}' must be {_TYPES[kind]}, not {type(value).__name__}", param=label)
    if kind is float and not math.isfinite(value):
        raise RequestError(f"'{label}' must be a finite number, not {value}", param=label)
    if low is not None and value < low or high is not None and value > high:
        bounds = f"between {low} and {high}" if low is not None and high is not None else \
            f"at least {low}" if low is not None else f"at most {high}"
        raise RequestError(f"'{label}' must be {bounds}, not {value}", param=label)
    return value


def sampling_fields(body: dict) -> dict:
    """temperature, top_p, top_k and seed, which both protocols spell alike."""
    return dict(temperature=field_of(body, "temperature", float, low=0.0, high=2.0),
                top_p=field_of(body, "top_p", float, low=0.0, high=1.0),
                top_k=field_of(body, "top_k", int, low=0, high=1 << 20),
                seed=field_of(body, "seed", int, low=-(1 << 63), high=(1 << 64) - 1))


def max_tokens_field(body: dict, *names: str, required: bool = False) -> int | None:
    for name in names:
        value = field_of(body, name, int, low=1, high=MAX_TOKENS_LIMIT)
        if value is not None:
            return value
    if required:
        raise RequestError(f"'{names[0]}' is required", param=names[0])
    return None


def stop_field(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RequestError(f"'{name}' must be a string or an array of strings", param=name)
    if len(value) > STOP_LIMIT:
        raise RequestError(f"'{name}' has {len(value)} entries; at most {STOP_LIMIT}", param=name)
    return [s for s in value if s]
