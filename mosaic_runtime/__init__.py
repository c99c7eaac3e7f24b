"""Mosaic runtime: runs Mixture-of-Experts models from an expert vault and a bf16 backbone."""

import os

# OpenMP threads spin briefly at the end of a parallel region, then sleep. The runtime reads these once,
# when it loads: with the compiled extension, or earlier with torch, whose libgomp.so.1 the extension then
# shares. Spinning for long holds a core the ring's I/O threads need to start reads and check records: on
# two cores libgomp's default (300,000 spins) cost a model larger than RAM 10-15 % of its decode speed.
# Not spinning at all costs a model that fits as much: a decoded token crosses dozens of parallel regions,
# each a futex wake-up when the threads sleep at once. 10,000 spins (well under a millisecond) keeps most
# of the spin's gain there and costs a model larger than RAM at most a few per cent (benchmarks/RESULTS.md,
# "OpenMP threads: a short spin"). GOMP_SPINCOUNT overrides the policy in libgomp; LLVM's libomp (macOS)
# ignores it and sleeps at once. A value the user set, of either variable, is kept, and then neither is set.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["GOMP_SPINCOUNT"] = "10000"

from .vault import Reason, Vault, VaultError, open_vault

__version__ = "0.1.0"
__all__ = ["Engine", "open_vault", "Vault", "VaultError", "Reason", "__version__"]


def __getattr__(name):
    # The engine pulls in the compiled extension; importing it lazily keeps `mosaic_shatter`, which only
    # needs the format side, working without it.
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(name)
