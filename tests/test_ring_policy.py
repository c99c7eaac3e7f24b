"""The ring's policies on routing with the structure of a real model's: each token tends to route to its own
experts. The routing policy must keep hits where LRU collapses (a ring smaller than one token's working set),
never do worse than LRU at a larger ring, and never hand out a slot it was told to leave alone."""

import numpy as np

from mosaic_runtime.cache.policy import LRUPolicy, RingPolicy, RoutingPolicy

LAYERS, EXPERTS, TOP_K = 8, 32, 4


def synthetic_steps(n: int = 3000, seed: int = 0):
    """(token, routes [L, k]): 40 token types with their own experts per layer, Zipf-distributed, one
    expert in five replaced at random."""
    rng = np.random.default_rng(seed)
    own = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)]) for _ in range(40)])
    p = 1 / np.arange(1, 41)
    for token in rng.choice(40, n, p=p / p.sum()):
        routes = own[token].copy()
        for layer in range(LAYERS):
            if rng.random() < 0.2:
                spare = np.setdiff1d(np.arange(EXPERTS), routes[layer])
                routes[layer, rng.integers(TOP_K)] = rng.choice(spare)
        yield int(token), routes


def replay(policy, steps) -> float:
    """Hit rate, driving the policy as ExpertStore does; checks it never hands out an excluded slot."""
    hits = lookups = 0
    for token, routes in steps:
        policy.begin_step(token)
        for layer in range(LAYERS):
            experts = sorted(routes[layer].tolist())
            policy.routed(layer, experts)
            found = [policy.lookup((layer, e)) for e in experts]
            pinned = {s for s in found if s is not None}
            for e, slot in zip(experts, found):
                if slot is None:
                    slot = policy.place((layer, e), set(pinned))
                    assert slot not in pinned
                    pinned.add(slot)
            hits += sum(s is not None for s in found)
            lookups += len(experts)
            if layer + 1 < LAYERS:
                for _, slot in policy.plan_ahead(layer + 1, set(pinned)):
                    assert slot not in pinned
            assert len(set(policy.where.values())) == len(policy.where) <= policy.n_slots
    return hits / lookups


def routing(slots: int) -> RoutingPolicy:
    return RoutingPolicy(slots, list(range(LAYERS)), EXPERTS, TOP_K)


def test_no_collapse_below_one_tokens_working_set():
    slots = LAYERS * TOP_K - 8  # a token needs 32 records, the ring holds 24
    lru = replay(LRUPolicy(slots), synthetic_steps())
    ours = replay(routing(slots), synthetic_steps())
    assert lru < 0.05 and ours > 0.3


def test_beats_lru_at_a_quarter_of_the_experts():
    slots = LAYERS * EXPERTS // 4
    assert replay(routing(slots), synthetic_steps()) > replay(LRUPolicy(slots), synthetic_steps()) + 0.05


def test_read_ahead_only_what_beats_what_it_displaces():
    policy = routing(LAYERS * EXPERTS // 4)
    policy.begin_step(None)  # a prefill says nothing of its routing: nothing is read ahead
    assert policy.plan_ahead(1, set()) == []
    steps = list(synthetic_steps(400))
    replay(policy, steps)  # the ring is full of what this routing uses
    policy.begin_step(None)
    policy.routed(0, [0, 1, 2, 3])  # a decode step of an unseen token: no better than what the ring holds
    assert len(policy.plan_ahead(1, set())) < TOP_K
    token, routes = steps[0]  # a token it has seen many times: its next layer is read ahead
    policy.begin_step(token)
    policy.routed(0, sorted(routes[0].tolist()))
    assert policy.plan_ahead(1, set())


def test_a_native_steps_bookkeeping_at_once_equals_it_layer_by_layer():
    """ran_held (what the native decode step reports, every layer at once) leaves the policy exactly as
    routed() and a lookup per expert, layer by layer, do: its learning, estimates and counters."""
    whole = RoutingPolicy(LAYERS * EXPERTS, list(range(LAYERS)), EXPERTS, TOP_K)
    stepwise = RoutingPolicy(LAYERS * EXPERTS, list(range(LAYERS)), EXPERTS, TOP_K)
    for policy in (whole, stepwise):  # every record held, as when the native loop runs the experts
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                policy._hold((layer, e), policy.place((layer, e), set()))
    for token, routes in synthetic_steps(200, seed=3):
        experts = np.sort(routes, axis=1)
        for policy in (whole, stepwise):
            policy.begin_step(token)
        whole.ran_held(list(range(LAYERS)), experts)
        RingPolicy.ran_held(stepwise, list(range(LAYERS)), experts)  # the per-layer reference
    for name in ("_value", "_stamp", "_co", "_seen", "_last", "_reuse", "_turns", "_step_routes"):
        assert np.array_equal(getattr(whole, name), getattr(stepwise, name)), name
    assert whole._recent().tolist() == stepwise._recent().tolist()
    assert {k: (c.hits, c.misses) for k, c in whole.counters.items()} == \
        {k: (c.hits, c.misses) for k, c in stepwise.counters.items()}


def guessing(policy):
    """(step, unheld) for decode steps of an unseen token in which layer 0 routes, layer 1 is guessed and
    read ahead, then routes: step(guess, routed) -> the experts read ahead; unheld() -> TOP_K experts of
    layer 1 the ring does not hold."""
    def step(guess, routed):
        policy.begin_step(None)
        policy.routed(0, [0, 1, 2, 3])
        planned = policy.plan_ahead(1, set(), guess)
        policy.routed(1, sorted(routed))
        return {e for (_, e), _ in planned}

    def unheld():
        return [e for e in range(EXPERTS) if (1, e) not in policy.where][:TOP_K]
    return step, unheld


def test_a_router_guess_is_read_ahead_as_far_as_it_has_proved_right():
    """A router lookahead's guess at the next layer weighs as much as the layer's past guesses were named by
    its routing: once right, guessed records the ring does not hold are read ahead; once wrong, not."""
    policy = routing(LAYERS * EXPERTS // 4)
    replay(policy, synthetic_steps(400))  # the ring is full of what this routing uses
    step, unheld = guessing(policy)
    for _ in range(30):  # guesses its routing names
        guess = unheld()
        step(guess, guess)
    assert policy._precision[1].min() > 0.9
    guess = unheld()
    assert step(guess, guess) == set(guess)
    for _ in range(30):  # as many guesses its routing never names: right half the time, which is no margin
        step(unheld(), [e for e in range(EXPERTS) if e not in unheld()][:TOP_K])
    assert policy._precision[1].max() < 0.6
    assert step(unheld(), [0, 1, 2, 3]) == set()


def test_a_router_guess_is_weighed_rank_by_rank():
    """Each rank of the guess (best first) keeps its own precision: where a guess's first two experts are
    always named and its last two never, only the first two are read ahead."""
    policy = routing(LAYERS * EXPERTS // 4)
    replay(policy, synthetic_steps(400))
    step, unheld = guessing(policy)
    for _ in range(30):
        guess = unheld()
        step(guess, guess[:2] + [e for e in range(EXPERTS) if e not in guess][:TOP_K - 2])
    assert policy._precision[1, :2].min() > 0.9 and policy._precision[1, 2:].max() < 0.1
    guess = unheld()
    assert step(guess, guess) == set(guess[:2])
