"""mosaic-shatter: turn a Hugging Face MoE checkpoint into an expert vault and a bf16 backbone.

Imports only the format side of mosaic_runtime (mosaic_runtime.vault), so converting needs neither
the compiled extension nor a GPU.
"""

from mosaic_runtime import __version__

__all__ = ["__version__"]
