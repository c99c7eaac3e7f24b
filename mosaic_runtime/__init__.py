"""Mosaic runtime: runs Mixture-of-Experts models from an expert vault and a bf16 backbone."""

import os

# OpenMP threads sleep between parallel regions instead of spinning. The runtime reads this once, when it
# loads: with the compiled extension, or earlier with torch, whose libgomp.so.1 the extension then shares.
# A spinning thread holds a core the ring's I/O threads need to start reads and check records: on two
# cores that cost a model larger than RAM 10-15 % of its decode speed (benchmarks/RESULTS.md, "Larger than
# RAM"); a model that fits decodes as fast either way. A value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
