"""transformers' model of a checkpoint holding exactly a vault's weights: the reference the family tests
hold Mosaic to, so that the only difference left is Mosaic's code."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


def reference_model(ckpt, engine):
    """transformers' own model of `ckpt`, its backbone replaced by the vault's (as stored, bf16 or float32)
    and its experts by the vault's dequantised ones."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for name, t in load_file(engine.directory / "backbone.safetensors").items():
            tensors[name].copy_(t.float())
        for layer in engine.vault.moe_layers:
            experts = model.model.layers[layer].mlp.experts
            for e in range(engine.arch["num_experts"]):
                gate, up, down = engine.vault.dequantize_expert(layer, e)
                experts.gate_up_proj[e].copy_(torch.cat([gate, up]))
                experts.down_proj[e].copy_(down)
    return model


class StepSpy:
    """Stands in for a model's native DecodeStep and records the layers each run() call went through."""

    def __init__(self, real, n_layers: int):
        self.real, self.n_layers, self.ran, self.calls = real, n_layers, [], 0
        self.top_k, self.vocab = real.top_k, real.vocab

    def run(self, first, *args):
        stop, kernel_s = self.real.run(first, *args)
        self.calls += 1
        self.ran.extend(range(first, min(stop + 1, self.n_layers)))
        return stop, kernel_s
