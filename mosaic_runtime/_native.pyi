"""Type stub of the compiled extension mosaic_runtime._native."""

from types import ModuleType

format: ModuleType  # VAULT_MAGIC, VERSION_MAJOR, ..., header_field_offsets(), record_layout(q, s, h, i)
# matvec, moe_experts, moe_experts_ring, linear_bf16, linear_quant, linear_q4, decode_attention(_bf16, _i8),
# prefill_attention(_bf16, _i8),
# DecodeLayer (one Qwen3-MoE layer's decode step), stream_read, scratch_floats, ISAs
kernels: ModuleType
io: ModuleType  # ExpertRing (slots, atomic states, I/O threads), crc32, slot state constants
