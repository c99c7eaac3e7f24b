"""A Generation as token ids: the chat rendered by the model's own template (tools included), or the raw
prompt; and whether it fits the context."""

from __future__ import annotations

import json

from ..generate import ChatTemplateError
from .fleet import ModelEntry
from .request import Generation, RequestError


def forced_opening(gen: Generation) -> str:
    """The start of the answer that tool_choice demands, in the <tool_call> format of the Qwen templates."""
    if gen.tool_choice.mode == "required":
        return "<tool_call>\n"
    if gen.tool_choice.mode == "function":
        return '<tool_call>\n{"name": ' + json.dumps(gen.tool_choice.name) + ', "arguments": '
    return ""


def prompt_ids(entry: ModelEntry, gen: Generation, max_seq: int) -> tuple[list[int], str]:
    """(the prompt's token ids, the forced opening they end with).

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
        forced = forced_opening(gen) if tools else ""
        text += forced
    else:
        text = gen.prompt or ""
    ids = codec.encode(text)
    if not ids:
        raise RequestError("the prompt is empty", param="messages" if gen.messages is not None else "prompt")
    if len(ids) > max_seq:
        raise RequestError(f"the prompt is {len(ids):,} tokens; this server's context holds {max_seq:,} (start "
                           f"it with a larger --max-seq)", param="messages" if gen.messages is not None else "prompt")
    return ids, forced
