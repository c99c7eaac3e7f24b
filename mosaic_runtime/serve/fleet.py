"""The models a server offers, by name, and the one resident engine (with its prompt cache).

Every model given on the command line and every model in the store is listed; a request's `model` picks
one, and an unknown name (an agent's `claude-*` default) gets the resident model. Switching closes the
resident engine and opens the other: one resident at a time. Only the worker thread loads and switches."""

from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..engine import Engine
from ..generate import TextCodec
from ..prompt_cache import PromptCache
from .request import Generation, RequestError

log = logging.getLogger("mosaic.serve")
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


@dataclass
class ModelEntry:
    name: str
    path: Path
    _codec: TextCodec | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def codec(self) -> TextCodec:
        """The model's tokenizer and chat template, loaded once (rendering needs no engine)."""
        with self._lock:
            if self._codec is None:
                if not (self.path / "tokenizer.json").is_file():
                    raise RequestError(f"model {self.name} has no tokenizer.json to serve text with")
                self._codec = TextCodec(self.path)
            return self._codec

    @functools.cached_property
    def sampling_defaults(self) -> dict:
        """What the model's generation_config.json says of sampling, else the protocols' 1.0 (read once)."""
        defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
        try:
            saved = json.loads((self.path / "generation_config.json").read_text())
        except (OSError, ValueError):
            return defaults
        if isinstance(saved, dict):
            defaults.update({k: saved[k] for k in SAMPLING_KEYS if isinstance(saved.get(k), (int, float))})
        return defaults

    def sampling(self, gen: Generation) -> dict:
        """The request's sampling; what it leaves out from sampling_defaults."""
        defaults = self.sampling_defaults
        chosen = {k: getattr(gen, k) if getattr(gen, k) is not None else defaults[k] for k in SAMPLING_KEYS}
        chosen["top_k"] = int(chosen["top_k"])
        return dict(chosen, seed=gen.seed)


class Fleet:
    def __init__(self, entries: list[ModelEntry], open_engine: Callable[[Path], Engine], prompt_cache: bool = True):
        if not entries:
            raise ValueError("no models to serve: give a model directory or a store name, or convert one into "
                             "the store with `mosaic-shatter convert SOURCE --quant q4`")
        self.entries = {e.name: e for e in entries}
        self.default = entries[0]
        self._open, self.prompt_cache = open_engine, prompt_cache
        self.resident: ModelEntry | None = None
        self.engine: Engine | None = None
        self.cache: PromptCache | None = None

    def pick(self, requested: str | None) -> ModelEntry:
        """The entry a request's model name picks; an unknown name gets the resident (or default) model."""
        if requested in self.entries:
            return self.entries[requested]
        chosen = self.resident or self.default
        if requested:
                log.info("model %r is not served here; answering with %s", requested, chosen.name)
        return chosen

    def load(self, entry: ModelEntry) -> tuple[Engine, PromptCache]:
        """The entry's engine, opened if another one is resident (which is closed first). Worker thread only."""
        if self.resident is not entry:
            self.close()
            log.info("loading %s from %s", entry.name, entry.path)
            self.engine = self._open(entry.path)
            if self.engine.codec is None:
                self.engine.codec = entry.codec
            self.resident, self.cache = entry, PromptCache(self.engine.model.state, enabled=self.prompt_cache)
        return self.engine, self.cache

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.resident = self.engine = self.cache = None
