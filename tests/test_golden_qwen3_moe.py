"""Qwen3-MoE from a vault against Hugging Face transformers on the same weights, and stored golden tokens.

The reference is transformers' own model loaded from the source checkpoint, with its backbone replaced by
the vault's bf16 backbone and its experts by the vault's dequantised experts: the only difference left is
Mosaic's code. Tolerance: max |logit difference| <= 5e-5 (float32 end to end, logits of magnitude ~10).
"""

import json
from pathlib import Path

import pytest
import torch
import zstandard

from builders import random_qwen3_moe
from mosaic_runtime.engine import Engine
from mosaic_shatter.convert import convert
from reference import reference_model

GOLDEN = Path(__file__).parent / "data" / "golden" / "qwen3_moe.json.zst"
ATOL = 5e-5  # measured: at most 4.8e-6 on logits up to ~10
DECODE_STEPS = 16
CASES = {  # each a different corner of the family
    "dense-interleaved-gqa": dict(mlp_only_layers=[1]),
    "top3-of-8-tied-mqa": dict(num_experts=8, num_experts_per_tok=3, tie_word_embeddings=True,
                               num_key_value_heads=1, norm_topk_prob=False),
    "top1-mha-sparse-step-2": dict(num_experts=4, num_experts_per_tok=1, num_key_value_heads=4,
                                   decoder_sparse_step=2, num_hidden_layers=4),
}
PROMPT = [5, 17, 101, 64, 3, 250, 77, 9, 300, 42, 11, 128]


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    out = {}
    for name, cfg in CASES.items():
        ckpt = random_qwen3_moe(root / name, seed=len(name), eos_token_id=None, **cfg)
        for quant in ("q4", "fp8"):
            out[(name, quant)] = (ckpt, convert(str(ckpt), root / f"{name}-{quant}", quant, progress=False).out)
    return out


def mosaic_run(engine: Engine):
    """Prefill logits, then greedy decode: (tokens, logits of every step)."""
    logits = [engine.logits(PROMPT)]
    tokens = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(engine.model.forward(torch.tensor([tokens[-1]]), engine.model.state.length))
    return tokens, logits


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("quant", ["q4", "fp8"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(vaults, case, quant, kernel):
    ckpt, out = vaults[(case, quant)]
    engine = Engine.open(out, max_seq=64, kernel=kernel, precision="exact")
    tokens, logits = mosaic_run(engine)
    ref = reference_model(ckpt, engine)
    with torch.no_grad():
        ref_prefill = ref(torch.tensor([PROMPT])).logits[0]
        gen = ref.generate(torch.tensor([PROMPT]), max_new_tokens=DECODE_STEPS, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    assert (logits[0] - ref_prefill).abs().max() <= ATOL
    assert tokens == gen.sequences[0, len(PROMPT):].tolist()
    for step, ref_logits in enumerate(gen.logits):  # logits that chose token `step`
        assert (logits[step][-1] - ref_logits[0]).abs().max() <= ATOL, step
    assert len(set(logits[0].argmax(-1).tolist())) > 2  # not a comparison of two constant outputs


def test_generate_ids_matches_the_greedy_loop(vaults):
    engine = Engine.open(vaults[("dense-interleaved-gqa", "q4")][1], max_seq=64, precision="exact")
    tokens, _ = mosaic_run(engine)
    assert list(engine.generate_ids(PROMPT, max_new_tokens=DECODE_STEPS)) == tokens
    assert engine.stats.new_tokens == DECODE_STEPS and engine.stats.prompt_tokens == len(PROMPT)


def golden_tokens(vaults) -> dict:
    return {f"{case}/{quant}": mosaic_run(Engine.open(out, max_seq=64, precision="exact"))[0] for (case, quant), (_, out) in vaults.items()}


def test_stored_golden_tokens(vaults):
    """Runs without transformers: the checkpoints are built from a seeded generator."""
    want = json.loads(zstandard.ZstdDecompressor().decompress(GOLDEN.read_bytes()))
    assert golden_tokens(vaults) == want
