"""Type stub of the compiled extension mosaic_runtime._native."""

from types import ModuleType

format: ModuleType  # VAULT_MAGIC, VERSION_MAJOR, ..., header_field_offsets(), record_layout(q, s, h, i)
