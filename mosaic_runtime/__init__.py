"""Mosaic runtime: runs Mixture-of-Experts models from an expert vault and a bf16 backbone."""

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
