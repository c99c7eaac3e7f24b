"""The notebook-facing Engine: open a converted model directory, get logits, generate text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file

from .experts import TorchExperts
from .generate import Detokenizer, TextCodec, sample
from .models import MODELS
from .vault import open_vault
from .vault.format import BACKBONE_FILE


@dataclass
class Stats:
    """Counters of the last generate() call (and per-layer expert use since open)."""

    expert_calls: dict[int, int] = field(default_factory=dict)  # layer -> experts run
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # time to first token
    decode_s: float = 0.0

    @property
    def tok_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0


class Engine:
    def __init__(self, directory: Path, vault, model, codec: TextCodec | None):
        self.directory, self.vault, self.model, self.codec = directory, vault, model, codec
        self.stats = Stats()

    @classmethod
    def open(cls, path, *, max_seq: int = 4096, threads: int | None = None) -> "Engine":
        """Open a model directory written by `mosaic-shatter convert`.

        Args:
            max_seq: longest context; the KV cache for it is allocated here, once.
            threads: torch intra-op threads (default: torch's own choice).
        Raises:
            VaultError: the directory is not a complete, valid vault.
            NotImplementedError: the arch block names something this runtime cannot run.
        """
        directory = Path(path).expanduser()
        vault = open_vault(directory)
        model_type = vault.arch["model_type"]
        if model_type not in MODELS:
            raise NotImplementedError(f"model_type {model_type!r} has no runtime model")
        if threads:
            torch.set_num_threads(threads)
        engine = cls(directory, vault, None, None)
        experts = TorchExperts(engine._fetch_expert)
        engine.model = MODELS[model_type](vault.arch, load_file(directory / BACKBONE_FILE), experts, max_seq)
        if (directory / "tokenizer.json").is_file():
            engine.codec = TextCodec(directory)
        return engine

    def _fetch_expert(self, layer: int, expert: int):
        self.stats.expert_calls[layer] = self.stats.expert_calls.get(layer, 0) + 1
        return self.vault.dequantize_expert(layer, expert)

    @property
    def arch(self) -> dict:
        return self.vault.arch

    def logits(self, token_ids) -> torch.Tensor:
        """float32 logits [T, vocab] of a fresh forward pass over token_ids (the KV cache is reset)."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        self.model.kv.reset()
        return self.model.forward(ids, 0)

    def generate_ids(self, prompt_ids, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                     top_k: int = 0, seed: int | None = None, stop_ids=()) -> Iterator[int]:
        """Token ids, one at a time, after prefilling prompt_ids from an empty cache."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        stop = set(stop_ids) | set(self.arch.get("eos_token_ids") or [])
        s = self.stats = Stats(expert_calls=self.stats.expert_calls, prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        logits = self.logits(prompt_ids)[-1]
        for n in range(max_new_tokens):
            token = sample(logits, temperature, top_p, top_k, gen)
            s.new_tokens += 1
            if n == 0:
                s.ttft_s = time.perf_counter() - t0
                t1 = time.perf_counter()
            else:
                s.decode_s = time.perf_counter() - t1
            if token in stop:
                return
            yield token
            if n + 1 < max_new_tokens:
                pos = self.model.kv.length
                logits = self.model.forward(torch.tensor([token]), pos)[-1]

    def generate(self, prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: list[str] | None = None) -> Iterator[str]:
        """Stream text. prompt: a string, chat messages [{"role", "content"}], or a list of token ids."""
        if self.codec is None:
            raise ValueError("this model directory has no tokenizer.json; use generate_ids with token ids")
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        elif prompt and isinstance(prompt[0], dict):
            ids = self.codec.encode(self.codec.render_chat(list(prompt)))
        else:
            ids = list(prompt)
        detok, text = Detokenizer(self.codec), ""
        for token in self.generate_ids(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                       top_k=top_k, seed=seed):
            piece = detok.push(token)
            text += piece
            for s in stop or ():
                if s in text:
                    cut = text.index(s)
                    tail = piece[:len(piece) - (len(text) - cut)]
                    if tail:
                        yield tail
                    return
            if piece:
                yield piece
