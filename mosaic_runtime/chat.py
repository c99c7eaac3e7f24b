"""A multi-turn conversation over one engine, keeping the KV cache across turns so that each turn
prefills only the tokens that are new since the cache was filled."""

from __future__ import annotations

from typing import Iterator

from .generate import Detokenizer
from .prompt_cache import common_prefix


class Conversation:
    """Messages rendered with the checkpoint's chat template, and the exact tokens whose keys and values
    the engine's cache holds (the prompts as fed, the answers as generated).

    Each `ask` renders the whole conversation. When the text of the cached tokens is a prefix of it (a
    template that renders earlier turns unchanged, and a lossless tokenizer), only the rest is tokenised
    and prefilled. Otherwise the whole text is tokenised and the cache is kept up to the longest prefix
    the two token lists share. A conversation owns its engine's cache: other calls that refill it
    (engine.logits, generate) must be followed by `reset`.
    """

    def __init__(self, engine, system: str | None = None):
        if engine.codec is None or not engine.codec.chat_template:
            raise ValueError("this model directory has no tokenizer.json with a chat template")
        self.engine, self.system = engine, system
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
        if keep < len(self.cached_ids) and not self.engine.model.state.rewindable:
            keep = 0  # a recurrent (DeltaNet) state cannot be cut back to a prefix: prefill afresh
        return ids, keep

    def ask(self, text: str, **sampling) -> Iterator[str]:
        """Stream the answer to a user message. Stopping early (an interrupted answer) keeps what was said."""
        codec, state = self.engine.codec, self.engine.model.state
        self.messages.append({"role": "user", "content": text})
        try:
            ids, keep = self._prompt()
        except ValueError:  # the template failed on it (ChatTemplateError): the turn never happened
            self.messages.pop()
            raise
        detok, answer = Detokenizer(codec), []
        try:
            for token in self.engine.generate_ids(ids[keep:], cached=keep, stop_ids=codec.end_of_turn_ids, **sampling):
                answer.append(token)
                piece = detok.push(token)
                if piece:
                    yield piece
            tail = detok.flush()
            if tail:
                yield tail
        finally:
            self.cached_ids = (ids + answer)[:state.length]
            self.messages.append({"role": "assistant", "content": codec.decode(answer)})
