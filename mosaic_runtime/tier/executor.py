"""The tiered expert executor: per layer, experts resident in the device cache run on the device while the
CPU kernel runs the cold ones from the ring, at the same time; then the policy's promotions and evictions
are applied for later tokens.

The layer's output is combined in a fixed order that depends only on the split: the device experts'
sum (ascending ids) plus the CPU experts' sum (ascending ids, the kernel's own order). With the tier off
every expert is in the CPU sum. The two differ only by float rounding, within GPU arithmetic's tolerance.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch

from ..experts import ExpertExecutor, NativeExperts
from .cost import CostModel, device_expert_budget
from .device_cache import DeviceExpertCache
from .policy import POLICIES, TierPolicy


class TieredExperts(ExpertExecutor):
    def __init__(self, cpu: NativeExperts, cache: DeviceExpertCache, policy: TierPolicy,
                 cost: CostModel | None = None):
        """Args:
            cpu: runs the cold experts on the CPU kernel, from the ring.
            cache: the device's quantised records.
            policy: decides promotions and evictions (tier/policy.py); its budget is the cache's capacity.
            cost: when given, a prefill chunk's non-resident expert with enough tokens is copied to the
                device and run there (not cached unless the policy promotes it).
        """
        if policy.capacity > cache.capacity:
            raise ValueError(f"policy holds {policy.capacity} records, the device cache only {cache.capacity}")
        self.cpu, self.cache, self.policy, self.cost = cpu, cache, policy, cost
        self.store, self.threads = cpu.store, cpu.threads
        self.device_s = 0.0  # waiting for the device's experts after the CPU's were done
        self.transient: dict[int, int] = defaultdict(int)  # layer -> experts copied over for one chunk only

    @classmethod
    def open(cls, cpu: NativeExperts, device: torch.device, vram_budget: int | None, policy: str,
             resident_device_bytes: int) -> "TieredExperts":
        """The tier as Engine.open builds it: budget, cache, policy, pinned ring and measured cost model.

        vram_budget: bytes for the expert cache. Default on CUDA: device_expert_budget() of the free
        memory, given what the backbone and KV cache are about to take (resident_device_bytes). The
        host-memory stand-in (device "cpu") has no free-memory figure and needs it given.
        """
        cls.check_args(device, vram_budget, policy)
        vault = cpu.store.vault
        layout = vault.layout
        if vram_budget is None:
            free, total = torch.cuda.mem_get_info(device)
            vram_budget = device_expert_budget(free, total, resident_device_bytes)
        capacity = min(max(0, vram_budget) // layout.record_bytes, vault.header.num_records)
        cache = DeviceExpertCache(layout, capacity, device, cpu.act)
        if device.type == "cuda":
            cpu.store.ring.pin_for_cuda()
        return cls(cpu, cache, POLICIES[policy](capacity * layout.record_bytes, layout.record_bytes),
                   measure_cost(cpu, cache))

    @staticmethod
    def check_args(device: torch.device, vram_budget: int | None, policy: str) -> None:
        """Raise ValueError for settings open() would refuse (checked before anything is allocated)."""
        if policy not in POLICIES:
            raise ValueError(f"tier_policy must be one of {sorted(POLICIES)}, not {policy!r}")
        if vram_budget is None and device.type != "cuda":
            raise ValueError(f"device={device.type!r} needs an explicit vram_budget")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}, but torch sees no CUDA device")

    @property
    def kernel_s(self) -> float:
        return self.cpu.kernel_s

    def begin_step(self, token: int | None) -> None:
        self.cpu.begin_step(token)

    def __call__(self, layer, x, topk_weights, topk_ids):
        device = self.cache.device
        ids = topk_ids.cpu().numpy()
        w = topk_weights.float().cpu().numpy()
        experts, counts = np.unique(ids, return_counts=True)
        experts, counts = experts.tolist(), dict(zip(experts.tolist(), counts.tolist()))
        if x.shape[0] == 1:  # a decode step: the ring's policy learns its routing, as on the CPU-only path
            self.store.routed(layer, experts)
        decision = self.policy.access(layer, experts)
        resident = set(decision.hits)
        copied = [] if self.cost is None else [
            e for e in experts if e not in resident and self.cost.prefers_device(counts[e])]
        on_device = sorted(resident | set(copied))
        on_cpu = [e for e in experts if e not in on_device]

        self.cache.fence()  # promotions of the last layer read ring slots that acquire() may now reuse
        # Whatever makes the host wait for the device comes before any device work is queued: the CPU's
        # copy of x, the copies of this chunk's transient records, the device experts' token lists (one
        # copy, from pinned memory). After that nothing on the host waits until the sum.
        xs = x.detach().to("cpu", torch.float32).contiguous().numpy() if on_cpu else None
        records = {e: self.cache.record((layer, e)) if e in resident else self._upload(layer, e) for e in on_device}
        xd = x.to(device=device, dtype=torch.float32)
        yd = torch.zeros_like(xd)
        if on_device:
            per = [np.nonzero(ids == e) for e in on_device]
            tok_d = self._to_device(np.concatenate([tok for tok, _ in per]).astype(np.int64))
            w_d = self._to_device(np.concatenate([w[tok, slot] for tok, slot in per]).astype(np.float32))
            at = 0
            for e, (tok, _) in zip(on_device, per):  # on CUDA these launches return at once
                idx, we = tok_d[at:at + len(tok)], w_d[at:at + len(tok)]
                at += len(tok)
                yd.index_add_(0, idx, self.cache.run(records[e], xd[idx]) * we[:, None])
        y_cpu = self.cpu.run(layer, xs, ids, w, on_cpu) if on_cpu else None  # meanwhile, on the CPU
        t = time.perf_counter()
        y = yd if y_cpu is None else yd + torch.from_numpy(y_cpu).to(device)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.device_s += time.perf_counter() - t
        self._apply(decision)
        return y.to(x.dtype)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.cache.device.type == "cuda":  # pinned, so the copy is asynchronous
            return t.pin_memory().to(self.cache.device, non_blocking=True)
        return t.to(self.cache.device)

    def _upload(self, layer: int, expert: int) -> torch.Tensor:
        """A non-resident record on the device for this chunk: read through the ring, copied once."""
        self.transient[layer] += 1
        slots = self.store.acquire(layer, [expert])
        try:
            self.store.wait(slots)
            host = torch.from_numpy(self.store.ring.view(slots[0])[:self.cache.layout.payload_bytes])
            return host.to(self.cache.device)  # synchronous: the slot is released right after
        finally:
            self.store.release(slots)

    def _apply(self, decision) -> None:
        for key in decision.evict:
            self.cache.evict(key)
        for key in decision.promote:
            record = self.store.cached(*key)
            if record is None:  # not in the ring (a prefill chunk larger than it): read it directly
                record = np.frombuffer(bytearray(self.store.vault.read_compute_record(*key)), np.uint8)
            self.cache.put(key, record)


def measure_cost(cpu: NativeExperts, cache: DeviceExpertCache) -> CostModel:
    """The cost model's constants on this machine, from the vault's first expert record."""
    vault, layout, k = cpu.store.vault, cpu.layout, cpu._k
    n = 32
    record = np.frombuffer(bytes(vault.read_compute_record(vault.moe_layers[0], 0)), np.uint8)
    xs = np.random.default_rng(0).standard_normal((n, layout.hidden), dtype=np.float32)
    y = np.zeros_like(xs)
    scratch = cpu._scratch_for(n, n)
    host = torch.from_numpy(record[:layout.payload_bytes].copy())
    if cache.device.type == "cuda":
        host = host.pin_memory()
    on_device = host.to(cache.device)
    xd = torch.from_numpy(xs).to(cache.device)
    sync = torch.cuda.synchronize if cache.device.type == "cuda" else (lambda: None)

    def cpu_run(t: int) -> None:
        k.moe_experts(cpu.isa, cpu.threads, cpu.format, [record], [np.arange(t, dtype=np.int32)],
                      [np.ones(t, np.float32)], xs, y, scratch)

    def copy() -> None:
        on_device.copy_(host, non_blocking=True)
        sync()

    def device_run(t: int) -> None:
        cache.run(on_device, xd[:t])
        sync()

    return CostModel.measure(cpu_run, copy, device_run)
