"""Every ISA path end to end: one hybrid model (attention, Gated DeltaNet, routed and shared experts)
decoded through the native step in a fresh process per MOSAIC_ISA, each vector path's logits against the
scalar path's (the reference kernels). The kernels' own tests hold each kernel on odd shapes; this holds
that the decode step reaches the path it was asked for and that the paths compute one function."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from builders import tiny_hybrid
from mosaic_runtime import _native
from mosaic_shatter.convert import convert

K = _native.kernels
PATHS = [name for isa, name in ((K.SCALAR, "scalar"), (K.AVX2, "avx2"), (K.AVX512, "avx512"), (K.NEON, "neon"))
         if K.isa_available(isa)]
DECODE = """
import json, sys, torch
from mosaic_runtime import _native
from mosaic_runtime.engine import Engine
with Engine.open(sys.argv[1], max_seq=64, precision=sys.argv[2], threads=2) as engine:
    assert engine.model.native is not None
    rows = [engine.logits([5, 17, 101, 64, 3, 250, 77, 9])[-1]]
    for _ in range(6):
        token = torch.tensor([int(rows[-1].argmax())])
        rows.append(engine.model.forward(token, engine.model.state.length)[-1])
print(json.dumps({"isa": _native.kernels.best_isa(), "logits": torch.stack(rows).tolist()}))
"""


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("isa_paths")
    return convert(str(tiny_hybrid("qwen3_next", root / "ckpt", seed=21)), root / "q4", "q4", progress=False).out


def decode(vault, path: str, precision: str) -> np.ndarray:
    env = dict(os.environ, MOSAIC_ISA=path)
    res = subprocess.run([sys.executable, "-c", DECODE, str(vault), precision], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert K.isa_name(out["isa"]) == path  # the process ran the path it was asked for
    return np.array(out["logits"])


@pytest.mark.skipif(len(PATHS) < 2, reason="no vector ISA on this CPU")
def test_every_isa_path_decodes_as_the_scalar_one(vault):
    reference = decode(vault, "scalar", "exact")
    for path in PATHS[1:]:
        logits = decode(vault, path, "exact")
        assert np.array_equal(logits.argmax(-1), reference.argmax(-1)), path
        assert np.abs(logits - reference).max() < 1e-4, path  # float32 in another order


@pytest.mark.skipif(len(PATHS) < 3, reason="needs AVX2 and AVX-512")
def test_the_int8_paths_of_avx2_and_avx512_agree(vault):
    """The fast default's integer dot products are the same integers on both (test_kernels holds each against
    its reference); only float order differs. That 1-ulp difference can round one int8 activation the other
    way, which moves every later logit by about one quantisation step (0.08 on this model, whose logits
    span about 5) and no more: a wrong kernel moves them by the logits' own size."""
    a, b = decode(vault, "avx2", "fast"), decode(vault, "avx512", "fast")
    assert np.array_equal(a.argmax(-1), b.argmax(-1))
    assert np.abs(a - b).max() < 0.5
