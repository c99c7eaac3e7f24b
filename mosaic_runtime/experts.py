"""Expert executors: run the routed experts of one layer for (x, topk_weights, topk_ids).

Model files call an executor and know nothing of vaults, rings or devices. Every executor accumulates
experts in ascending expert id, whatever order their weights became available in, so results never
depend on timing (and match transformers' own loop order).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from . import _native
from .recipe import Activation, ExpertActivation
from .vault.format import RecordLayout

ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [I, H], up [I, H], down [H, I]
ExpertBiases = dict[str, torch.Tensor]  # projection -> float32 [rows]
Guess = Callable[[], "list[int] | None"]  # the router lookahead's guess at the next MoE layer's experts


class ExpertExecutor:
    """What a model calls for its routed experts: the torch path calls the executor; the native decode step
    asks it once per step for the records it may run itself (native_loop) and hands it every layer it
    cannot finish (add_decode). An executor that runs experts elsewhere (another device, another process)
    implements __call__ and keeps the defaults: the native step then gives it each MoE layer."""

    kernel_s: float = 0.0  # time in the expert kernel, for engine.stats

    def __call__(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k], topk_ids [T, k] -> sum_k w * expert(x), [T, H]."""
        raise NotImplementedError

    def add_decode(self, layer: int, h: np.ndarray, w: np.ndarray, ids: np.ndarray, x: np.ndarray,
                   shared: Callable[[], None] | None = None, guess: Guess | None = None) -> None:
        """x [H] += sum_k w[k] expert_ids[k](h) for one token (float32 h [H], w [k]; int32 ids [k]). shared:
        what adds the layer's shared expert into x, called once before the routed experts are added (an
        executor that reads records calls it once their reads have started, so that it overlaps them).
        guess: the router lookahead's guess at the next MoE layer's experts, for an executor that reads
        records ahead (called only if it does)."""
        if shared is not None:
            shared()
        x += self(layer, torch.from_numpy(h)[None], torch.from_numpy(w)[None],
                  torch.from_numpy(ids.astype(np.int64))[None])[0].numpy()

    def native_loop(self, top_k: int):
        """The records the native decode step may run itself this step (a _native.kernels.LoopExperts), or
        None: then every MoE layer comes back through add_decode."""
        return None

    def begin_step(self, token: int | None) -> None:
        """A forward step begins: a decode step's input token, or None for a prefill."""

    def ran_natively(self, layers, topk_ids: np.ndarray, kernel_s: float) -> None:
        """Account the experts the native step ran itself for `layers` (topk_ids[layer] each)."""


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               act: ExpertActivation = ExpertActivation(), biases: ExpertBiases | None = None) -> torch.Tensor:
    """down(act(gate x, up x)) for x [n, H], each projection with its bias when given: the torch reference
    of the native kernels."""
    b = biases or {}
    g, u = F.linear(x, gate, b.get("gate")), F.linear(x, up, b.get("up"))
    if act.kind is Activation.SILU:
        h = F.silu(g) * u
    else:
        g = g.clamp(max=act.limit)
        h = (u.clamp(-act.limit, act.limit) + 1) * (g * torch.sigmoid(g * act.alpha))
    return F.linear(h, down, b.get("down"))


def expert_format(layout: RecordLayout, act: ExpertActivation):
    """The native kernels' description of a vault's experts (_native.kernels.ExpertFormat)."""
    k = _native.kernels
    return k.ExpertFormat(int(layout.quant), int(layout.scale_dtype), layout.hidden, layout.intermediate,
                          bias=layout.bias, activation=k.SILU if act.kind is Activation.SILU else k.CLAMPED_SWIGLU,
                          alpha=act.alpha, limit=act.limit)


class TorchExperts(ExpertExecutor):
    """Runs experts with torch ops on float32 weights supplied by `fetch(layer, expert)` (and their biases
    by `biases(layer, expert)`, where the vault has them)."""

    def __init__(self, fetch: Callable[[int, int], ExpertWeights], act: ExpertActivation = ExpertActivation(),
                 biases: Callable[[int, int], ExpertBiases | None] = lambda layer, expert: None):
        self.fetch, self.act, self.biases = fetch, act, biases

    def __call__(self, layer, x, topk_weights, topk_ids):
        y = torch.zeros_like(x)
        for e in torch.unique(topk_ids).tolist():  # ascending
            tokens, slot = torch.where(topk_ids == e)
            out = expert_ffn(x[tokens], *self.fetch(layer, e), self.act, self.biases(layer, e))
            y.index_add_(0, tokens, out * topk_weights[tokens, slot, None].to(x.dtype))
        return y


