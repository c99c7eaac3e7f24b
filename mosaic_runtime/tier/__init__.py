"""The GPU expert tier (issue 5): hot experts' quantised records in device memory, run there while the CPU
kernel runs the cold ones; a promotion policy decides which, a measured cost model where prefill's
non-resident experts run."""

from .cost import CostModel, device_expert_budget
from .device_cache import DeviceExpertCache
from .executor import TieredExperts
from .policy import POLICIES, DecayedFrequency, HitThreshold, TierDecision, TierPolicy

__all__ = ["POLICIES", "CostModel", "DecayedFrequency", "DeviceExpertCache", "HitThreshold", "TierDecision",
           "TierPolicy", "TieredExperts", "device_expert_budget"]
