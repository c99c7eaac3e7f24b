"""The server's pieces without HTTP: tool calls found in streamed text, stop strings, the prompt cache (a
recurrent state's snapshots included), and what each protocol's parser accepts and refuses."""

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from builders import tiny_hybrid
from mosaic_runtime.engine import Engine
from mosaic_runtime.generate import StopText
from mosaic_runtime.prompt_cache import PromptCache
from mosaic_runtime.serve import anthropic_api, openai_api
from mosaic_runtime.serve.request import NOT_READ, RequestError
from mosaic_runtime.serve.tool_calls import ToolCall, ToolCallStream
from mosaic_shatter.convert import convert

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def split_feed(stream, text: str, cuts: list[int]) -> list:
    out, last = [], 0
    for cut in sorted(set(c % (len(text) + 1) for c in cuts)) + [len(text)]:
        out += stream.push(text[last:cut])
        last = cut
    return out + stream.finish()


def merged(parts: list) -> list:
    """Adjacent text pieces joined: what a client shows."""
    out = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


@given(st.lists(st.integers(0, 10_000), max_size=12))
@settings(max_examples=200, deadline=None)
def test_tool_calls_are_found_however_the_text_is_split(cuts):
    text = "Let me look.\n\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n"
    parts = merged(split_feed(ToolCallStream(), text, cuts))
    assert parts[0] == "Let me look."
    assert [(c.name, c.arguments) for c in parts[1:]] == [("get_weather", {"city": "Paris", "days": 2}),
                                                          ("get_weather", {"city": "Oslo", "days": 2})]
    assert len({c.id for c in parts[1:]}) == 2


@given(st.lists(st.integers(0, 10_000), max_size=12))
@settings(max_examples=200, deadline=None)
def test_text_that_is_not_a_call_comes_back_unchanged(cuts):
    text = "a <tool_call>not json</tool_call> b <tool_ca and <tool_call>{\"name\": 3}</tool_call> end"
    assert merged(split_feed(ToolCallStream(), text, cuts)) == [text]


def test_a_call_left_open_at_the_end_is_parsed():
    stream = ToolCallStream()
    parts = stream.push('<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}') + stream.finish()
    assert len(parts) == 1 and isinstance(parts[0], ToolCall) and parts[0].arguments == {"x": [1, 2]}
    stream = ToolCallStream()
    parts = stream.push('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}') + stream.finish()
    assert parts[0].arguments == {"x": 1}  # arguments given as a JSON string


@given(st.text(alphabet="ab\n", max_size=40), st.lists(st.integers(0, 100), max_size=8))
@settings(max_examples=300, deadline=None)
def test_stop_text_cuts_before_the_first_stop_string(text, cuts):
    stops = ["ba", "\n\n"]
    cut = StopText(stops)
    out, last = [], 0
    for c in sorted(set(c % (len(text) + 1) for c in cuts)):
        out.append(cut.push(text[last:c]))
        last = c
    out.append(cut.finish(text[last:]))
    hits = [(text.find(s), s) for s in stops if s in text]
    want, stopped = (text[:min(hits)[0]], min(hits)[1]) if hits else (text, None)
    assert "".join(out) == want and cut.stopped == stopped


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("cache")
    ckpt = tiny_hybrid("qwen3_next", root / "ckpt", seed=4)
    return convert(str(ckpt), root / "q4", "q4", progress=False).out


