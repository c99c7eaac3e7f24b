"""The device expert tier on the CPU: host memory stands in for VRAM (device="cpu"), so the executor's
split and combine, the device cache's bookkeeping and copies, the budget rule and the cost model run in
CI. tests/test_gpu_tier.py runs the same engine on CUDA where there is one."""

import numpy as np
import pytest
import torch

from builders import random_qwen3_moe
from mosaic_runtime.engine import Engine
from mosaic_runtime.experts import expert_ffn
from mosaic_runtime.tier import CostModel, DeviceExpertCache, TieredExperts, device_expert_budget
from mosaic_runtime.vault import open_vault
from mosaic_shatter.convert import convert

PROMPT = [5, 17, 101, 64, 3, 250, 77, 9, 31, 200, 4, 90]
STEPS = 16
LOGIT_ATOL = 1e-4  # float32 torch matmuls (device side) against the native kernel: rounding only


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier")
    ckpt = random_qwen3_moe(root / "ckpt", seed=5, eos_token_id=None, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=3, mlp_only_layers=[1])
    return convert(str(ckpt), root / "q4", "q4", progress=False).out


def decode(engine):
    """Greedy tokens and the logits of every step."""
    logits = [engine.logits(PROMPT)[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(STEPS):
        logits.append(engine._forward([tokens[-1]], engine.model.state.length)[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def reference(model_dir):
    with Engine.open(model_dir, max_seq=64, precision="exact") as engine:
        return decode(engine)


def record_bytes(model_dir):
    with open_vault(model_dir) as vault:
        return vault.header.record_bytes, vault.header.num_records


@pytest.mark.parametrize("policy", ["decayed-frequency", "hit-threshold"])
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_same_tokens_with_the_tier_on_or_off(model_dir, reference, policy, share):
    record, n = record_bytes(model_dir)
    budget = int(share * n) * record
    with Engine.open(model_dir, max_seq=64, precision="exact", device="cpu", vram_budget=budget, tier_policy=policy) as engine:
        tokens, logits = decode(engine)
        tier = engine.model.experts
        assert tokens == reference[0]
        torch.testing.assert_close(logits, reference[1], atol=LOGIT_ATOL, rtol=0)
        stats = engine.stats
        engine._sync_stats()
        hits = sum(c.hits for c in stats.tier.values())
        promotions = sum(c.promotions for c in stats.tier.values())
        # Each layer call counts its distinct experts once, as a device hit or a miss.
        routed = (len(PROMPT) + STEPS) * 2
        assert all(2 * STEPS < c.hits + c.misses <= routed for c in stats.tier.values())
        assert set(tier.cache.where) == tier.policy.resident  # the cache holds exactly what the policy says
        assert engine.store.policy._turns.sum() == 2 * STEPS  # the ring's policy saw every decode step route
        assert tier.cache.resident_bytes <= budget
        assert stats.device_bytes_copied == promotions * tier.cache.layout.payload_bytes
        if share == 0.0:
            assert hits == promotions == 0
        if share == 1.0:
            assert hits > 0  # later tokens ran on the "device"


def test_prefill_experts_copied_over_by_the_cost_model(model_dir, reference):
    """A cost model under which the copy always pays sends every non-resident expert to the device for
    the chunk; the tokens do not change."""
    record, _ = record_bytes(model_dir)
    with Engine.open(model_dir, max_seq=64, precision="exact", device="cpu", vram_budget=2 * record) as engine:
        tier = engine.model.experts
        tier.cost = CostModel(cpu_fixed_s=1.0, cpu_per_token_s=1.0, copy_s=0.0, device_fixed_s=0.0,
                              device_per_token_s=0.0)
        tokens, logits = decode(engine)
        assert tokens == reference[0]
        torch.testing.assert_close(logits, reference[1], atol=LOGIT_ATOL, rtol=0)
        assert sum(tier.transient.values()) > 0
        assert tier.cpu.kernel_s == 0.0  # nothing ran on the CPU kernel


def test_cpu_stand_in_needs_a_budget_and_cuda_refuses_quantised_backbones(model_dir):
    with pytest.raises(ValueError, match="explicit vram_budget"):
        Engine.open(model_dir, max_seq=64, precision="exact", device="cpu")
    with pytest.raises(ValueError, match="CPU modes"):
        Engine.open(model_dir, max_seq=64, precision="exact", device="cuda", backbone="int8")
    with pytest.raises(ValueError, match="tier_policy"):
        Engine.open(model_dir, max_seq=64, precision="exact", device="cpu", vram_budget=0, tier_policy="random")


def test_device_cache_keeps_records_quantised_and_runs_them(model_dir):
    with open_vault(model_dir) as vault:
        layer = vault.moe_layers[0]
        cache = DeviceExpertCache(vault.layout, 2, torch.device("cpu"))
        records = {e: np.frombuffer(bytearray(vault.read_record(layer, e)), np.uint8) for e in range(3)}
        cache.put((layer, 0), records[0])
        cache.put((layer, 1), records[1])
        with pytest.raises(RuntimeError, match="full"):
            cache.put((layer, 2), records[2])
        cache.evict((layer, 0))
        cache.put((layer, 2), records[2])
        cache.fence()
        assert cache.slots.dtype == torch.uint8 and cache.slots.shape[1] == vault.layout.payload_bytes
        assert set(cache.where) == {(layer, 1), (layer, 2)}
        x = torch.randn(3, vault.layout.hidden)
        torch.testing.assert_close(cache.run(cache.record((layer, 2)), x),
                                   expert_ffn(x, *vault.dequantize_expert(layer, 2)))


def test_default_budget_rule():
    gib = 1 << 30
    assert device_expert_budget(free_bytes=20 * gib, total_bytes=24 * gib, resident_bytes=6 * gib) == \
        20 * gib - 6 * gib - gib - 24 * gib // 20
    assert device_expert_budget(free_bytes=2 * gib, total_bytes=24 * gib, resident_bytes=6 * gib) == 0


def test_cost_model_follows_fiddlers_rule():
    cost = CostModel(cpu_fixed_s=20e-6, cpu_per_token_s=100e-6, copy_s=400e-6, device_fixed_s=30e-6,
                     device_per_token_s=2e-6)
    assert not cost.prefers_device(1)  # batch 1: the CPU wins over a copy
    assert cost.prefers_device(16)
    assert 4 < cost.crossover_tokens < 5
    never = CostModel(1e-6, 1e-6, 1e-3, 1e-6, 2e-6)
    assert never.crossover_tokens == float("inf") and not never.prefers_device(10_000)


def test_cost_model_fits_measured_lines(monkeypatch):
    """measure() fits t = a + b n through the two probe sizes; here a fake clock is the machine."""
    clock = [0.0]
    monkeypatch.setattr("mosaic_runtime.tier.cost.time.perf_counter", lambda: clock[0])

    def advance(seconds):
        clock[0] += seconds

    cost = CostModel.measure(cpu_run=lambda n: advance(5e-6 + 50e-6 * n), copy=lambda: advance(300e-6),
                             device_run=lambda n: advance(10e-6 + 1e-6 * n))
    assert cost.cpu_fixed_s == pytest.approx(5e-6) and cost.cpu_per_token_s == pytest.approx(50e-6)
    assert cost.copy_s == pytest.approx(300e-6)
    assert cost.device_fixed_s == pytest.approx(10e-6) and cost.device_per_token_s == pytest.approx(1e-6)


def test_measured_cost_model_on_the_stand_in(model_dir):
    """At start-up the engine measures the constants; every one is a real, non-negative time."""
    record, _ = record_bytes(model_dir)
    with Engine.open(model_dir, max_seq=64, precision="exact", device="cpu", vram_budget=record) as engine:
        tier = engine.model.experts
        assert isinstance(tier, TieredExperts)
        c = tier.cost
        assert c.cpu_fixed_s + c.cpu_per_token_s > 0 and c.copy_s > 0
        assert min(c.cpu_per_token_s, c.device_per_token_s, c.cpu_fixed_s, c.device_fixed_s) >= 0
