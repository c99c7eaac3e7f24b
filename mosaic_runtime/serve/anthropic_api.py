"""The Anthropic protocol: /v1/messages and /v1/messages/count_tokens bodies, in and out."""

from __future__ import annotations

import json
import secrets
from typing import AsyncIterator

from .request import (NOT_READ, Generation, RequestError, ToolChoice, field_of, max_tokens_field, sampling_fields,
                      stop_field)
from .run import Done, Run
from .tool_calls import ToolCall

ERROR_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
               "not_found": "not_found_error", "too_large": "request_too_large", "engine": "api_error"}
# Claude Code opens its system prompt with this block; its value changes on every request, which would
# defeat any prompt cache, and it means nothing to a local model.
ATTRIBUTION_PREFIX = "x-anthropic-billing-header:"
IGNORED_BLOCKS = ("thinking", "redacted_thinking")
READ_AS_PLACEHOLDER = ("image", "document")  # a text-only model cannot read them; refusing would stall a session


def error_body(err: RequestError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.kind, "invalid_request_error"),
                                       "message": str(err)}}


def _system(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        blocks = [value]
    elif isinstance(value, list):
        blocks = [field_of(b if isinstance(b, dict) else {}, "text", str, required=True, where=f"system[{i}]")
                  for i, b in enumerate(value)]
    else:
        raise RequestError("'system' must be a string or an array of text blocks", param="system")
    kept = []
    for text in blocks:
        if text.startswith(ATTRIBUTION_PREFIX):
            text = text.partition("\n")[2]  # the header is one line; anything after it is the prompt
        if text:
            kept.append(text)
    return "\n\n".join(kept)


def _block_text(content, where: str) -> str:
    """A tool_result's content: a string, or its text blocks joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in READ_AS_PLACEHOLDER:
            texts.append(NOT_READ)
            continue
        if kind != "text":
            raise RequestError(f"'{where}[{j}]' must be a text block", param=where)
        texts.append(field_of(block, "text", str, required=True, where=f"{where}[{j}]"))
    return "\n".join(texts)


def _messages(body: dict) -> list[dict]:
    messages = field_of(body, "messages", list, required=True)
    if not messages:
        raise RequestError("'messages' must not be empty", param="messages")
    system = [_system(body.get("system"))]
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object", param=where)
        role = field_of(m, "role", str, required=True, where=where)
        if role not in ("user", "assistant", "system"):
            raise RequestError(f"'{where}.role' is {role!r}; expected 'user' or 'assistant'", param=f"{where}.role")
        content = m.get("content")
        if role == "system":  # not in the protocol, but clients send it: lenient, as the system prompt
            system.append(_system(content))
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"'{where}.content' must be a string or an array of blocks", param=f"{where}.content")
        text, calls = [], []
        for j, block in enumerate(content):
            bw = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(field_of(block, "text", str, required=True, where=bw))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": field_of(block, "name", str, required=True, where=bw),
                                           "arguments": field_of(block, "input", dict, default={}, where=bw)}})
            elif kind == "tool_result" and role == "user":
                result = _block_text(block.get("content"), f"{bw}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "content": result, "tool_call_id": block.get("tool_use_id")})
            elif kind in IGNORED_BLOCKS:
                continue
            elif kind in READ_AS_PLACEHOLDER:  # an image Claude Code read, say: the turn goes on without it
                text.append(NOT_READ)
            else:
                raise RequestError(f"'{bw}' is a {kind!r} block, which this server cannot read in a {role} turn",
                                   param=f"{where}.content")
        if text or calls or role == "assistant":
            msg = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    system_text = "\n\n".join(s for s in system if s)
    return ([{"role": "system", "content": system_text}] if system_text else []) + out


def _tools(body: dict) -> tuple[list[dict], ToolChoice]:
    tools = field_of(body, "tools", list, default=[])
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise RequestError(f"'tools[{i}]' must be an object", param="tools")
        if t.get("type") not in (None, "custom"):
            continue  # a server tool (web search, code execution) runs at Anthropic, not here
        name = field_of(t, "name", str, required=True, where=f"tools[{i}]")
        out.append({"type": "function", "function": {
            "name": name, "description": field_of(t, "description", str, default="", where=f"tools[{i}]"),
            "parameters": field_of(t, "input_schema", dict, default={"type": "object", "properties": {}},
                                   where=f"tools[{i}]")}})
    choice = field_of(body, "tool_choice", dict, default={"type": "auto"})
    kind = choice.get("type") if isinstance(choice.get("type"), str) else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in out}:
            raise RequestError(f"'tool_choice' names {name!r}, which is not among the tools", param="tool_choice")
        return out, ToolChoice("function", name)
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in modes:
        raise RequestError("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")
    return out, ToolChoice(modes[kind])


def parse_messages(body: dict, *, counting: bool = False) -> Generation:
    tools, choice = _tools(body)
    return Generation(model=field_of(body, "model", str, required=not counting, default=""),
                      max_tokens=max_tokens_field(body, "max_tokens", required=not counting) or 1,
                      messages=_messages(body), tools=tools, tool_choice=choice,
                      stop=stop_field(body, "stop_sequences"),
                      stream=field_of(body, "stream", bool, default=False), **sampling_fields(body))


def _usage(run: Run, output_tokens: int) -> dict:
    cached = run.started.cached_tokens
    return {"input_tokens": run.started.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def _stop(done: Done) -> tuple[str, str | None]:
    if done.called_tools:
        return "tool_use", None
    reason = done.finished.reason
    if reason == "stop_sequence":
        return "stop_sequence", done.finished.stop_sequence
    return ("max_tokens" if reason == "length" else "end_turn"), None


def _tool_use(call: ToolCall, empty: bool = False) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": {} if empty else call.arguments}


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _message(run: Run, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
    return {"id": message_id(), "type": "message", "role": "assistant", "model": run.started.model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


async def message_body(run: Run) -> dict:
    text, calls, done = await run.collect()
    content = ([{"type": "text", "text": text}] if text or not calls else []) + [_tool_use(c) for c in calls]
    return _message(run, content, _stop(done), _usage(run, done.finished.completion_tokens))


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def stream_error(err: RequestError) -> str:
    """A failure after the stream began: the SDK raises it from the `error` event."""
    return event("error", error_body(err))


async def message_stream(run: Run) -> AsyncIterator[str]:
    """message_start, then per block content_block_start / _delta / _stop, message_delta, message_stop."""
    yield event("message_start", {"type": "message_start",
                                  "message": _message(run, [], (None, None), _usage(run, 0))})
    index, text_open = 0, False
    try:
        async for part in run.parts():
            if isinstance(part, str):
                if not text_open:
                    yield event("content_block_start", {"type": "content_block_start", "index": index,
                                                        "content_block": {"type": "text", "text": ""}})
                    text_open = True
                yield event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": {"type": "text_delta", "text": part}})
                continue
            if text_open:
                yield event("content_block_stop", {"type": "content_block_stop", "index": index})
                index, text_open = index + 1, False
            if isinstance(part, ToolCall):
                yield event("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": _tool_use(part, empty=True)})
                yield event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": part.arguments_json}})
                yield event("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            else:  # Done
                stop = _stop(part)
                yield event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                              "usage": _usage(run, part.finished.completion_tokens)})
                yield event("message_stop", {"type": "message_stop"})
    except RequestError as e:
        yield stream_error(e)