def test_a_recurrent_state_goes_back_to_the_snapshot_where_the_last_prompt_ended(hybrid):
    engine = Engine.open(hybrid, max_seq=128, precision="exact")
    state = engine.model.state
    cache = PromptCache(state)
    first = list(range(5, 25))
    assert cache.reuse(first) == 0
    answer = []
    for token in engine.generate_ids(first, max_new_tokens=6, cached=0):  # greedy, as the server's worker runs it
        if not answer:
            cache.prompt_fed(first)  # the state holds the prompt exactly once the first token comes
        answer.append(token)
    cache.fed(first + answer)
    # The next turn re-renders the answer differently: the shared prefix ends inside the answer, where a
    # recurrent state cannot be cut back to; the snapshot at the end of the first prompt serves instead.
    second = first + [answer[0], 99, 98] + list(range(30, 40))
    keep = cache.reuse(second)
    assert keep == len(first) and state.length == len(first)
    cached = engine.model.forward(torch.tensor(second[keep:]), keep)[-1]
    fresh = Engine.open(hybrid, max_seq=128, precision="exact").logits(second)[-1]
    assert torch.allclose(cached, fresh, atol=1e-4)
    # A request sharing less than any snapshot starts afresh.
    assert cache.reuse([5, 6, 1, 2]) == 0


def test_a_state_refilled_behind_the_cache_is_not_trusted(hybrid):
    engine = Engine.open(hybrid, max_seq=64, precision="exact")
    cache = PromptCache(engine.model.state)
    ids = list(range(3, 13))
    cache.reuse(ids)
    engine.logits(ids)
    cache.prompt_fed(ids)
    engine.logits([7, 7, 7])  # someone else fills the state
    assert cache.reuse(ids) == 0


WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_what_a_text_model_cannot_read_is_named_in_place_not_refused():
    gen = openai_api.parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in "}, {"type": "image_url", "image_url": {"url": "data:..."}}]}]})
    assert gen.messages[0]["content"] == "What is in " + NOT_READ
    gen = anthropic_api.parse_messages({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}, {"type": "text", "text": "and this?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]})
    assert gen.messages[0]["content"] == NOT_READ + "and this?" and gen.messages[2]["content"] == NOT_READ


def test_a_call_cut_short_by_max_tokens_is_only_a_call_if_its_json_is_whole():
    stream = ToolCallStream()
    assert stream.push('<tool_call>\n{"name": "f", "arguments": {"x": 1') == []
    assert stream.finish(cut_short=True) == ['<tool_call>\n{"name": "f", "arguments": {"x": 1']
    stream = ToolCallStream()
    stream.push('<tool_call>\n{"name": "f", "arguments": {"x": 1}}')
    assert isinstance(stream.finish(cut_short=True)[0], ToolCall)


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": float("nan")}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": float("inf")}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": ["auto"]}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 12}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
])
def test_openai_bodies_that_are_refused_name_the_parameter(body, param):
    with pytest.raises(RequestError) as e:
        openai_api.parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_anthropic_bodies_become_template_messages():
    gen = anthropic_api.parse_messages({
        "model": "claude-sonnet-4", "max_tokens": 100,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.40; cch=123;"},
                   {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                                       {"type": "text", "text": "Checking."},
                                                       {"type": "tool_use", "id": "t1", "name": "w",
                                                        "input": {"city": "Oslo"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                   "content": [{"type": "text", "text": "rain"}]},
                                                  {"type": "text", "text": "and tomorrow?"}]}],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "ws"}],
        "tool_choice": {"type": "any"}, "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"}})
    assert gen.messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "t1"},
        {"role": "user", "content": "and tomorrow?"}]
    assert [t["function"]["name"] for t in gen.tools] == ["w"]  # the server tool is Anthropic's to run
    assert gen.tool_choice.mode == "required"
    assert json.dumps(gen.messages)  # template-ready: plain JSON values


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages[0].content"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": ["any"]}},
     "tool_choice"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "w", "input_schema": {}}], "tool_choice": {"type": "tool", "name": {"w": 1}}}, "tool_choice"),
    ({"model": "m", "max_tokens": 5, "system": 3, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
])
def test_anthropic_bodies_that_are_refused_name_the_parameter(body, param):
    with pytest.raises(RequestError) as e:
        anthropic_api.parse_messages(body)
    assert e.value.status == 400 and e.value.param == param
