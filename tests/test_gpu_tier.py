"""The device tier on a real CUDA GPU (skipped without one; benchmarks/gpu_check.sh runs it): backbone and
KV cache in VRAM, quantised records promoted into VRAM through the pinned ring, same greedy tokens as the
CPU engine."""

import pytest
import torch

from mosaic_runtime.engine import Engine
from mosaic_runtime.vault import open_vault
from test_device_tier import decode, model_dir, reference  # noqa: F401  (fixtures: the same model and CPU run)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The backbone's projections run with bf16 activations on the GPU (float32 on the CPU): logits of these
# O(1)-margin random models move by up to a few hundredths.
GPU_LOGIT_ATOL = 5e-2


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("policy", ["decayed-frequency", "hit-threshold"])
def test_cuda_tier_gives_the_cpu_tokens(model_dir, reference, share, policy):
    with open_vault(model_dir) as vault:
        budget = int(share * vault.header.num_records) * vault.header.record_bytes
    with Engine.open(model_dir, max_seq=64, device="cuda", vram_budget=budget, tier_policy=policy) as engine:
        assert engine.model.state.kv.k.is_cuda and engine.model.weights.embed.is_cuda
        assert engine.store.ring._pinned
        tokens, logits = decode(engine)
        assert tokens == reference[0]
        torch.testing.assert_close(logits, reference[1], atol=GPU_LOGIT_ATOL, rtol=0)
        tier = engine.model.experts
        assert tier.cache.slots.is_cuda and tier.cache.slots.dtype == torch.uint8
        assert set(tier.cache.where) == tier.policy.resident and tier.cache.resident_bytes <= budget
        engine._sync_stats()
        if share == 1.0:
            assert engine.stats.device_hit_rate > 0


def test_default_budget_fits_the_whole_tiny_vault(model_dir):
    with Engine.open(model_dir, max_seq=64, device="cuda") as engine:
        assert engine.model.experts.cache.capacity == engine.vault.header.num_records
        # At batch 1 the measured cost model keeps non-resident experts on the CPU (Fiddler's rule).
        assert not engine.model.experts.cost.prefers_device(1)
