"""Tool calls end to end through both SDKs, with the model's output scripted (the bundled model was never
taught to call tools): everything else is real, the engine's prefill, the server and the protocols."""

import json
import threading

import anthropic
import openai
import pytest
import uvicorn

from mosaic_runtime.engine import Engine
from mosaic_runtime.generate import TextCodec
from mosaic_runtime.serve.app import Server, build_app
from mosaic_runtime.serve.fleet import Fleet, ModelEntry
from mosaic_runtime.serve.worker import Worker
from mosaic_shatter.convert import convert
from serving import BUNDLED, free_port, wait_until_up

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def scripted(engine: Engine, script: dict) -> Engine:
    """The engine prefills for real, then 'generates' script["text"] token by token (and then its end of turn)."""
    real = engine.generate_ids

    def generate_ids(prompt_ids, *, max_new_tokens, cached=0, **sampling):
        for _ in real(prompt_ids, max_new_tokens=1, cached=cached, **sampling):
            pass
        engine.stats.new_tokens = 0
        for token in engine.codec.encode(script["text"])[:max_new_tokens]:
            engine.stats.new_tokens += 1
            yield token
        engine.stats.new_tokens += 1  # the end of turn, not yielded

    engine.generate_ids = generate_ids
    return engine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = convert(str(BUNDLED), tmp_path_factory.mktemp("tools") / "stdlib-q4", "q4", progress=False).out
    script = {"text": CALL}
    fleet = Fleet([ModelEntry("stdlib-q4", model)], lambda path: scripted(Engine.open(path, max_seq=1024), script))
    worker = Worker(fleet)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(Server(fleet, worker, max_seq=1024)), port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until_up(url)
    yield url, script
    uv.should_exit = True
    thread.join(timeout=30)
    worker.call(fleet.close)
    worker.stop()


def test_openai_tool_round_trip(server):
    url, script = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    script["text"] = "Let me check.\n" + CALL
    res = client.chat.completions.create(model="stdlib-q4", messages=ASK, tools=[WEATHER])
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "C"}
    # Streamed: the call arrives as one indexed tool-call delta, then finish_reason tool_calls.
    chunks = list(client.chat.completions.create(model="stdlib-q4", messages=ASK, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].index == 0 and deltas[0][0].function.name == "get_weather"
    assert json.loads(deltas[0][0].function.arguments) == {"city": "Oslo", "unit": "C"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The result goes back; the model answers in text.
    script["text"] = "It rains in Oslo."
    back = client.chat.completions.create(model="stdlib-q4", tools=[WEATHER], messages=[
        *ASK, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "rain, 4 C"}])
    assert back.choices[0].finish_reason == "stop" and back.choices[0].message.content == "It rains in Oslo."
    assert back.usage.prompt_tokens_details.cached_tokens > res.usage.prompt_tokens - 5  # the call's turn was cached
    # tool_choice naming a function: the server opens the call itself, the model gives the arguments.
    script["text"] = '{"city": "Bergen"}}\n</tool_call>'
    forced = client.chat.completions.create(model="stdlib-q4", messages=ASK, tools=[WEATHER],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(forced.choices[0].message.tool_calls[0].function.arguments) == {"city": "Bergen"}


def test_anthropic_tool_round_trip(server):
    url, script = server
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    script["text"] = "Checking.\n" + CALL
    msg = client.messages.create(model="claude-haiku-4-5", max_tokens=200, messages=ASK, tools=tools)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["text", "tool_use"]
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Oslo", "unit": "C"} and use.id
    with client.messages.stream(model="claude-haiku-4-5", max_tokens=200, messages=ASK, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].text == "Checking."
    assert final.content[1].input == {"city": "Oslo", "unit": "C"}  # accumulated from input_json_delta
    script["text"] = "Rain."
    back = client.messages.create(model="claude-haiku-4-5", max_tokens=200, tools=tools, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain, 4 C"}]}])
    assert back.stop_reason == "end_turn" and back.content[0].text == "Rain."
    # A call cut short by max_tokens is still a call when its JSON is whole (the closing tag never came).
    script["text"] = CALL
    ids = TextCodec(BUNDLED).encode(CALL)
    n = next(n for n in range(len(ids)) if TextCodec(BUNDLED).decode(ids[:n]).endswith('"C"}}'))
    short = client.messages.create(model="m", max_tokens=n, messages=ASK, tools=tools)
    assert short.stop_reason == "tool_use" and short.content[-1].input == {"city": "Oslo", "unit": "C"}
