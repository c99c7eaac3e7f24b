"""Promotion policies of the device tier on hand-made traces: what is promoted, what is evicted, and the
byte budget never exceeded."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_runtime.tier import DecayedFrequency, HitThreshold

REC = 1000  # bytes per record


def test_seen_three_times_is_promoted_and_lru_is_evicted():
    p = HitThreshold(budget_bytes=2 * REC, record_bytes=REC)
    assert p.access(0, [1, 2]).promote == []
    assert p.access(0, [1, 2]).promote == []
    d = p.access(0, [1, 2])  # third sighting of each
    assert d.hits == [] and d.promote == [(0, 1), (0, 2)]
    assert p.access(0, [1]).hits == [1]  # 1 is now the most recently used resident
    for _ in range(3):
        d = p.access(0, [3])
    assert d.promote == [(0, 3)] and d.evict == [(0, 2)]  # 2 was the least recently used
    assert p.resident == {(0, 1), (0, 3)} and p.resident_bytes == 2 * REC
    c = p.counters[0]
    assert (c.hits, c.promotions, c.evictions) == (1, 3, 1) and c.misses == 2 * 3 + 3


def test_decayed_frequency_keeps_the_currently_hot_experts():
    p = DecayedFrequency(budget_bytes=1 * REC, record_bytes=REC, half_life=4, threshold=2.0)
    for _ in range(4):
        p.access(0, [7])
    assert p.resident == {(0, 7)}
    d = p.access(0, [9])  # one use: below threshold and below 7's score
    assert d.promote == [] and p.resident == {(0, 7)}
    for _ in range(20):  # 7 falls out of use, 9 is used every token
        d = p.access(0, [9])
        if d.promote:
            break
    assert d.promote == [(0, 9)] and d.evict == [(0, 7)]


def test_a_call_never_evicts_its_own_experts():
    """Found by the trace test below. Two experts reach the threshold in one call with room for one: the
    second must not evict the first (a copy made only to be dropped). And an expert promoted later in a
    call must not evict one the same call runs as a hit."""
    p = HitThreshold(budget_bytes=1 * REC, record_bytes=REC)
    for _ in range(2):
        p.access(0, [0, 1])
    d = p.access(0, [0, 1])
    assert d.promote == [(0, 0)] and d.evict == [] and p.resident == {(0, 0)}
    d = p.access(0, [1, 0])  # 1 is due, but the only resident is this call's hit
    assert d.hits == [0] and d.promote == [] and d.evict == []


def test_zero_budget_promotes_nothing():
    for policy in (HitThreshold(0, REC), DecayedFrequency(REC - 1, REC)):
        for _ in range(5):
            assert policy.access(0, [1]).promote == []


@settings(max_examples=50, deadline=None)
@given(trace=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True)),
                      min_size=1, max_size=200),
       slots=st.integers(0, 12), which=st.sampled_from([HitThreshold, DecayedFrequency]))
def test_budget_and_bookkeeping_hold_on_any_trace(trace, slots, which):
    p = which(budget_bytes=slots * REC + REC // 2, record_bytes=REC)
    resident = set()
    for layer, experts in trace:
        d = p.access(layer, experts)
        assert set(d.hits) == {e for e in experts if (layer, e) in resident}  # hits are what was resident
        resident -= set(d.evict)
        assert not (resident & set(d.promote))
        resident |= set(d.promote)
        assert resident == p.resident and p.resident_bytes <= p.budget_bytes
    total = sum(len(e) for _, e in trace)
    assert sum(c.hits + c.misses for c in p.counters.values()) == total
    assert sum(c.promotions for c in p.counters.values()) - sum(c.evictions for c in p.counters.values()) == len(resident)
