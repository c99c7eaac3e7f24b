"""The OpenAI protocol: /v1/chat/completions, /v1/completions and /v1/models bodies, in and out."""

from __future__ import annotations

import json
import secrets
from typing import AsyncIterator

from .request import (MAX_TOKENS_LIMIT, NOT_READ, Generation, RequestError, ToolChoice, field_of, max_tokens_field,
                      sampling_fields, stop_field)
from .run import Done, Run
from .tool_calls import ToolCall

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
ERROR_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
               "not_found": "not_found_error", "too_large": "invalid_request_error", "engine": "server_error"}
COMPLETION_DEFAULT_MAX = 16  # the legacy endpoint's documented default


def error_body(err: RequestError) -> dict:
    return {"error": {"message": str(err), "type": ERROR_TYPES.get(err.kind, "invalid_request_error"),
                      "param": err.param, "code": None}}


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"'{where}.content' must be a string or an array of parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_image", "input_audio", "file"):
            texts.append(NOT_READ)  # a text-only model: say so in place, and let the conversation go on
            continue
        if kind not in ("text", "input_text", "output_text"):
            raise RequestError(f"'{where}.content[{j}]' must be a content part, such as "
                               "{\"type\": \"text\", \"text\": ...}", param=f"{where}.content")
        texts.append(field_of(part, "text", str, required=True, where=f"{where}.content[{j}]"))
    return "".join(texts)


def _arguments(text) -> dict | str:
    """A tool call's arguments as the template wants them: an object when the JSON string parses."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text) if isinstance(text, str) and text.strip() else {}
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _messages(body: dict) -> list[dict]:
    messages = field_of(body, "messages", list, required=True)
    if not messages:
        raise RequestError("'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object", param=where)
        role = field_of(m, "role", str, required=True, where=where)
        if role not in ROLES:
            raise RequestError(f"'{where}.role' is {role!r}; expected one of {sorted(ROLES)}", param=f"{where}.role")
        msg = {"role": ROLES[role], "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = field_of(m, "tool_calls", list, where=where)
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                fn = field_of(c if isinstance(c, dict) else {}, "function", dict, required=True,
                              where=f"{where}.tool_calls[{j}]")
                name = field_of(fn, "name", str, required=True, where=f"{where}.tool_calls[{j}].function")
                msg["tool_calls"].append({"id": c.get("id"), "type": "function",
                                          "function": {"name": name, "arguments": _arguments(fn.get("arguments"))}})
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def _tools(body: dict) -> tuple[list[dict], ToolChoice]:
    tools = field_of(body, "tools", list, default=[])
    out = []
    for i, t in enumerate(tools):
        fn = field_of(t if isinstance(t, dict) else {}, "function", dict, required=True, where=f"tools[{i}]")
        where = f"tools[{i}].function"
        entry = {"name": field_of(fn, "name", str, required=True, where=where),
                 "description": field_of(fn, "description", str, default="", where=where),
                 "parameters": field_of(fn, "parameters", dict, default={"type": "object", "properties": {}},
                                        where=where)}
        out.append({"type": "function", "function": entry})
    choice = body.get("tool_choice")
    if choice is None or isinstance(choice, str) and choice == "auto":
        return out, ToolChoice()
    if isinstance(choice, str) and choice in ("none", "required"):
        return out, ToolChoice(choice)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in out}:
            raise RequestError(f"'tool_choice' names {name!r}, which is not among the tools", param="tool_choice")
        return out, ToolChoice("function", name)
    raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                       "\"function\": {\"name\"}}", param="tool_choice")


def _common(body: dict) -> dict:
    if field_of(body, "n", int, default=1) != 1:
        raise RequestError("'n' must be 1: this server generates one choice", param="n")
    options = field_of(body, "stream_options", dict, default={})
    return dict(model=field_of(body, "model", str, default=""), stop=stop_field(body, "stop"),
                stream=field_of(body, "stream", bool, default=False),
                include_usage=field_of(options, "include_usage", bool, default=False, where="stream_options"),
                **sampling_fields(body))


def parse_chat(body: dict) -> Generation:
    tools, choice = _tools(body)
    return Generation(messages=_messages(body), tools=tools, tool_choice=choice,
                      max_tokens=max_tokens_field(body, "max_completion_tokens", "max_tokens") or MAX_TOKENS_LIMIT,
                      **_common(body))


def parse_completion(body: dict) -> Generation:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string (one prompt per request)", param="prompt")
    return Generation(prompt=prompt, max_tokens=max_tokens_field(body, "max_tokens") or COMPLETION_DEFAULT_MAX,
                      **_common(body))


def models_body(names: list[str], created: int) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "mosaic"}
                                       for n in names]}


def _usage(run: Run, done: Done) -> dict:
    prompt, completion = run.started.prompt_tokens, done.finished.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": run.started.cached_tokens}}


def _finish_reason(done: Done) -> str:
    return "tool_calls" if done.called_tools else "length" if done.finished.reason == "length" else "stop"


def _call(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}


def response_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


async def chat_body(run: Run) -> dict:
    text, calls, done = await run.collect()
    message = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = [_call(c) for c in calls]
    return {"id": response_id("chatcmpl-"), "object": "chat.completion", "created": run.created,
            "model": run.started.model, "choices": [{"index": 0, "message": message, "logprobs": None,
                                                     "finish_reason": _finish_reason(done)}],
            "usage": _usage(run, done)}


async def completion_body(run: Run) -> dict:
    text, _, done = await run.collect()
    return {"id": response_id("cmpl-"), "object": "text_completion", "created": run.created,
            "model": run.started.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(done)}],
            "usage": _usage(run, done)}


def frame(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def stream_error(err: RequestError) -> str:
    """A failure after the stream began: the SDK raises it from the chunk's `error`."""
    return frame(error_body(err))


async def chat_stream(run: Run) -> AsyncIterator[str]:
    """SSE frames: a role delta, content and tool-call deltas, one finish_reason, usage if asked, [DONE]."""
    head = {"id": response_id("chatcmpl-"), "object": "chat.completion.chunk", "created": run.created,
            "model": run.started.model}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return frame({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for part in run.parts():
            if isinstance(part, Done):
                yield chunk({}, _finish_reason(part))
                if run.gen.include_usage:
                    yield frame({**head, "choices": [], "usage": _usage(run, part)})
            elif isinstance(part, ToolCall):
                yield chunk({"tool_calls": [_call(part, calls)]})
                calls += 1
            else:
                yield chunk({"content": part})
    except RequestError as e:
        yield stream_error(e)
        return
    yield frame("[DONE]")


async def completion_stream(run: Run) -> AsyncIterator[str]:
    head = {"id": response_id("cmpl-"), "object": "text_completion", "created": run.created,
            "model": run.started.model}
    try:
        async for part in run.parts():
            if isinstance(part, Done):
                yield frame({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                  "finish_reason": _finish_reason(part)}]})
                if run.gen.include_usage:
                    yield frame({**head, "choices": [], "usage": _usage(run, part)})
            else:
                yield frame({**head, "choices": [{"index": 0, "text": part, "logprobs": None, "finish_reason": None}]})
    except RequestError as e:
        yield stream_error(e)
        return
    yield frame("[DONE]")
