"""transformers' model of a checkpoint holding exactly a vault's weights: the reference the family tests
hold Mosaic to, so that the only difference left is Mosaic's code."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


def reference_model(ckpt, engine):
    """transformers' own model of `ckpt`, its backbone replaced by the vault's (as stored, bf16 or float32)
    and its experts by the vault's dequantised ones (an MXFP4 checkpoint dequantised by transformers on
    load, then replaced alike)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(ckpt)
    quantized = getattr(config, "quantization_config", None) or {}
    extra = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} \
        if quantized.get("quant_method") == "mxfp4" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, **extra).eval().float()
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for name, t in load_file(engine.directory / "backbone.safetensors").items():
            tensors[name].copy_(t.float())
        for layer in engine.vault.moe_layers:
            experts = model.model.layers[layer].mlp.experts
            for e in range(engine.arch["num_experts"]):
                gate, up, down = engine.vault.dequantize_expert(layer, e)
                if config.model_type == "gpt_oss":  # [E, in, out], gate and up columns interleaved; biases
                    biases = engine.vault.expert_biases(layer, e)
                    experts.gate_up_proj[e, :, 0::2].copy_(gate.T)
                    experts.gate_up_proj[e, :, 1::2].copy_(up.T)
                    experts.down_proj[e].copy_(down.T)
                    experts.gate_up_proj_bias[e, 0::2].copy_(biases["gate"])
                    experts.gate_up_proj_bias[e, 1::2].copy_(biases["up"])
                    experts.down_proj_bias[e].copy_(biases["down"])
                else:
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

    def mlp(self, *args):
        return self.real.mlp(*args)
