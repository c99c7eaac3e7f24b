"""A multi-turn conversation over one engine, keeping the KV cache across turns so that each turn
prefills only the tokens that are new since the cache was filled."""

from __future__ import annotations

from typing import Iterator

from .generate import Detokenizer
from .harmony import ANALYSIS, FINAL, HarmonyStream, is_harmony
from .prompt_cache import common_prefix


class Conversation:
    """Messages rendered with the checkpoint's chat template, and the exact tokens whose keys and values
    the engine's cache holds (the prompts as fed, the answers as generated).

    Each `ask` renders the whole conversation. When the text of the cached tokens is a prefix of it (a
    template that renders earlier turns unchanged, and a lossless tokenizer), only the rest is tokenised
    and prefilled. Otherwise the whole text is tokenised and the cache is kept up to the longest prefix
    the two token lists share. A conversation owns its engine's cache: other calls that refill it
    (engine.logits, generate) must be followed by `reset`.

    A model that answers in harmony's channels (gpt-oss, harmony.py) streams its final channel, and its
    analysis channel too when show_analysis (each introduced by "[analysis] " or "[final] "); the turn keeps
    the analysis as the message's `thinking`, which the template renders or drops as it defines.
    """

    def __init__(self, engine, system: str | None = None, show_analysis: bool = False):
        if engine.codec is None or not engine.codec.chat_template:
            raise ValueError("this model directory has no tokenizer.json with a chat template")
        self.engine, self.system, self.show_analysis = engine, system, show_analysis
        self.harmony = is_harmony(engine.codec)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.cached_ids: list[int] = []
        self.engine.model.state.reset()

    def _prompt(self) -> tuple[list[int], int]:
        """(the conversation's tokens, how many leading ones the cache already holds)."""
        codec = self.engine.codec
        self.cached_ids = self.cached_ids[:self.engine.model.state.length]  # the cache may have been reset
        text = codec.render_chat(self.messages)
        cached_text = codec.decode(self.cached_ids, skip_special_tokens=False)
        if self.cached_ids and text.startswith(cached_text) and len(text) > len(cached_text):
            return self.cached_ids + codec.encode(text[len(cached_text):]), len(self.cached_ids)
        ids = codec.encode(text)
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)
        if keep < len(self.cached_ids) and not self.engine.model.state.resumable(keep):
            keep = 0  # a recurrent (DeltaNet) state, or a window ring, cannot be cut back that far: prefill afresh
        return ids, keep

    def ask(self, text: str, **sampling) -> Iterator[str]:
        """Stream the answer to a user message. Stopping early (an interrupted answer) keeps what was said."""
        state = self.engine.model.state
        self.messages.append({"role": "user", "content": text})
        try:
            ids, keep = self._prompt()
        except ValueError:  # the template failed on it (ChatTemplateError): the turn never happened
            self.messages.pop()
            raise
        answer: list[int] = []
        reply = {"role": "assistant", "content": ""}
        # stops at the template's end of turn and the checkpoint's eos ids (gpt-oss: <|return|>, <|call|>)
        tokens = self.engine.generate_ids(ids[keep:], cached=keep, stop_ids=self.engine.codec.end_of_turn_ids,
                                          **sampling)
        try:
            yield from (self._channels(tokens, answer, reply) if self.harmony else self._text(tokens, answer, reply))
        finally:
            self.cached_ids = (ids + answer)[:state.length]
            self.messages.append(reply)

    def _text(self, tokens, answer: list[int], reply: dict) -> Iterator[str]:
        detok = Detokenizer(self.engine.codec)
        try:
            for token in tokens:
                answer.append(token)
                if piece := detok.push(token):
                    yield piece
            if tail := detok.flush():
                yield tail
        finally:
            reply["content"] = self.engine.codec.decode(answer)

    def _channels(self, tokens, answer: list[int], reply: dict) -> Iterator[str]:
        """A harmony answer: the final channel's text (and the analysis', when shown) as it streams."""
        stream, shown = HarmonyStream(self.engine.codec), None
        visible = (FINAL, ANALYSIS) if self.show_analysis else (FINAL,)

        def show(got) -> str:
            nonlocal shown
            if got is None or got[0] not in visible:
                return ""
            lead = ""
            if self.show_analysis and got[0] != shown:  # each channel introduced, on its own line
                lead = ("\n" if shown else "") + f"[{got[0]}] "
            shown = got[0]
            return lead + got[1]
        try:
            for token in tokens:
                answer.append(token)
                if piece := show(stream.push(token)):
                    yield piece
            if piece := show(stream.flush()):
                yield piece
            if not stream.messages and answer:  # not harmony after all: what it said, as it said it
                yield self.engine.codec.decode(answer)
        finally:
            reply["content"] = stream.text(FINAL) if stream.messages else self.engine.codec.decode(answer)
            if stream.text(ANALYSIS):
                reply["thinking"] = stream.text(ANALYSIS)
