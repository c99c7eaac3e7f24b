"""The C++ header (native/include/mosaic/vault_format.h) and format.py describe the same bytes."""

import struct

from hypothesis import given
from hypothesis import strategies as st

from mosaic_runtime import _native
from mosaic_runtime.vault import format as fmt

CONSTANTS = ("VAULT_MAGIC", "VERSION_MAJOR", "VERSION_MINOR", "HEADER_SIZE", "PAGE_SIZE", "PLANE_ALIGN",
             "INDEX_ENTRY_SIZE", "Q4_BLOCK", "Q4_BLOCK_BYTES", "Q4_ZERO", "FP8_BLOCK", "MXFP4_BLOCK",
             "MXFP4_BLOCK_BYTES", "E8M0_BIAS", "FLAG_EXPERT_BIAS", "FLAG_PER_RECORD_QUANT", "Q3_BLOCK_BYTES",
             "Q3_ZERO", "Q2_BLOCK_BYTES", "Q2_ZERO")


def test_constants_match():
    for name in CONSTANTS:
        assert getattr(_native.format, name) == getattr(fmt, name), name


def test_header_fields_match_the_python_struct():
    fields = _native.format.header_field_offsets()
    # Walk the Python struct format field by field and compare offset and size.
    codes = fmt._HEADER.format.replace(" ", "").lstrip("<")
    items, i = [], 0
    while i < len(codes):
        if codes[i].isdigit():
            j = i
            while codes[j].isdigit():
                j += 1
            items.append(struct.calcsize("<" + codes[i:j + 1]))
            i = j + 1
        else:
            items.append(struct.calcsize("<" + codes[i]))
            i += 1
    offsets = [sum(items[:k]) for k in range(len(items))]
    assert [(off, size) for _, off, size in fields] == list(zip(offsets, items))
    assert fields[-1][0] == "header_crc32" and fields[-1][1] == 124


@given(quant=st.sampled_from(list(fmt.QuantType)), bf16=st.booleans(), bias=st.booleans(),
       hidden=st.integers(1, 20000), inter=st.integers(1, 20000))
def test_record_layout_matches(quant, bf16, bias, hidden, inter):
    scale = fmt.REQUIRED_SCALE_DTYPE.get(quant, fmt.ScaleDtype.BF16 if bf16 else fmt.ScaleDtype.F32)
    py = fmt.record_layout(quant, scale, hidden, inter, bias)
    planes, payload, record = _native.format.record_layout(int(quant), int(scale), hidden, inter, bias)
    assert (payload, record) == (py.payload_bytes, py.record_bytes)
    assert planes == [(p.projection, p.kind, p.offset, p.nbytes, *p.shape) for p in py.planes]
