"""Backbone quantised at load (int8, fp8, q4): close to bf16 on the bundled model and on a hybrid model whose
fused projections are un-fused after quantisation; bf16 stays the exact default."""

import pytest
import torch

from builders import tiny_hybrid
from mosaic_runtime.backbone import Q4Matrix, QuantizedMatrix
from mosaic_runtime.engine import Engine
from mosaic_shatter.convert import convert
from test_bundled_model import MODEL, SNIPPET


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    return convert(str(MODEL), tmp_path_factory.mktemp("bb") / "q4", "q4", progress=False).out


@pytest.mark.parametrize("mode, agree", [("int8", 0.97), ("fp8", 0.93), ("q4", 0.80)])
def test_quantised_backbone_stays_close_to_bf16(bundled, mode, agree):
    exact = Engine.open(bundled, max_seq=256, precision="exact")
    quant = Engine.open(bundled, max_seq=256, precision="exact", backbone=mode)
    kind = Q4Matrix if mode == "q4" else QuantizedMatrix
    assert isinstance(quant.model.layers[0].mixer.q, kind)
    head = quant.model.weights.lm_head  # a q4 backbone keeps lm_head in int8
    assert isinstance(head, QuantizedMatrix) and head.fp8 == (mode == "fp8")
    assert not isinstance(quant.model.weights.embed, (Q4Matrix, QuantizedMatrix))
    ids = exact.codec.encode(SNIPPET)
    a, b = exact.logits(ids), quant.logits(ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= agree
    assert (a - b).abs().max() < 0.1 * a.abs().max()


@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_hybrid_fused_projections_are_unfused_after_quantisation(tmp_path, mode):
    """Qwen3-Next's in_proj_qkvz/in_proj_ba are quantised as stored, then un-fused: a row permutation, so
    the result must equal quantising the un-fused bf16 rows (per-row scales commute with it)."""
    from mosaic_runtime.backbone import quantize_matrix
    ckpt = tiny_hybrid("qwen3_next", tmp_path / "next", seed=4)
    out = convert(str(ckpt), tmp_path / "q4", "q4", progress=False).out
    exact, quant = Engine.open(out, max_seq=64, precision="exact"), Engine.open(out, max_seq=64, backbone=mode)
    delta = [i for i, t in enumerate(exact.arch["layer_types"]) if t == "linear_attention"]
    for i in delta:
        for part in ("qkv", "z", "b", "a"):
            want = quantize_matrix(getattr(exact.model.layers[i].mixer, part), mode)
            got = getattr(quant.model.layers[i].mixer, part)
            assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales), (i, part)
    quant.logits([1, 2, 3])  # and it runs


def test_unknown_backbone_mode_is_refused(bundled):
    with pytest.raises(ValueError, match="backbone"):
        Engine.open(bundled, backbone="int4")


@pytest.mark.parametrize("mode", ["bf16", "q4"])
def test_backbone_moves_onto_huge_pages_unchanged(bundled, mode):
    """on_huge_pages: every tensor (a quantised matrix's codes and scales too) a view of one arena, aligned
    to a cache line, with the same dtype, shape and bits; the engine's model holds those views."""
    from safetensors.torch import load_file

    from mosaic_runtime.backbone import _arrays, on_huge_pages, prepare_backbone
    from mosaic_runtime.vault.format import BACKBONE_FILE
    weights = prepare_backbone(load_file(bundled / BACKBONE_FILE), mode, tie_word_embeddings=True)
    before = {(name, f): t.clone() for name, w in weights.items() for f, t in _arrays(w).items()}
    moved = on_huge_pages(weights)
    after = {(name, f): t for name, w in moved.items() for f, t in _arrays(w).items()}
    assert after.keys() == before.keys()
    assert len({t.untyped_storage().data_ptr() for t in after.values()}) == 1
    for key, t in after.items():
        assert t.dtype == before[key].dtype and torch.equal(t, before[key]) and t.data_ptr() % 64 == 0, key
    with Engine.open(bundled, max_seq=64, backbone=mode) as engine:
        q = engine.model.layers[0].mixer.q
        held = [q.codes, engine.model.weights.lm_head.codes] if mode == "q4" else [q, engine.model.weights.embed]
        assert held[0].untyped_storage().data_ptr() == held[1].untyped_storage().data_ptr()


@pytest.mark.parametrize("mode", ["bf16", "int8", "fp8", "q4"])
def test_loading_tensor_by_tensor_holds_what_the_header_predicts(bundled, mode):
    """load_backbone (each tensor quantised as it is read) equals prepare_backbone of the whole file, and
    resident_bytes, from the header alone, is what it holds: the engine sizes its ring with it."""
    from safetensors.torch import load_file

    from mosaic_runtime.backbone import _arrays, file_tensors, load_backbone, prepare_backbone, resident_bytes
    from mosaic_runtime.vault.format import BACKBONE_FILE
    path = bundled / BACKBONE_FILE
    streamed = load_backbone(path, mode, tie_word_embeddings=True)
    whole = prepare_backbone(load_file(path), mode, tie_word_embeddings=True)
    assert streamed.keys() == whole.keys()
    for name in whole:
        a, b = _arrays(streamed[name]), _arrays(whole[name])
        assert a.keys() == b.keys() and all(torch.equal(a[f], b[f]) for f in a), name
    held = sum(t.numel() * t.element_size() for w in streamed.values() for t in _arrays(w).values())
    assert resident_bytes(file_tensors(path), mode, tie_word_embeddings=True) == held
