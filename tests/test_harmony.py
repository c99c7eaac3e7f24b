"""gpt-oss's harmony chat: the answer split into channels as it streams, the final one shown (and the
analysis on request), the turn kept for the checkpoint's own template (tests/data/templates/gpt-oss.jinja)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builders import tiny_gpt_oss
from families import BASE, CASES
from mosaic_runtime.chat import Conversation
from mosaic_runtime.engine import Engine
from mosaic_runtime.harmony import ANALYSIS, FINAL, HarmonyStream, is_harmony
from mosaic_runtime.serve.tool_calls import HarmonyText, ToolCall, ToolCallStream
from mosaic_shatter.convert import convert

TEMPLATE = Path(__file__).parent / "data" / "templates" / "gpt-oss.jinja"
SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>",
            "<|endoftext|>"]
ANSWER = ("<|channel|>analysis<|message|>The user greets; reply kindly. héllo<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello ✓ wörld<|return|>")


def harmony_tokenizer(directory: Path) -> None:
    """A small byte-level BPE with harmony's special tokens, the gpt-oss template, <|return|> as eos and
    generation_config's eos ids <|return|> and <|call|>, as the release has them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The user greets; reply kindly. Hello wörld héllo ✓ assistant final analysis"] * 20,
                            trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>",
                                                                "pad_token": "<|endoftext|>"}))
    shutil.copy(TEMPLATE, directory / "chat_template.jinja")
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]}))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony")
    ckpt = tiny_gpt_oss(root / "ckpt", **{**BASE, **CASES["gpt_oss"].config})
    harmony_tokenizer(ckpt)
    out = convert(str(ckpt), root / "mxfp4", "mxfp4", progress=False).out
    with Engine.open(out, max_seq=256) as e:
        yield e


def test_an_answer_splits_into_its_channels_as_it_streams(engine):
    codec = engine.codec
    assert is_harmony(codec)
    stream, pieces = HarmonyStream(codec), []
    for token in codec.encode(ANSWER):
        if got := stream.push(token):
            pieces.append(got)
    assert stream.messages == [(ANALYSIS, "The user greets; reply kindly. héllo"), (FINAL, "Hello ✓ wörld")]
    assert "".join(t for c, t in pieces if c == FINAL) == "Hello ✓ wörld"  # streamed whole, no cut character


def scripted(engine, monkeypatch, answer: str) -> dict:
    """engine.generate_ids replaced by an answer's tokens up to its stop token, as generation yields them."""
    seen = {}
    ids = engine.codec.encode(answer)

    def generate_ids(prompt_ids, cached=0, stop_ids=(), **sampling):
        seen["stop_ids"] = stop_ids
        engine.model.state.length = cached + len(prompt_ids)  # what a prefill leaves in the cache
        for token in ids:
            if token in stop_ids or token in engine.arch["eos_token_ids"]:
                return
            engine.model.state.length += 1
            yield token
    monkeypatch.setattr(engine, "generate_ids", generate_ids)
    return seen


@pytest.mark.parametrize("show, shown", [(False, "Hello ✓ wörld"),
                                         (True, "[analysis] The user greets; reply kindly. héllo\n[final] Hello ✓ wörld")])
def test_chat_shows_the_final_channel_and_the_analysis_on_request(engine, monkeypatch, show, shown):
    seen = scripted(engine, monkeypatch, ANSWER)
    chat = Conversation(engine, show_analysis=show)
    prompt = engine.codec.render_chat([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")  # the template's own prompt
    assert "".join(chat.ask("hi")) == shown
    assert seen["stop_ids"] == [engine.codec.token_id("<|return|>")]
    assert chat.messages[-1] == {"role": "assistant", "content": "Hello ✓ wörld",
                                 "thinking": "The user greets; reply kindly. héllo"}
    assert engine.codec.token_id("<|call|>") in engine.arch["eos_token_ids"]  # a tool call ends the turn too
    # the next turn renders the earlier one through the template: its final answer kept, its analysis dropped
    text = engine.codec.render_chat(chat.messages + [{"role": "user", "content": "again"}])
    assert "<|channel|>final<|message|>Hello ✓ wörld<|end|>" in text and "greets" not in text
    scripted(engine, monkeypatch, "<|channel|>final<|message|>Again.<|return|>")
    assert "".join(chat.ask("again")).endswith("Again.")
    scripted(engine, monkeypatch, "no channels at all")  # a model not writing harmony: shown as it is
    assert "".join(chat.ask("more")) == "no channels at all" and chat.messages[-1]["content"] == "no channels at all"


def test_the_server_answers_with_the_final_channel_and_its_tool_calls(engine):
    """What the server's worker streams for a harmony model (HarmonyText in place of a Detokenizer): the final
    channel, and a message to functions.NAME as a tool call that ToolCallStream finds like any other."""
    codec = engine.codec

    def served(answer: str) -> list:
        text, calls = HarmonyText(codec), ToolCallStream()
        parts = [p for t in codec.encode(answer) for p in calls.push(text.push(t))]
        return parts + calls.push(text.flush()) + calls.finish()
    assert "".join(served(ANSWER)) == "Hello ✓ wörld"
    call = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>')
    parts = served(call)
    assert len(parts) == 1 and isinstance(parts[0], ToolCall)
    assert (parts[0].name, parts[0].arguments) == ("get_weather", {"city": "Zürich"})
    assert "".join(served("plain words, no channels")) == "plain words, no channels"  # not harmony: kept
    # cut short inside the call (max_tokens): the call so far still ends the answer as one
    parts = served(call[:call.index("<|call|>")])
    assert isinstance(parts[0], ToolCall) and parts[0].arguments == {"city": "Zürich"}


def test_a_forced_tool_call_opens_the_harmony_message(engine):
    """tool_choice naming a function: the prompt ends on the opening of a commentary message to it, and the
    answer (the arguments, then <|call|>) comes back as that call."""
    from mosaic_runtime.serve.prompt import forced_opening
    from mosaic_runtime.serve.request import Generation, ToolChoice
    gen = Generation("m", 16, tool_choice=ToolChoice("function", "get_weather"))
    codec = engine.codec
    prompt = codec.encode(codec.render_chat([{"role": "user", "content": "weather?"}]) + forced_opening(gen, True))
    text, calls = HarmonyText(codec, prompt), ToolCallStream()
    parts = [p for t in codec.encode('{"city": "Bern"}<|call|>') for p in calls.push(text.push(t))]
    parts += calls.push(text.flush()) + calls.finish()
    assert len(parts) == 1 and (parts[0].name, parts[0].arguments) == ("get_weather", {"city": "Bern"})
