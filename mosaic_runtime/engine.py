"""The notebook-facing Engine: open a converted model directory, get logits, generate text."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import _native
from .backbone import BACKBONE_MODES, file_tensors, load_backbone, on_huge_pages, resident_bytes
from .cache.pressure import CHECK_EVERY_S, MemoryValve
from .cache.store import ExpertStore
from .experts import NativeExperts, TorchExperts
from .generate import Detokenizer, StopText, TextCodec, sample
from .kv_cache import KV_DTYPES
from .models import build_model, model_recipe, prepare_tensors
from .models.lookahead import RouterLookahead
from .models.state import SequenceState
from .limits import MemoryLimit, memory_limit
from .ops import using_threads
from .tier import TieredExperts
from .tier.policy import TierCounters
from .vault import open_vault
from .vault.format import BACKBONE_FILE


DEFAULT_IO = "buffered"  # chosen by benchmarks/reader_bench.py: see benchmarks/RESULTS.md
DEFAULT_TIER_POLICY = "decayed-frequency"  # chosen by benchmarks/routing_bench.py: see benchmarks/RESULTS.md
MARGIN_BYTES = 1 << 30  # left for what the process allocates later (prefill activations, load-time copies)
_WATCH = object()  # the engine's owner while the memory watch acts on it (it was idle)
PREFILL_CHUNK = 1024  # prompt tokens per forward pass: bounds activation memory (and logits) on long prompts


@dataclass
class Stats:
    """What the engine did: expert cache per layer since open, and the last generate() call."""

    hits: dict[int, int] = field(default_factory=dict)  # layer -> ring hits
    misses: dict[int, int] = field(default_factory=dict)  # layer -> records a layer asked for and had to read
    bytes_read: int = 0  # read for the layers: their misses, and the records read ahead of them
    preload_bytes: int = 0  # read ahead of need by preload, counted as each read is accounted
    ahead_reads: int = 0  # records read ahead of the next layer in decode steps (their bytes are in bytes_read)
    ahead_used: int = 0  # ... of which that layer then asked for
    io_s: float = 0.0  # waiting for expert reads
    kernel_s: float = 0.0  # in the native expert kernel
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0  # the tokens after the first
    tier: dict[int, TierCounters] = field(default_factory=dict)  # layer -> device tier counters since open
    device_bytes_copied: int = 0  # records promoted into the device cache since open

    @property
    def tok_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def backbone_s(self) -> float:
        """The rest of the last call's time: attention, norms, router, lm_head and Python."""
        return max(0.0, self.ttft_s + self.decode_s - self.io_s - self.kernel_s)

    @property
    def hit_rate(self) -> float:
        h, m = sum(self.hits.values()), sum(self.misses.values())
        return h / (h + m) if h + m else 0.0

    @property
    def device_hit_rate(self) -> float:
        """Share of routed experts that ran from the device cache (0 without a device tier)."""
        h, m = sum(c.hits for c in self.tier.values()), sum(c.misses for c in self.tier.values())
        return h / (h + m) if h + m else 0.0


