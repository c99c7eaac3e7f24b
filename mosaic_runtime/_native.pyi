"""Type stub of the compiled extension mosaic_runtime._native."""

from types import ModuleType

format: ModuleType  # VAULT_MAGIC, VERSION_MAJOR, ..., header_field_offsets(), record_layout(q, s, h, i)
kernels: ModuleType  # matvec, moe_experts, moe_experts_ring, linear_bf16, linear_quant, scratch_floats, ISAs
io: ModuleType  # ExpertRing (slots, atomic states, I/O threads), crc32, slot state constants
