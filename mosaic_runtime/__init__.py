"""Mosaic runtime: runs Mixture-of-Experts models from an expert vault and a bf16 backbone."""

from .vault import Reason, Vault, VaultError, open_vault

__version__ = "0.1.0"
__all__ = ["open_vault", "Vault", "VaultError", "Reason", "__version__"]