def ring_margin(free: int) -> int:
    """Memory left free beside the ring when it is sized from what the process may take: MARGIN_BYTES, at
    most a quarter of it."""
    return min(MARGIN_BYTES, max(free, 0) // 4)


def ring_slots(vault, ram_budget: int | None, resident: int, limit: MemoryLimit) -> int:
    """How many records the ring holds.

    With a budget: budget // record_bytes. Without: what the process may still take (limits.memory_limit:
    MemAvailable, bounded by its cgroup and rlimits), less what the backbone and the sequence state are about
    to hold and a margin (MARGIN_BYTES, at most a quarter of it), taken before either is loaded. Never more
    than the vault's records, never fewer than one layer's top-k (else a layer could not run at all).
    """
    record, top_k = vault.header.record_bytes, vault.arch["num_experts_per_tok"]
    if ram_budget is not None:
        budget = ram_budget
    else:
        free = limit.available - resident
        budget = free - ring_margin(free)
        if budget < top_k * record:  # the backbone itself does not fit: say what would
            raise ValueError(f"the backbone and the sequence state take {resident / 2**30:.2f} GiB and this process "
                             f"may take {limit.available / 2**30:.2f} GiB ({limit.bound}), which leaves less than "
                             f"one layer's top-{top_k} experts ({top_k * record:,} bytes); a quantised backbone "
                             "holds less (backbone='int8' or 'q4', which precision='fast' takes), and a smaller "
                             "max_seq or kv_dtype a smaller KV cache")
    if budget < top_k * record:
        raise ValueError(f"a RAM budget of {budget:,} bytes holds fewer than one layer's top-{top_k} experts; "
                         f"the minimum is {top_k * record:,} bytes"
                         + ("" if ram_budget is not None else f" (memory bounded by {limit.bound})"))
    return min(budget // record, vault.header.num_records)


PRECISIONS = ("fast", "exact")


def precision_settings(precision: str, kernel: str | None, backbone: str | None, device: torch.device | None = None
                       ) -> tuple[str, str]:
    """(kernel, backbone) for a precision, with what the caller gave explicitly taking precedence.

    "fast" is Q4 experts and a Q4 backbone (lm_head int8) against int8 activations: the arithmetic of
    llama.cpp's Q4_0, on AVX-512 VNNI or AVX2 (int8_isa). Without either it takes the float expert kernel
    and an int8 backbone (the float Q4 loop would be slower than int8's bytes). With a device tier the
    expert kernel stays float: an expert runs on either side depending on what the device holds, and both
    sides must compute the same function for the tokens not to depend on the VRAM budget. On CUDA the
    backbone stays as stored (VRAM holds it; its projections are not what limits a token there)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    fast = precision == "fast"
    int8 = _native.kernels.int8_isa() is not None
    if kernel is None:
        kernel = "native-int8" if fast and int8 and device is None else "native"
    if backbone is None:
        backbone = "bf16" if not fast or (device is not None and device.type == "cuda") else "q4" if int8 else "int8"
    return kernel, backbone


def _watch_idle(engine_ref: "weakref.ref[Engine]", stop: threading.Event) -> None:
    """The memory watch thread. It holds the engine weakly: an engine dropped without close() still goes."""
    while not stop.wait(CHECK_EVERY_S):
        engine = engine_ref()
        if engine is None:
            return
        engine._check_if_idle()
        del engine


class Engine:
    def __init__(self, directory: Path, vault, store, model, codec: TextCodec | None, device=None,
                 settings: dict | None = None):
        self.directory, self.vault, self.store, self.model, self.codec = directory, vault, store, model, codec
        self.device = device  # where the backbone runs: None for the CPU, else a CUDA device
        self.settings = settings or {}  # how it computes: precision, kernel, backbone, kv_dtype, threads
        self.threads = self.settings.get("threads") or os.cpu_count() or 1
        # One thread at a time: a generation holds the engine (its KV cache) from its first token to its end.
        self._owner: int | object | None = None  # a thread's ident, or _WATCH while the memory watch acts
        self._owner_cv = threading.Condition()
        self.memory_limit: MemoryLimit | None = None  # what the process could take at open, and what bounded it
        self.valve: MemoryValve | None = None  # gives ring memory back when memory runs short after open
        self._watch_stop = threading.Event()
        self._watch: threading.Thread | None = None
        self.stats = Stats()
        self._io_mark = self._kernel_mark = 0.0

    @classmethod
    def open(cls, path, ram_budget: int | None = None, io: str | None = None, threads: int | None = None, *,
             max_seq: int = 4096, precision: str = "fast", kernel: str | None = None, backbone: str | None = None,
             device: str | None = None, vram_budget: int | None = None, tier_policy: str = DEFAULT_TIER_POLICY,
             kv_dtype: str = "float32", preload: bool = True, watch_memory: bool = True,
             router_lookahead: bool = False, verbose: bool = False) -> "Engine":
        """Open a model directory written by `mosaic-shatter convert`.

        Args:
            ram_budget: bytes for the expert ring (the expert cache); default: from available memory,
                see ring_slots().
            io: "direct" (O_DIRECT / F_NOCACHE) or "buffered" (pread through the page cache).
            threads: threads for this engine's kernels and torch ops (default: every core); another engine in
                the process keeps its own. An engine serves one thread at a time: a request from another
                thread while a generation is under way raises RuntimeError.
            max_seq: longest context; its KV cache is allocated here, once.
            precision: "fast" (the default) runs Q4 experts and a Q4 backbone (lm_head int8) against int8
                activations where the CPU has AVX-512 or AVX2, as llama.cpp runs Q4_0 (see precision_settings);
                "exact" runs the float kernels on the backbone as stored, faithful to the float reference
                (what the golden tests hold to transformers). kernel and backbone, when given, override its
                choices. See benchmarks/RESULTS.md for what "fast" costs in perplexity and agreement.
            kernel: "native" runs experts in the C++ kernel straight from the ring; "native-int8" does too
                but quantises activations to int8 for the Q4 dot products (AVX-512 VNNI or AVX2: faster,
                logits no longer bit-faithful to the float reference); "torch" dequantises records and uses
                torch ops (the reference, no ring).
            backbone: "bf16" runs the backbone as stored (bit-faithful to the reference); "int8" or "fp8"
                quantise its projections and lm_head at load, per output row (half the bytes per token);
                "q4" in the vault's Q4_G32 layout (a quarter; int8 activations as native-int8's). See
                backbone.py for what is kept as stored, and benchmarks/RESULTS.md for the cost.
            device: None runs everything on the CPU. "cuda" (or "cuda:N") puts the backbone and KV cache in
                VRAM and adds the device expert tier: hot experts' quantised records are promoted into VRAM
                and run there while the CPU kernel runs the cold ones (tier/). "cpu" adds the same tier with
                host memory standing in for VRAM (the CPU-testable path; the backbone stays as on the CPU).
            vram_budget: bytes for the device expert cache; default on CUDA: free VRAM minus the backbone,
                the KV cache and a margin (tier/cost.py::device_expert_budget).
            tier_policy: "decayed-frequency" (default) or "hit-threshold" (the seed's 3-hit rule).
            kv_dtype: "float32" (default, exact), "bfloat16" (keys and values rounded to bf16 as they are
                cached: half the KV memory, and a prompt attended in bf16, about twice as fast at 16k
                tokens) or "int8" (a code per value and a float32 scale per position and KV head: about a
                quarter). For long contexts; logits move by the rounding.
            preload: when the ring can hold every record, read them all in the background from the start
                (one at a time, while no layer is reading), so a model that fits in RAM soon runs with no reads.
                It changes no result, only when records arrive.
            watch_memory: when the memory the process may still take (MemAvailable, its cgroup, its rlimits)
                falls below half the margin the ring was sized with, stop preload and give ring slots back to
                the system, those the policy would evict first; take them again when memory returns (cache/pressure.py).
                Checked between tokens, and every CHECK_EVERY_S while the engine is idle. Speed only.
            router_lookahead: when the ring cannot hold every record, a decode step also reads ahead the
                experts the next MoE layer's router names from this layer's input (models/lookahead.py),
                weighed by how often that guess has been right. It raises the hit rate by reading more;
                off by default because on a disk-bound two-core machine reading more cost more than the
                waits it saved (benchmarks/RESULTS.md). Speed only; the native decode step (CPU) only.
            verbose: print notices (such as a Direct-I/O fallback) to stderr.
        Raises:
            VaultError: the directory is not a complete, valid vault.
            NotImplementedError: the arch block names something this runtime cannot run.
        """
        dev = torch.device(device) if device is not None else None
        on_cuda = dev is not None and dev.type == "cuda"
        kernel, backbone = precision_settings(precision, kernel, backbone, dev)
        if backbone not in BACKBONE_MODES:
            raise ValueError(f"backbone must be one of {BACKBONE_MODES}, not {backbone!r}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, not {kv_dtype!r}")
        kv_torch_dtype = KV_DTYPES[kv_dtype]
        if dev is not None:  # refused before anything is opened or allocated
            if kernel == "torch":
                raise ValueError("a device tier needs kernel='native' or 'native-int8'")
            if on_cuda and backbone != "bf16":
                raise ValueError("on CUDA the backbone runs as stored: backbone='int8' and 'fp8' are CPU modes")
            TieredExperts.check_args(dev, vram_budget, tier_policy)
        directory = Path(path).expanduser()
        vault = open_vault(directory)
        recipe = model_recipe(vault.arch)  # refuses what this runtime cannot run, before anything is allocated
        memory = memory_limit()  # taken before the backbone loads: what the process may still take
        threads = threads or os.cpu_count() or 1
        notice = (lambda msg: print(msg, file=sys.stderr)) if verbose else None
        if kernel == "torch":
            store, experts = None, TorchExperts(vault.dequantize_expert, recipe.expert_activation, vault.expert_biases)
        elif kernel in ("native", "native-int8"):
            isa = None
            if kernel == "native-int8":
                isa = _native.kernels.int8_isa()
                if isa is None:
                    raise ValueError("kernel='native-int8' needs AVX2 or AVX-512, which this CPU (or MOSAIC_ISA) "
                                     "lacks")
            # Sized before the backbone loads, so MemAvailable does not already count it: the backbone as
            # it will be held (quantised tensor by tensor as it loads) and the sequence state for max_seq.
            resident = resident_bytes(file_tensors(directory / BACKBONE_FILE), backbone,
                                      vault.arch["tie_word_embeddings"]) + SequenceState.bytes_for(recipe, max_seq,
                                                                                                   kv_torch_dtype)
            store = ExpertStore(vault, ring_slots(vault, ram_budget, resident, memory), io or DEFAULT_IO,
                                notice=notice)
            experts = NativeExperts(store, threads, isa, recipe.expert_activation)
        else:
            raise ValueError(f"kernel must be 'native', 'native-int8' or 'torch', not {kernel!r}")
        if dev is not None:
            experts = TieredExperts.open(experts, dev, vram_budget, tier_policy, resident if on_cuda else 0)
        weights = prepare_tensors(recipe, load_backbone(directory / BACKBONE_FILE, backbone,
                                                        vault.arch["tie_word_embeddings"]), backbone)
        if on_cuda:
            weights = {name: w.to(dev) for name, w in weights.items()}
        else:
            weights = on_huge_pages(weights)
        # On CUDA the model's own tensors (RoPE tables, KV pool, recurrent state) are made on the device.
        with torch.device(dev) if on_cuda else contextlib.nullcontext():
            model = build_model(recipe, weights, experts, max_seq, kv_torch_dtype)
        if router_lookahead and model.native is not None:
            model.native.lookahead = RouterLookahead(model)
        engine = cls(directory, vault, store, model, None, dev if on_cuda else None,
                     dict(precision=precision, kernel=kernel, backbone=backbone, kv_dtype=kv_dtype, threads=threads))
        engine.memory_limit = memory
        if store is not None and preload:  # after the backbone has loaded: not competing with its read
            store.preload()
        if store is not None and watch_memory:
            # Half the margin the ring was sized with: what the process may still take must not fall below it.
            margin = ring_margin(memory.available) // 2
            engine.valve = MemoryValve(store, margin, floor_slots=vault.arch["num_experts_per_tok"])
            engine._watch = threading.Thread(target=_watch_idle, args=(weakref.ref(engine), engine._watch_stop),
                                             name="mosaic-memory-watch", daemon=True)
            engine._watch.start()
        if (directory / "tokenizer.json").is_file():
            engine.codec = TextCodec(directory)
        return engine

    def finish_preload(self) -> None:
        """Block until the preload (Engine.open(preload=True)) has read every record, at full speed from
        here: afterwards no layer waits for a read. Does nothing when the vault did not fit the ring."""
        if self.store is not None:
            self.store.finish_preload()

    def _forward(self, ids, start: int, last_only: bool = False) -> torch.Tensor:
        """The model's float32 logits [T, V] on the CPU ([1, V], the last position's, with last_only); on
        CUDA the step's own tensors are made there."""
        with torch.device(self.device) if self.device is not None else contextlib.nullcontext(), \
                using_threads(self.threads):
            return self.model.forward(torch.as_tensor(ids, dtype=torch.long), start, last_only).cpu()

    @contextlib.contextmanager
    def _held(self):
        """This thread's hold on the engine for one request; another thread's request meanwhile is refused
        (its sequence state would interleave with this one's)."""
        me = threading.get_ident()
        with self._owner_cv:
            self._owner_cv.wait_for(lambda: self._owner is not _WATCH)  # a memory check: a millisecond at most
            if self._owner not in (None, me):
                raise RuntimeError("this Engine is running a request in another thread; use one Engine per "
                                   "thread, or finish (or close) that request first")
            outer, self._owner = self._owner, me
        try:
            yield
        finally:
            self._owner = outer

    def _relieve(self) -> None:
        """Between steps of a request: give ring memory back if memory ran short, or take it again."""
        if self.valve is not None:
            self.valve.check()

    def _check_if_idle(self) -> None:
        """The memory watch's turn: act only on an idle engine (a request checks between its own tokens)."""
        with self._owner_cv:
            if self._owner is not None:
                return
            self._owner = _WATCH
        try:
            self.valve.check(force=True)
        finally:
            with self._owner_cv:
                self._owner = None
                self._owner_cv.notify_all()

    def _sync_stats(self) -> None:
        if self.store is None:
            return
        s, c = self.stats, self.store.policy.counters
        s.hits = {layer: v.hits for layer, v in sorted(c.items())}
        s.misses = {layer: v.misses for layer, v in sorted(c.items())}
        s.bytes_read, s.preload_bytes = self.store.io.bytes_read, self.store.io.preload_bytes
        s.ahead_reads, s.ahead_used = self.store.io.ahead_reads, self.store.io.ahead_used
        s.io_s = self.store.io.io_s - self._io_mark
        s.kernel_s = self.model.experts.kernel_s - self._kernel_mark
        if isinstance(self.model.experts, TieredExperts):
            tier = self.model.experts
            s.tier = {layer: TierCounters(**vars(c)) for layer, c in sorted(tier.policy.counters.items())}
            s.device_bytes_copied = tier.cache.bytes_copied

    @property
    def arch(self) -> dict:
        return self.vault.arch

    def close(self) -> None:
        self._watch_stop.set()
        if self._watch is not None:
            self._watch.join()
        if self.store is not None:
            self.store.close()
        self.vault.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def logits(self, token_ids) -> torch.Tensor:
        """float32 logits [T, vocab] of a fresh forward pass over token_ids (the KV cache is reset)."""
        with self._held():
            self._relieve()
            return self._forward(list(token_ids), 0)

    def generate_ids(self, prompt_ids, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                     top_k: int = 0, seed: int | None = None, stop_ids=(), cached: int = 0,
                     cancelled: Callable[[], bool] | None = None) -> Iterator[int]:
        """Token ids, one at a time, after prefilling prompt_ids (PREFILL_CHUNK tokens at a time).

        cached: how many leading positions of the KV cache to keep; prompt_ids continue from there (the
        earlier turns of a conversation). 0 starts from an empty cache. cancelled: asked between prefill
        chunks; when it says so, nothing is generated (a server's client went away). On return (or when
        the caller stops iterating) the cache holds every token that was fed: `self.model.state.length`.
        """
        with self._held():
            yield from self._generate_ids(prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop_ids,
                                          cached, cancelled)

    def _generate_ids(self, prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop_ids, cached, cancelled):
        if not 0 <= cached <= self.model.state.length:
            raise ValueError(f"cached={cached} but the KV cache holds {self.model.state.length} tokens")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: at least one new token is needed for the next logits")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        stop = set(stop_ids) | set(self.arch.get("eos_token_ids") or [])
        s = self.stats
        s.prompt_tokens, s.new_tokens, s.ttft_s, s.decode_s = len(prompt_ids), 0, 0.0, 0.0
        if self.store is not None:  # io_s and kernel_s are per call; hits, misses and bytes since open
            self._io_mark, self._kernel_mark = self.store.io.io_s, self.model.experts.kernel_s
        t0 = time.perf_counter()
        ids = list(prompt_ids)
        for at in range(0, len(ids), PREFILL_CHUNK):  # bounded activations; a point to stop between chunks
            if at and cancelled is not None and cancelled():
                return
            self._relieve()
            logits = self._forward(ids[at:at + PREFILL_CHUNK], cached + at, last_only=True)[-1]
        for n in range(max_new_tokens):
            token = sample(logits, temperature, top_p, top_k, gen)
            s.new_tokens += 1
            if n == 0:
                s.ttft_s = time.perf_counter() - t0
                t1 = time.perf_counter()
            else:
                s.decode_s = time.perf_counter() - t1
            self._sync_stats()
            if token in stop:
                return
            yield token
            if n + 1 < max_new_tokens:
                self._relieve()
                pos = self.model.state.length
                logits = self._forward([token], pos)[-1]

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
        cut, detok = StopText(stop), Detokenizer(self.codec)
        tokens = self.generate_ids(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   top_k=top_k, seed=seed)
        for token in tokens:
            out = cut.push(detok.push(token))
            if out:
                yield out
            if cut.stopped is not None:
                return
        out = cut.finish(detok.flush())
        if out:
            yield out
