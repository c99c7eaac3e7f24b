"""The GPU expert tier (issue 5): which experts live in device memory, decided by a promotion policy."""

from .policy import POLICIES, DecayedFrequency, HitThreshold, TierDecision, TierPolicy

__all__ = ["POLICIES", "DecayedFrequency", "HitThreshold", "TierDecision", "TierPolicy"]