class NativeExperts(ExpertExecutor):
    """Runs a layer's routed experts in the native kernel (mosaic_runtime._native) on whole records held
    in the expert store's ring: weights are dequantised inside the kernel, never materialised, and each
    expert starts as soon as its record has arrived while the layer's other reads are still in flight.

    The kernel's scratch is allocated once for decode (one token) and grown at most once per larger prefill.
    """

    def __init__(self, store, threads: int, isa: int | None = None, act: ExpertActivation = ExpertActivation()):
        self._k = _native.kernels
        self.store, self.layout, self.threads = store, store.vault.layout, threads
        self.act, self.format = act, expert_format(self.layout, act)
        self.kernel_s = 0.0  # time inside the native call, for engine.stats
        self.isa = self._k.best_isa() if isa is None else isa
        self._scratch = np.zeros(0, np.float32)
        self._need: dict[tuple[int, int], int] = {}  # (tasks' rows, largest task) -> scratch floats
        self._decode_tasks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # k -> (counts, tokens) of a step
        self._loop, self._loop_top_k = None, 0  # the native decode step's view of the ring (native_loop)
        # A benchmark's replay of recorded routing (benchmarks/trace_replay.py), never a user option:
        # layer -> the expert ids a decode step runs instead of those its router chose.
        self.replay_routing: Callable[[int], list[int]] | None = None

    def begin_step(self, token: int | None) -> None:
        self.store.begin_step(token)

    def _scratch_for(self, total: int, max_n: int):
        need = self._need.get((total, max_n))
        if need is None:
            need = self._need[(total, max_n)] = self._k.scratch_floats(self.format, total, max_n, self.threads)
        if self._scratch.shape[0] < need:
            self._scratch = np.zeros(need, np.float32)
        return self._scratch

    def __call__(self, layer, x, topk_weights, topk_ids):
        if x.shape[0] == 1:  # a decode step: one token, no grouping
            xs = x.float().contiguous().numpy()
            return torch.from_numpy(self.decode(layer, xs, topk_weights[0].float().numpy(), topk_ids[0].tolist()))
        xs = x.float().contiguous().numpy()
        ids, w = topk_ids.numpy(), topk_weights.float().numpy()
        # the routed experts, sorted: np.unique would import numpy.ma (0.2 s) on a process's first prompt
        routed = np.flatnonzero(np.bincount(ids.ravel())).tolist()
        return torch.from_numpy(self.run(layer, xs, ids, w, routed)).to(x.dtype)

    def decode(self, layer: int, xs: np.ndarray, w: np.ndarray, ids: list[int]) -> np.ndarray:
        """One token's experts: xs [1, H], its routing weights w [k] and expert ids [k] -> [1, H]."""
        y = np.zeros_like(xs)
        self.add_decode(layer, xs[0], np.asarray(w, np.float32), np.asarray(ids, np.int32), y[0])
        return y

    def add_decode(self, layer: int, h: np.ndarray, w: np.ndarray, ids: np.ndarray, x: np.ndarray,
                   shared: Callable[[], None] | None = None, guess: Guess | None = None) -> None:
        """x [H] += sum_k w[k] expert_ids[k](h) for one token (float32 h [H], w [k]; int32 ids [k]), in
        ascending expert id: the native decode step adds a layer's experts straight into its residual
        stream, after its shared expert (shared(), run once the misses' reads have started). When every
        record is in the ring already (a model that fits in RAM, once preloaded) the kernel runs on the
        slots as they are, with none of acquire's pinning and read bookkeeping. guess: handed to the
        store's read-ahead."""
        if self.replay_routing is not None:
            ids = np.asarray(self.replay_routing(layer), np.int32)
        order = np.argsort(ids, kind="stable")
        experts = ids[order].tolist()
        k = len(experts)
        if k not in self._decode_tasks:
            self._decode_tasks[k] = (np.ones(k, np.int32), np.zeros(k, np.int32))
        counts, tokens = self._decode_tasks[k]
        weights = np.ascontiguousarray(w[order], np.float32)
        xs, y = h[None], x[None]
        self.store.routed(layer, experts)
        slots = self.store.resident(layer, experts)
        if slots is None:
            self._run_group(layer, experts, counts, tokens, weights, xs, y, ahead=True, before=shared, guess=guess)
            return
        self.store.read_ahead(layer, slots, guess)
        if shared is not None:
            shared()
        failed, _, total_s = self._k.moe_experts_ring(
            self.isa, self.threads, self.format, self.store.ring.native, np.asarray(slots, np.int32), counts, tokens,
            weights, xs, y, self._scratch_for(k, 1))
        self.kernel_s += total_s
        if failed >= 0:
            raise RuntimeError(f"layer {layer}: expert {experts[failed]}'s slot held no record")

    def native_loop(self, top_k: int):
        """The records the native decode step may run itself: the ring and the store's slot table, preload's
        landed reads accounted first so they are in it. Built once; the table changes in place."""
        self.store.reap()
        if self.replay_routing is not None:
            return None  # every layer through add_decode, where the recorded routing replaces the router's
        if self._loop is None or self._loop_top_k < top_k:
            self._loop_top_k = top_k
            # scratch of its own, sized for one token: the executor's own grows (and moves) with a prompt's
            # tokens, and a copy of it after a 512-token prompt was 34 MB (77 ms of the first decode step)
            need = self._k.scratch_floats(self.format, top_k, 1, self.threads)
            self._loop = _native.decode.LoopExperts(
                isa=self.isa, threads=self.threads, format=self.format, top_k=top_k, ring=self.store.ring.native,
                slot_of=self.store.slot_table, scratch=np.zeros(need, np.float32))
        return self._loop

    def ran_natively(self, layers, topk_ids: np.ndarray, kernel_s: float) -> None:
        """Account what the native layer loop ran for `layers`: each one's experts (topk_ids[layer]) as ring
        hits, made most recent in ascending id as add_decode would, and the kernel's time."""
        if layers:
            self.store.ran_held(layers, np.sort(topk_ids[layers], axis=1))
        self.kernel_s += kernel_s

    def run(self, layer: int, xs: np.ndarray, ids: np.ndarray, w: np.ndarray, experts: list[int]) -> np.ndarray:
        """sum over `experts` (ascending ids, a subset of those routed) of w * expert(x), as float32 [T, H]."""
        # Each expert's (token, slot) pairs in token order, by one stable sort of the flat ids (a scan of ids
        # per expert took 2.7 ms of a 512-token layer of 256 experts).
        flat = ids.ravel()
        order = np.argsort(flat, kind="stable")
        per_expert = np.bincount(flat, minlength=experts[-1] + 1)
        if len(experts) < np.count_nonzero(per_expert):  # a subset (the rest run on the device)
            order = order[np.isin(flat[order], experts)]
        counts = per_expert[experts].astype(np.int32)
        tokens = (order // ids.shape[1]).astype(np.int32)
        weights = w.ravel()[order].astype(np.float32)
        starts = np.concatenate([[0], np.cumsum(counts)])
        y = np.zeros_like(xs)
        # A prefill chunk may name more experts than the ring holds: run them in ascending groups that fit.
        # y accumulates task by task in the same order either way, so grouping never changes a bit.
        group = self.store.policy.usable  # less what memory pressure took back
        for g0 in range(0, len(experts), group):
            g1 = min(g0 + group, len(experts))
            lo, hi = starts[g0], starts[g1]
            self._run_group(layer, experts[g0:g1], counts[g0:g1], tokens[lo:hi], weights[lo:hi], xs, y)
        return y

    def _run_group(self, layer: int, experts: list[int], counts, tokens, weights, xs, y, ahead: bool = False,
                   before: Callable[[], None] | None = None, guess: Guess | None = None) -> None:
        """y += the experts' outputs (expert i takes the next counts[i] of tokens and weights), the records
        read into the ring as needed; each expert runs as soon as its record is in. ahead (a decode step):
        the next layer's likely records start reading behind this layer's own (guess: the router
        lookahead's, when there is one). before: work that adds into y ahead of the experts, run while
        their reads are in flight."""
        scratch = self._scratch_for(int(tokens.shape[0]), int(counts.max()))
        slots = self.store.acquire(layer, experts)
        try:
            if ahead:
                self.store.read_ahead(layer, slots, guess)
            if before is not None:
                before()
            # A failed read voids the call (y untouched).
            failed, wait_s, total_s = self._k.moe_experts_ring(
                self.isa, self.threads, self.format, self.store.ring.native, np.asarray(slots, np.int32), counts,
                tokens, weights, xs, y, scratch)
            self.kernel_s += total_s - wait_s
            self.store.finish(slots, wait_s)  # raises VaultError for a failed read
            if failed >= 0:  # the kernel saw a slot with no record: a bookkeeping bug, never a result
                raise RuntimeError(f"layer {layer}: expert {experts[failed]}'s slot held no record")
        finally:
            self.store.release(slots)
