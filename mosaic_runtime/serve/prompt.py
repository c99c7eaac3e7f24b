"""A Generation as token ids: the chat rendered by the model's own template (tools included), or the raw
prompt; and whether it fits the context."""

from __future__ import annotations

import json

from ..generate import ChatTemplateError
from ..harmony import is_harmony
from .fleet import ModelEntry
from .request import Generation, RequestError


def forced_opening(gen: Generation, harmony: bool = False) -> str:
    """The start of the answer that tool_choice demands, in the <tool_call> format of the Qwen templates, or
    (harmony) as a commentary message to a function."""
    if harmony:
        if gen.tool_choice.mode == "required":
            return "<|channel|>commentary to=functions."
        if gen.tool_choice.mode == "function":
            return f"<|channel|>commentary to=functions.{gen.tool_choice.name} <|constrain|>json<|message|>"
        return ""
    if gen.tool_choice.mode == "required":
        return "<tool_call>\n"
    if gen.tool_choice.mode == "function":
        return '<tool_call>\n{"name": ' + json.dumps(gen.tool_choice.name) + ', "arguments": '
    return ""


def prompt_ids(entry: ModelEntry, gen: Generation, max_seq: int) -> tuple[list[int], str]:
    """(the prompt's token ids, the forced opening they end with as the answer's tool-call parser must see it:
    none for harmony, whose opening the worker reads from the prompt's last message header).

    Raises:
        RequestError: the template fails or cannot render tools, the prompt is empty, or it does not fit.
    """
    codec = entry.codec
    forced = ""
    if gen.messages is not None:
        tools = gen.tools if gen.parses_tools else None
        if tools and not codec.renders_tools:
            raise RequestError(f"model {entry.name}'s chat template does not render tools", param="tools")
        try:
            text = codec.render_chat(gen.messages, tools)
        except ChatTemplateError as e:
            raise RequestError(f"the chat template of {entry.name} cannot render these messages: {e}",
                               param="messages") from None
        harmony = is_harmony(codec)
        opening = forced_opening(gen, harmony) if tools else ""
        text += opening
        forced = "" if harmony else opening
    else:
        text = gen.prompt or ""
    ids = codec.encode(text)
    if not ids:
        raise RequestError("the prompt is empty", param="messages" if gen.messages is not None else "prompt")
    if len(ids) > max_seq:
        raise RequestError(f"the prompt is {len(ids):,} tokens; this server's context holds {max_seq:,} (start "
                           f"it with a larger --max-seq)", param="messages" if gen.messages is not None else "prompt")
    return ids, forced
