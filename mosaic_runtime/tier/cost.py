"""Where a non-resident expert runs, and how much device memory the expert cache gets.

Fiddler's rule, with constants measured at start-up on this machine: an expert whose record is not on the
device costs t_cpu(n) = a + b n on the CPU kernel for n tokens, or copy + t_dev(n) = c + d n when its
record is copied over first. At batch 1 the CPU wins (a copy of megabytes against one GEMV); a prefill
chunk that sends many tokens to one expert can make the copy pay.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

VRAM_MARGIN_BYTES = 1 << 30  # left free besides 5 % of the device: activations, dequant temporaries, cuBLAS
PROBE_TOKENS = (1, 32)  # the two batch sizes the lines are fitted through


@dataclass(frozen=True)
class CostModel:
    cpu_fixed_s: float
    cpu_per_token_s: float
    copy_s: float  # one record, host -> device
    device_fixed_s: float
    device_per_token_s: float

    def cpu_s(self, n: int) -> float:
        return self.cpu_fixed_s + self.cpu_per_token_s * n

    def device_s(self, n: int) -> float:
        return self.copy_s + self.device_fixed_s + self.device_per_token_s * n

    def prefers_device(self, n: int) -> bool:
        """Copy a non-resident expert to the device to run its n tokens there?"""
        return self.device_s(n) < self.cpu_s(n)

    @property
    def crossover_tokens(self) -> float:
        """Tokens per expert above which the copy pays (inf when it never does)."""
        slope = self.cpu_per_token_s - self.device_per_token_s
        gap = self.copy_s + self.device_fixed_s - self.cpu_fixed_s
        return gap / slope if slope > 0 else float("inf")

    @classmethod
    def measure(cls, cpu_run: Callable[[int], None], copy: Callable[[], None], device_run: Callable[[int], None],
                reps: int = 5) -> "CostModel":
        """Fit both lines from medians of `reps` timed calls at PROBE_TOKENS tokens (each callable must
        finish its work, device synchronised, before returning)."""
        def median_s(fn, *a) -> float:
            fn(*a)  # warm: first-call allocations, page faults, kernel selection
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn(*a)
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        n0, n1 = PROBE_TOKENS
        c0, c1 = median_s(cpu_run, n0), median_s(cpu_run, n1)
        d0, d1 = median_s(device_run, n0), median_s(device_run, n1)
        cpu_slope, dev_slope = max(0.0, (c1 - c0) / (n1 - n0)), max(0.0, (d1 - d0) / (n1 - n0))
        return cls(cpu_fixed_s=c0 - cpu_slope * n0, cpu_per_token_s=cpu_slope, copy_s=median_s(copy),
                   device_fixed_s=d0 - dev_slope * n0, device_per_token_s=dev_slope)


def device_expert_budget(free_bytes: int, total_bytes: int, resident_bytes: int) -> int:
    """The default expert-cache budget: free device memory (taken before the backbone and KV cache are
    loaded) minus what they will take (resident_bytes), minus a margin of 1 GiB plus 5 % of the device.
    Never negative."""
    return max(0, free_bytes - resident_bytes - VRAM_MARGIN_BYTES - total_bytes // 20)
