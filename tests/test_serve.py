"""`mosaic serve` as its users reach it: a real server process on the bundled model, driven by the real
`openai` and `anthropic` SDKs and by plain HTTP for what no SDK sends."""

import json
import threading
import time

import anthropic
import openai
import pytest

from builders import flip_byte
from mosaic_runtime.engine import Engine
from mosaic_runtime.generate import TextCodec
from mosaic_shatter.convert import convert
from serving import BUNDLED, ServerProcess, request

KEY = "test-key"
MAX_SEQ = 1024
ASK = [{"role": "user", "content": "What does `json.dumps` do?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return convert(str(BUNDLED), tmp_path_factory.mktemp("serve") / "stdlib-q4", "q4", progress=False).out


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc = ServerProcess([str(model), "--api-key", KEY, "--max-seq", str(MAX_SEQ)], tmp_path_factory.mktemp("home"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(model):
    """The same model in-process: what the server's answers must equal."""
    with Engine.open(model, max_seq=MAX_SEQ) as engine:
        yield engine


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def prompt_len(model, messages, tools=None) -> int:
    codec = TextCodec(model)
    return len(codec.encode(codec.render_chat(messages, tools)))


def greedy(engine, messages, max_new_tokens) -> str:
    return "".join(engine.generate(messages, max_new_tokens=max_new_tokens))


def sse(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each frame."""
    frames = []
    for block in raw.decode().split("\n\n"):
        lines = block.strip().splitlines()
        if not lines or all(line.startswith(":") for line in lines):
            continue
        name = next((line[7:] for line in lines if line.startswith("event: ")), None)
        frames.append((name, "\n".join(line[6:] for line in lines if line.startswith("data: "))))
    return frames


def test_models_health_and_the_web_chat_page_answer(server, oai):
    assert [m.id for m in oai.models.list()] == ["stdlib-q4"]
    status, _, body = request(server.url, "GET", "/models", headers={"authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(body)["data"][0]["id"] == "stdlib-q4"
    status, _, body = request(server.url, "GET", "/health")
    assert status == 200 and json.loads(body)["model"] == "stdlib-q4"
    status, headers, body = request(server.url, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"/v1/chat/completions" in body


def test_openai_chat_gives_the_engines_answer_and_true_counts(server, oai, model, reference):
    res = oai.chat.completions.create(model="stdlib-q4", messages=ASK, max_tokens=24, temperature=0)
    choice = res.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == greedy(reference, ASK, 24)
    assert res.usage.prompt_tokens == prompt_len(model, ASK)
    ended = choice.finish_reason == "stop"  # the end-of-turn token counts as generated
    assert res.usage.completion_tokens == len(reference.codec.encode(choice.message.content)) + ended
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens


def test_openai_stream_framing(server, oai, reference):
    status, headers, raw = request(server.url, "POST", "/v1/chat/completions", {
        "model": "stdlib-q4", "messages": ASK, "max_tokens": 8, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}, {"authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    frames = sse(raw)
    assert all(name is None for name, _ in frames) and frames[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert not any("role" in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    finishes = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and not finishes[0]["choices"][0]["delta"].get("content")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == greedy(reference, ASK, 8)
    # Through the SDK, and without include_usage: no usage chunk.
    stream = oai.chat.completions.create(model="stdlib-q4", messages=ASK, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_openai_stop_strings_and_seed(oai):
    whole = oai.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0).choices[0].message.content
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    cut = oai.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0, stop=[stop, "@@"])
    assert cut.choices[0].message.content == whole[:whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = oai.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole[:whole.index(stop)]
    # The edges of greedy: top_p 0 and a vanishing temperature are greedy, not a failure.
    for edge in (dict(temperature=1.0, top_p=0.0), dict(temperature=1e-300)):
        res = oai.chat.completions.create(model="m", messages=ASK, max_tokens=24, **edge)
        assert res.choices[0].message.content == whole
    sampled = [oai.chat.completions.create(model="m", messages=ASK, max_tokens=16, temperature=1.0, seed=seed)
               .choices[0].message.content for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1]


def test_legacy_completions(oai, reference):
    res = oai.completions.create(model="stdlib-q4", prompt="import os\n\n\ndef ", max_tokens=12, temperature=0)
    assert res.object == "text_completion"
    assert res.choices[0].text == "".join(reference.generate("import os\n\n\ndef ", max_new_tokens=12))
    streamed = oai.completions.create(model="stdlib-q4", prompt="import os\n\n\ndef ", max_tokens=12, temperature=0,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == res.choices[0].text


def test_anthropic_stream_accumulates_to_the_same_message(claude, model, reference):
    kwargs = dict(model="claude-sonnet-4-5", max_tokens=20, extra_body={"temperature": 0}, messages=ASK,
                  system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.40; cch=9f2;"},
                          {"type": "text", "text": "Answer briefly."}])
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    messages = [{"role": "system", "content": "Answer briefly."}, *ASK]
    text = greedy(reference, messages, 20)
    assert whole.content[0].text == final.content[0].text == "".join(pieces) == text and len(pieces) > 1
    assert whole.stop_reason == final.stop_reason and whole.stop_reason in ("end_turn", "max_tokens")
    # The attribution header is gone: the prompt is the system block and the question.
    usage = final.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_len(model, messages)
    counted = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=ASK, system=kwargs["system"])
    assert counted.input_tokens == prompt_len(model, messages)


def test_a_second_turn_prefills_only_what_is_new(oai, claude, model, reference):
    first = oai.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0)
    turn2 = ASK + [{"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "And json.loads?"}]
    second = oai.chat.completions.create(model="m", messages=turn2, max_tokens=12, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens == prompt_len(model, turn2)
    assert cached >= first.usage.prompt_tokens  # the first prompt at least, and as much of the answer as agrees
    assert second.choices[0].message.content == greedy(reference, turn2, 12)  # the cache changes nothing
    # The same through the Anthropic protocol: cache reads counted apart from new input.
    again = claude.messages.create(model="m", max_tokens=12, extra_body={"temperature": 0}, messages=turn2)
    assert again.usage.cache_read_input_tokens == prompt_len(model, turn2) - 1
    assert again.usage.input_tokens == 1 and again.content[0].text == second.choices[0].message.content


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_tools_and_their_results_go_through_the_chat_template(oai, claude, model):
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"}]
    res = oai.chat.completions.create(model="m", messages=conversation, tools=[WEATHER], max_tokens=4, temperature=0)
    rendered = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain, 4 C", "tool_call_id": "call_1"}]
    assert res.usage.prompt_tokens == prompt_len(model, rendered, [WEATHER])
    msg = claude.messages.create(model="m", max_tokens=4, extra_body={"temperature": 0}, tools=[
        {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER["function"]["parameters"]}],
        messages=[*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                            "input": {"city": "Oslo"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "rain, 4 C"}]}])
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt_len(model, rendered, [WEATHER])


def test_two_concurrent_clients_each_get_their_own_answer(oai, reference):
    questions = [[{"role": "user", "content": q}] for q in ("What does os.walk do?", "Explain list.sort.")]
    answers = [None, None]

    def ask(i):
        stream = oai.chat.completions.create(model="m", messages=questions[i], max_tokens=24, temperature=0, stream=True)
        answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert answers == [greedy(reference, q, 24) for q in questions]


def test_a_client_that_disconnects_stops_its_generation(server, oai):
    import http.client
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    # Code, not a chat turn: the model goes on until max_tokens (about two seconds here) unless stopped.
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": "m", "prompt": "import os\n\n\ndef ", "max_tokens": MAX_SEQ - 8, "temperature": 0, "stream": True}),
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    res = conn.getresponse()
    assert res.status == 200 and res.readline().startswith(b"data: ")  # it is generating
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 30
    while json.loads(request(server.url, "GET", "/health")[2])["generating"]:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
    stats = json.loads(request(server.url, "GET", "/stats", headers={"x-api-key": KEY})[2])
    assert stats["new_tokens"] < (MAX_SEQ - 8) // 2  # it stopped long before max_tokens
    res = oai.chat.completions.create(model="m", messages=ASK, max_tokens=4, temperature=0)
    assert res.usage.completion_tokens >= 1


AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 10 ** 15}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "messages"),
    ("/v1/chat/completions", b"{" + b" " * (33 << 20) + b"}", 413, None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/messages", b"{not json", 400, None),
    ("/v1/messages", {"model": "m", "max_tokens": "many", "messages": ASK}, 400, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 2000}]},
     400, "messages"),
    ("/v1/messages/count_tokens", {"messages": {"role": "user"}}, 400, "messages"),
])
def test_bad_input_gets_a_4xx_in_the_protocols_shape(server, path, body, status, param):
    code, headers, raw = request(server.url, "POST", path, body, AUTH)
    assert code == status
    err = json.loads(raw)
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and err["error"]["type"] in ("invalid_request_error", "request_too_large")
        assert err["error"]["message"]
    else:
        assert err["error"]["message"] and err["error"]["param"] == param
    assert json.loads(request(server.url, "GET", "/health")[2])["status"] == "ok"


def test_the_sdks_see_a_context_overflow_as_a_bad_request(oai, claude):
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(openai.BadRequestError, match="context holds 1,024"):
        oai.chat.completions.create(model="m", messages=long, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="context holds 1,024"):
        claude.messages.create(model="m", messages=long, max_tokens=4)


def test_unknown_paths_and_methods(server):
    assert request(server.url, "GET", "/v1/nothing", headers=AUTH)[0] == 404
    code, _, raw = request(server.url, "GET", "/v1/chat/completions", headers=AUTH)
    assert code == 405 and json.loads(raw)["error"]["message"]
    # The query string is ignored (Claude Code posts to /v1/messages?beta=true).
    code, _, raw = request(server.url, "POST", "/v1/messages?beta=true",
                           {"model": "m", "max_tokens": 2, "messages": ASK}, {"x-api-key": KEY})
    assert code == 200 and json.loads(raw)["type"] == "message"


def test_the_api_key_is_required_in_either_header(server):
    for path, shape in (("/v1/models", "error"), ("/v1/messages", "type")):
        code, _, raw = request(server.url, "GET" if "models" in path else "POST", path,
                               None if "models" in path else {"model": "m", "max_tokens": 2, "messages": ASK})
        assert code == 401 and shape in json.loads(raw)
    assert request(server.url, "GET", "/v1/models", headers={"authorization": "Bearer wrong"})[0] == 401
    assert request(server.url, "GET", "/v1/models", headers={"x-api-key": KEY})[0] == 200
    assert request(server.url, "GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200
    # Both headers, one of them stale (Claude Code with ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN both set).
    assert request(server.url, "GET", "/v1/models", headers={"x-api-key": "sk-ant-real", **AUTH})[0] == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=ASK)


def test_an_engine_error_is_reported_and_the_server_keeps_serving(model, tmp_path):
    import shutil
    from mosaic_runtime.vault import open_vault
    from mosaic_runtime.vault.format import VAULT_FILE
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    with open_vault(broken) as vault:
        offsets = [vault.entry(0, e).offset for e in range(vault.arch["num_experts"])]
    for off in offsets:  # every expert of the first layer: any request reaches one
        flip_byte(broken / VAULT_FILE, off + 100)
    srv = ServerProcess([str(broken), "--ram-budget", "1M", "--max-seq", "256"], tmp_path / "home")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for _ in range(2):  # the same clean error each time: the worker survives it
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model="m", messages=ASK, max_tokens=4)
            assert "mosaic-shatter verify" in str(e.value) and e.value.response.headers["x-should-retry"] == "false"
        code, _, raw = request(srv.url, "POST", "/v1/messages", {"model": "m", "max_tokens": 4, "messages": ASK,
                                                                   "stream": True})
        # A stream has started (200) before prefill reads the experts: the failure is its error event.
        name, data = sse(raw)[-1]
        assert code == 200 and name == "error" and json.loads(data)["error"]["type"] == "api_error"
        assert [m.id for m in client.models.list()] == ["broken"]
    finally:
        log = srv.stop()
    assert "Traceback" not in log


def test_the_model_field_picks_among_the_served_models(model, tmp_path):
    fp8 = convert(str(BUNDLED), tmp_path / "stdlib-fp8", "fp8", progress=False).out
    home = tmp_path / "home"
    stored = convert(str(BUNDLED), home / "models" / "stored-q4", "q4", progress=False).out
    srv = ServerProcess([str(model), str(fp8), "--max-seq", "256"], home)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["stdlib-q4", "stdlib-fp8", "stored-q4"]
        for name in ("stdlib-fp8", "claude-opus-4", "stored-q4", "stdlib-q4"):
            res = client.chat.completions.create(model=name, messages=ASK, max_tokens=3, temperature=0)
            resident = json.loads(request(srv.url, "GET", "/health")[2])["model"]
            # An unknown name is answered by the model already resident, and the response says which.
            want = {"claude-opus-4": "stdlib-fp8"}.get(name, name)
            assert res.model == resident == want
    finally:
        log = srv.stop()
    assert "'claude-opus-4' is not served here; answering with stdlib-fp8" in log and stored.is_dir()
