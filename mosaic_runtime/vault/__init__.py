"""The vault format: byte layout, quantisation references, record assembly and the reader."""

from .format import VaultError, Reason
from .reader import Vault, open_vault

__all__ = ["Vault", "VaultError", "Reason", "open_vault"]
