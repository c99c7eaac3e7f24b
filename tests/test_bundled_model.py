"""The bundled trained model (examples/stdlib-moe): small enough for git, converts, matches transformers
on real text, writes code far better than chance, and answers the docstring questions it was taught."""

import importlib.util
import json
import math
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mosaic_runtime.engine import Engine
from mosaic_shatter.convert import convert
from reference import reference_model

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "stdlib-moe"
MIN_ANSWERED = 14  # of 20: the bundled model answers 18, the same model before its chat phase none
SNIPPET = '''import os


def read_lines(path):
    """Return the lines of the file at path, without their newlines."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundled")
    return {q: convert(str(MODEL), root / q, q, progress=False).out for q in ("q4", "fp8")}


def test_checkpoint_is_a_small_complete_hf_directory():
    files = {p.name for p in MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md",
            "training.json"} <= files
    assert sum(p.stat().st_size for p in MODEL.iterdir()) <= 25 * 2**20
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg.get("num_experts", cfg.get("num_local_experts")) >= 16
    assert json.loads((MODEL / "tokenizer_config.json").read_text())["chat_template"]
    sampling = json.loads((MODEL / "generation_config.json").read_text())  # what the server samples with
    assert sampling["do_sample"] and sampling["temperature"] < 1 and sampling["top_p"] < 1


@pytest.mark.parametrize("quant", ["q4", "fp8"])
def test_matches_transformers_on_real_text(vaults, quant):
    engine = Engine.open(vaults[quant], max_seq=256, precision="exact")
    ids = engine.codec.encode(SNIPPET)[:96]
    logits = engine.logits(ids)
    ref = reference_model(MODEL, engine)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    scale = want.abs().max().item()
    assert (logits - want).abs().max() <= 1e-5 * scale + 5e-5  # float32 rounding of logits up to ~20
    tokens, step = [], logits
    for _ in range(16):  # greedy, with no stop token, as the reference generates
        tokens.append(int(step[-1].argmax()))
        step = engine.model.forward(torch.tensor([tokens[-1]]), engine.model.state.length)
    assert tokens == gen[0, len(ids):].tolist()


def test_writes_code_far_better_than_chance(vaults):
    engine = Engine.open(vaults["q4"], max_seq=256, precision="exact")
    ids = engine.codec.encode(SNIPPET)
    logits = engine.logits(ids)
    ppl = math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    assert ppl < 40, ppl  # chance is the vocabulary size, 4096


def _chat_quality():
    spec = importlib.util.spec_from_file_location("chat_quality", ROOT / "benchmarks" / "chat_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_answers_the_docstring_questions_it_was_taught(vaults):
    """As `mosaic chat --temperature 0` answers, from the Q4 vault at the fast default: a seeded sample of
    the training split's docstring questions, counted as benchmarks/chat_quality.py counts them."""
    trained_on = json.loads((MODEL / "training.json").read_text())["python"]
    if tuple(trained_on.split(".")[:2]) != platform.python_version_tuple()[:2]:
        pytest.skip(f"the questions come from this Python's standard library; the model learned {trained_on}'s")
    quality = _chat_quality()
    asked = quality.questions(quality.training_script(), 20, seed=1)
    engine = Engine.open(vaults["q4"], max_seq=256)
    answers = ["".join(engine.generate([{"role": "user", "content": q}], max_new_tokens=48)) for q, _ in asked]
    hits = sum(quality.answered(a, reference) for a, (_, reference) in zip(answers, asked))
    assert hits >= MIN_ANSWERED, (hits, list(zip([q for q, _ in asked], answers)))
