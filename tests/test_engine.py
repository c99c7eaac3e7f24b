"""Engine: same tokens whatever the RAM budget or I/O mode, cache accounting, errors, text generation."""

import errno
import os
import re
import subprocess
import sys
import tracemalloc

import pytest
import torch

from builders import add_chat_tokenizer, flip_byte, random_qwen3_moe
from mosaic_runtime import VaultError
from mosaic_runtime.engine import Engine
from mosaic_shatter.convert import convert

PROMPT = [5, 17, 101, 64, 3, 250, 77, 9]
STEPS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    ckpt = random_qwen3_moe(root / "ckpt", seed=3, eos_token_id=None, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=4, mlp_only_layers=[2])
    return convert(str(ckpt), root / "q4", "q4", progress=False).out


def run(engine):
    out = [engine.logits(PROMPT)]
    token = int(out[-1][-1].argmax())
    for _ in range(STEPS):
        out.append(engine.model.forward(torch.tensor([token]), engine.model.state.length))
        token = int(out[-1][-1].argmax())
    return out


def record_bytes(model_dir):
    return Engine.open(model_dir, ram_budget=1 << 30, max_seq=64).vault.header.record_bytes


def test_logits_bit_identical_whatever_the_ring_size_and_io(model_dir):
    rec = record_bytes(model_dir)
    tiny = Engine.open(model_dir, ram_budget=2 * rec, io="buffered", max_seq=64)  # one layer's top-2 only
    full = Engine.open(model_dir, ram_budget=1 << 30, io="direct", max_seq=64)
    assert tiny.store.ring.n_slots == 2 and full.store.ring.n_slots == 3 * 8
    native = {tiny: 0, full: 0}  # MoE layers whose experts the native layer loop ran from held records
    for engine in (tiny, full):
        def spy(layers, ids, kernel_s, engine=engine, real=engine.model.experts.ran_natively):
            native[engine] += len(layers)
            real(layers, ids, kernel_s)
        engine.model.experts.ran_natively = spy
    a, b = run(tiny), run(full)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert native[tiny] == 0 and native[full] > 0  # tiny's two slots never hold the next layer's experts
    direct_tiny = Engine.open(model_dir, ram_budget=2 * rec, io="direct", max_seq=64)
    assert all(torch.equal(x, y) for x, y in zip(a, run(direct_tiny)))
    assert tiny.store.ring.mode == "buffered" and direct_tiny.store.ring.mode == "direct"


def test_slot_table_is_what_the_ring_holds(model_dir):
    """The native layer loop runs experts from store.slot_table without asking: after any mix of reads,
    evictions and hits it must name exactly the held, checked records (policy.where less pending reads)."""
    import random

    from mosaic_runtime.cache.ring import SlotState
    rec = record_bytes(model_dir)
    store = Engine.open(model_dir, ram_budget=5 * rec, max_seq=64).store  # 5 slots for 24 records: evictions
    rng = random.Random(0)
    for _ in range(200):
        layer = rng.choice([0, 1, 3])
        experts = sorted(rng.sample(range(8), 2))
        slots = store.resident(layer, experts)
        if slots is None:
            slots = store.acquire(layer, experts)
            store.wait(slots)
            store.release(slots)
        held = {key: slot for key, slot in store.policy.where.items() if slot not in store._reading}
        table = {(int(l), int(e)): int(store.slot_table[l, e]) for l, e in zip(*(store.slot_table >= 0).nonzero())}
        assert table == held
        assert all(store.ring.state(slot) == SlotState.READY for slot in table.values())
        assert store.slot_table[layer, experts].tolist() == slots


def test_native_kernel_agrees_with_the_torch_reference(model_dir):
    native = run(Engine.open(model_dir, max_seq=64, precision="exact"))
    ref = run(Engine.open(model_dir, max_seq=64, precision="exact", kernel="torch"))
    assert all((x - y).abs().max() < 5e-5 for x, y in zip(native, ref))


def test_int8_activation_kernel_stays_close(model_dir):
    from mosaic_runtime import _native
    if _native.kernels.int8_isa() is None:
        pytest.skip("no int8-activation ISA on this CPU")
    fast = Engine.open(model_dir, max_seq=64, precision="exact", kernel="native-int8")
    exact = Engine.open(model_dir, max_seq=64, precision="exact")
    a, b = fast.logits(PROMPT), exact.logits(PROMPT)
    assert (a - b).abs().max() <= 0.02 * b.abs().max()  # int8 activations: ~0.4 % per dot product
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_budget_below_one_layers_top_k_is_refused(model_dir):
    rec = record_bytes(model_dir)
    with pytest.raises(ValueError, match="top-2"):
        Engine.open(model_dir, ram_budget=2 * rec - 1, max_seq=64)


def test_cache_counters(model_dir):
    engine = Engine.open(model_dir, ram_budget=1 << 30, max_seq=64)
    list(engine.generate_ids(PROMPT, max_new_tokens=4))
    s = engine.stats
    assert set(s.misses) == {0, 1, 3}  # the MoE layers
    assert s.bytes_read == sum(s.misses.values()) * engine.vault.header.record_bytes
    first_read = s.bytes_read
    list(engine.generate_ids(PROMPT, max_new_tokens=4))  # same prompt, same experts: all hits now
    assert engine.stats.bytes_read == first_read and engine.stats.hit_rate > 0.5
    assert engine.stats.new_tokens == 4 and engine.stats.ttft_s > 0
    assert engine.stats.kernel_s > 0 and engine.stats.backbone_s > 0 and engine.stats.io_s == 0  # all hits


def test_no_reallocation_in_the_token_loop(model_dir):
    engine = Engine.open(model_dir, ram_budget=1 << 30, max_seq=64)
    run(engine)  # warm: scratch sized, every expert read once
    ring, scratch = engine.store.ring.address, engine.model.experts._scratch.ctypes.data
    kv = engine.model.state.kv.k.data_ptr()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    token = 7
    for _ in range(8):
        token = int(engine.model.forward(torch.tensor([token]), engine.model.state.length)[-1].argmax())
    grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename") if d.size_diff > 0)
    tracemalloc.stop()
    assert engine.store.ring.address == ring and engine.model.experts._scratch.ctypes.data == scratch
    assert engine.model.state.kv.k.data_ptr() == kv
    assert grown < 64 << 10  # Python-level churn only: no buffer grows with the tokens


def first_read_error(engine) -> VaultError | None:
    """The VaultError of the first of a fixed series of prompts whose routing reaches a bad record."""
    for start in range(0, 300, 7):  # this model routes one of these to expert 3 of layer 1
        try:
            engine.logits([start % 320, (start * 3) % 320, (start * 5) % 320])
        except VaultError as e:
            return e
    return None


def test_corrupted_record_raises_and_hands_nothing_to_the_kernel(model_dir, tmp_path):
    import shutil
    d = tmp_path / "bad"
    shutil.copytree(model_dir, d)
    engine = Engine.open(d, ram_budget=1 << 30, max_seq=64, preload=False)  # it would read the good bytes first
    entry = engine.vault.entry(1, 3)
    flip_byte(d / "experts.vault", entry.offset + 777)
    bad = first_read_error(engine)
    assert bad is not None and (bad.layer, bad.expert) == (1, 3)
    assert (1, 3) not in engine.store.policy.where  # the slot was emptied, not left looking valid


def test_direct_io_refused_falls_back_with_one_notice(model_dir, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(os, "open", no_direct)
    notices = []
    engine = Engine.open(model_dir, ram_budget=1 << 30, io="direct", max_seq=64, verbose=False)
    assert engine.store.ring.mode == "buffered"
    from mosaic_runtime.io import open_for_reads
    direct_fd, buffered_fd = open_for_reads(model_dir / "experts.vault", "direct", notices.append)
    os.close(buffered_fd)
    assert direct_fd == -1 and len(notices) == 1 and "O_DIRECT" in notices[0]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, model_dir):
    """The model directory plus a real byte-level BPE tokenizer and a chat template."""
    import shutil
    d = tmp_path_factory.mktemp("chat") / "m"
    shutil.copytree(model_dir, d)
    add_chat_tokenizer(d)
    return d


def test_generate_streams_text_that_decodes_the_ids(chat_dir):
    engine = Engine.open(chat_dir, max_seq=128)
    pieces = list(engine.generate("def add(a, b):", max_new_tokens=10))
    ids = list(engine.generate_ids(engine.codec.encode("def add(a, b):"), max_new_tokens=10))
    assert "".join(pieces) == engine.codec.decode(ids)


def test_chat_messages_use_the_checkpoints_template(chat_dir):
    engine = Engine.open(chat_dir, max_seq=128)
    rendered = engine.codec.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = "".join(engine.generate([{"role": "user", "content": "hi"}], max_new_tokens=6))
    assert text == "".join(engine.generate(engine.codec.encode(rendered), max_new_tokens=6))


def test_sampling_is_seeded_and_stop_strings_cut(chat_dir):
    engine = Engine.open(chat_dir, max_seq=128)
    a = "".join(engine.generate("return", max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1))
    b = "".join(engine.generate("return", max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1))
    assert a == b
    if len(a) > 3:
        stop = a[2:4]
        cut = "".join(engine.generate("return", max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1,
                                      stop=[stop]))
        assert cut == a[:a.index(stop)]


def test_template_sandbox_refuses_unsafe_code(chat_dir):
    engine = Engine.open(chat_dir, max_seq=128)
    engine.codec.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    from mosaic_runtime.generate import ChatTemplateError
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        engine.codec.render_chat([])


def test_direct_read_refused_midway_falls_back(model_dir):
    """O_DIRECT accepted at open but a read refused (EINVAL): the I/O thread switches to buffered reads."""
    import zlib
    from mosaic_runtime.cache.ring import Ring, SlotState
    notices = []
    ring = Ring(model_dir / "experts.vault", 2, 16384, "direct", io_threads=1, notice=notices.append)
    head = (model_dir / "experts.vault").read_bytes()[:1000]
    assert ring.mode == "direct"
    ring.submit(0, 0, 1000, zlib.crc32(head))  # 1000 bytes: not a multiple of the block size Direct I/O needs
    assert ring.wait(0) == SlotState.IN_USE and bytes(ring.view(0)[:1000]) == head
    ring.announce_fallback()
    ring.announce_fallback()
    assert ring.mode == "buffered" and len(notices) == 1
    ring.close()


def test_a_layer_abandoned_mid_read_leaves_the_store_consistent(model_dir):
    """Ctrl-C between the router and the kernel: reads in flight land, nothing stays pinned or unchecked."""
    from mosaic_runtime.cache.ring import SlotState
    engine = Engine.open(model_dir, ram_budget=1 << 30, max_seq=64, preload=False)
    want = run(Engine.open(model_dir, ram_budget=1 << 30, max_seq=64))
    store = engine.store
    slots = store.acquire(1, [0, 3, 5])  # reads submitted, the kernel never runs
    store.release(slots)
    assert not store._pinned and not store._reading
    assert all(store.ring.state(s) == SlotState.READY for s in slots)
    assert all(torch.equal(a, b) for a, b in zip(run(engine), want))


def wait_for_preload(store):
    for slot in list(store._reading):
        store.ring.wait(slot)


@pytest.mark.parametrize("finish", [False, True])
def test_preload_fills_the_ring_and_changes_no_bit(model_dir, finish):
    """A vault that fits: every record is read in the background at open (or at once, finish_preload),
    so the layers read nothing."""
    engine = Engine.open(model_dir, ram_budget=1 << 30, max_seq=64)
    store = engine.store
    assert len(store._reading) == len(engine.vault.entries) == store.ring.n_slots
    if finish:
        engine.finish_preload()
    else:
        wait_for_preload(store)
        store.reap()  # what the decode step does first
    from mosaic_runtime.cache.ring import SlotState
    assert all(store.ring.state(s) == SlotState.READY for s in range(store.ring.n_slots))  # not pinned
    # accounted: the native layer loop finds every record without a layer asking for it first
    assert not store._reading and (store.slot_table >= 0).sum() == len(engine.vault.entries)
    out = run(engine)
    assert all(torch.equal(a, b) for a, b in zip(out, run(Engine.open(model_dir, max_seq=64, preload=False))))
    engine._sync_stats()
    s = engine.stats
    assert s.bytes_read == 0 and sum(s.misses.values()) == 0 and s.preload_bytes > 0
    assert s.preload_bytes % engine.vault.header.record_bytes == 0


def test_preload_skipped_when_the_vault_does_not_fit(model_dir):
    rec = record_bytes(model_dir)
    engine = Engine.open(model_dir, ram_budget=5 * rec, max_seq=64)
    assert engine.store.preload() == 0 and not engine.store._reading
    assert len(run(engine)) == STEPS + 1


def test_a_record_preload_could_not_read_is_reported_when_a_layer_needs_it(model_dir, tmp_path):
    """A corrupt record: its background read fails quietly; the layer that needs it reads it again and
    gets the VaultError, as without preload."""
    import shutil
    d = tmp_path / "bad"
    shutil.copytree(model_dir, d)
    entry = Engine.open(d, max_seq=64, preload=False).vault.entry(1, 3)
    flip_byte(d / "experts.vault", entry.offset + 777)
    engine = Engine.open(d, ram_budget=1 << 30, max_seq=64)
    wait_for_preload(engine.store)
    bad = first_read_error(engine)
    assert bad is not None and (bad.layer, bad.expert) == (1, 3)
    assert (1, 3) not in engine.store.policy.where


def test_two_engines_keep_their_own_thread_settings(model_dir, monkeypatch):
    """Threads are per engine, not per process: opening a second engine does not change the first's."""
    from mosaic_runtime import ops
    from mosaic_runtime.models import native_step
    seen = []
    monkeypatch.setattr(native_step, "threads", lambda: seen.append(ops.threads()) or ops.threads())
    with Engine.open(model_dir, max_seq=64, threads=1) as one, Engine.open(model_dir, max_seq=64, threads=2) as two:
        for engine, want in ((one, 1), (two, 2), (one, 1)):
            seen.clear()
            list(engine.generate_ids(PROMPT, max_new_tokens=3))
            assert seen and set(seen) == {want}
    assert ops.threads() == (os.cpu_count() or 1)  # nothing leaks out of the engines' calls


SUBNORMALS = """
import threading, torch
from mosaic_runtime import ops
tiny = torch.full((1 << 20,), 3e-40)  # many elements: torch splits the multiply over its workers
seen = [float((tiny * 3).abs().max())]  # this thread: flushed when ops was imported
torch.set_flush_denormal(False)  # as a thread started before the import would be
def forward_pass():  # another thread, as a server's: flushed by using_threads
    with ops.using_threads(2):
        seen.append(float((torch.full((1 << 20,), 3e-40) * 3).abs().max()))
worker = threading.Thread(target=forward_pass)
worker.start()
worker.join()
print(*seen)
"""


def test_forward_passes_read_and_write_subnormal_floats_as_zero():
    """DeltaNet decays underflow below float32's normal range, where x86 multiplies are many times slower:
    the engine's threads, and the torch workers they start, flush such values to zero (ops.flush_subnormals)."""
    import subprocess
    import sys
    if not torch.set_flush_denormal(True):  # (already set in this process by the import of mosaic_runtime)
        pytest.skip("this CPU cannot flush subnormal floats")
    run = subprocess.run([sys.executable, "-c", SUBNORMALS], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["0.0", "0.0"]


def test_an_engine_busy_in_another_thread_refuses_a_request(model_dir):
    import threading
    with Engine.open(model_dir, max_seq=64) as engine:
        tokens = engine.generate_ids(PROMPT, max_new_tokens=8)
        next(tokens)  # this thread holds the engine until the generation ends
        errors = []
        other = threading.Thread(target=lambda: errors.append(_refusal(engine)))
        other.start()
        other.join()
        assert errors and "another thread" in errors[0]
        tokens.close()  # the generation ends: the other thread may run now
        other = threading.Thread(target=lambda: errors.append(engine.logits(PROMPT).shape))
        other.start()
        other.join()
        assert errors[1][0] == len(PROMPT)


def _refusal(engine) -> str:
    try:
        engine.logits(PROMPT)
    except RuntimeError as e:
        return str(e)
    return "no refusal"


def test_a_long_prompt_is_prefilled_in_chunks_and_can_be_stopped_between_them(model_dir, monkeypatch):
    import mosaic_runtime.engine as engine_module
    prompt = [(7 * i + 3) % 256 for i in range(250)]
    with Engine.open(model_dir, max_seq=512, precision="exact") as engine:
        whole = list(engine.generate_ids(prompt, max_new_tokens=8))
        monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 64)  # four chunks: 64, 64, 64, 58
        assert list(engine.generate_ids(prompt, max_new_tokens=8)) == whole
        asked = []
        stop_after_two = lambda: asked.append(1) or len(asked) >= 2  # noqa: E731
        assert list(engine.generate_ids(prompt, max_new_tokens=8, cancelled=stop_after_two)) == []
        assert engine.model.state.length == 128  # two chunks prefilled, then it stopped


def test_read_ahead_changes_no_bit_and_is_used(model_dir):
    """A ring smaller than the vault reads the next layer's likely experts while a layer computes: the
    tokens are those of a ring that holds everything, and the slot table still names only checked records."""
    rec = record_bytes(model_dir)
    prompt = [5, 9, 5, 9, 5, 9, 5, 9]
    want = list(Engine.open(model_dir, ram_budget=1 << 30, max_seq=64).generate_ids(prompt, max_new_tokens=24))
    engine = Engine.open(model_dir, ram_budget=6 * rec, max_seq=64)
    for _ in range(3):  # the same tokens again: the policy has learned what they route to
        assert list(engine.generate_ids(prompt, max_new_tokens=24)) == want
    store = engine.store
    assert store.io.ahead_reads > 0 and store.io.ahead_used > 0
    assert store.io.preload_bytes == 0  # background reads all the same, but the layers' reads, not preload's
    store._reap_ahead()
    held = {key: slot for key, slot in store.policy.where.items() if slot not in store._reading}
    table = {(int(l), int(e)): int(store.slot_table[l, e]) for l, e in zip(*(store.slot_table >= 0).nonzero())}
    assert table == held


def test_records_a_layer_just_read_can_be_given_back(model_dir):
    """Memory pressure between layers: the records the last layer read are unpinned, so shrink takes them."""
    engine = Engine.open(model_dir, ram_budget=4 * record_bytes(model_dir), max_seq=64, preload=False,
                         watch_memory=False)
    store = engine.store
    n = store.policy.usable
    store.release(store.acquire(1, list(range(n))))
    store.release(store.acquire(0, list(range(n))))  # the whole ring again, each record evicting one
    assert store.shrink(2) == 2 and store.policy.usable == n - 2


def test_reads_ahead_still_in_flight_do_not_starve_a_layer(model_dir, monkeypatch):
    """Every slot pinned or reading ahead when a layer misses: it waits for the reads ahead and takes one
    of their slots, instead of failing with the ring 'all in use' (and leaves nothing pinned if it fails)."""
    engine = Engine.open(model_dir, ram_budget=4 * record_bytes(model_dir), max_seq=64, preload=False,
                         watch_memory=False)
    store = engine.store
    n = store.policy.usable
    store.begin_step(5)
    store.routed(0, [0, 1])
    held = store.acquire(0, [0, 1])
    assert store.read_ahead(0, held) == 2  # two free slots: layer 1's likeliest records go there
    reap, calls = store._reap_ahead, []
    # the reads ahead stay unaccounted (as if in flight) through the next two acquires' first look
    monkeypatch.setattr(store, "_reap_ahead", lambda: calls.append(1) if len(calls) < 2 else reap())
    held += store.acquire(3, list(range(n - 4)))  # the rest of the ring, pinned
    extra = store.acquire(3, [7])  # a miss: it waits for the reads ahead and takes one of their slots
    assert extra[0] not in held
    store.release(held + extra)
    assert not store._pinned and not store._reading


def test_the_native_loops_scratch_is_one_tokens_whatever_came_before(model_dir, monkeypatch):
    """The native decode loop gets scratch of its own sized for one token: a copy of the executor's, which a
    prompt grows, cost the first decode step a prompt's worth of memory and time."""
    from mosaic_runtime import _native
    sizes, real = [], _native.decode.LoopExperts

    def noting_its_scratch(**kwargs):
        sizes.append(kwargs["scratch"].size)
        return real(**kwargs)

    monkeypatch.setattr(_native.decode, "LoopExperts", noting_its_scratch)
    with Engine.open(model_dir, ram_budget=1 << 30, max_seq=256, watch_memory=False) as engine:
        engine.finish_preload()
        experts = engine.model.experts
        list(engine.generate_ids(PROMPT * 16, max_new_tokens=4))  # a prompt of 128 tokens, then decode steps
        one_token = experts._k.scratch_floats(experts.format, engine.arch["num_experts_per_tok"], 1, experts.threads)
        assert experts._scratch.size > one_token  # the prompt grew the executor's
    assert sizes == [one_token]


def test_a_ring_holding_every_record_learns_later_what_it_would_have_learnt_each_step(model_dir):
    """While the ring holds the whole vault the policy's bookkeeping waits (nothing can be evicted); when
    memory pressure takes slots back, it learns the waiting steps first and gives back the records it would
    have, and the hits were counted as the steps ran."""
    import numpy as np
    engines = [Engine.open(model_dir, ram_budget=1 << 30, max_seq=64, watch_memory=False) for _ in range(2)]
    stepwise = engines[1].store
    stepwise._holds_every_record = lambda: False  # the reference: learning step by step
    for engine in engines:
        engine.finish_preload()
        run(engine)
    deferred = engines[0].store
    assert len(deferred._deferred) > 0 and not stepwise._deferred
    hits = [{k: c.hits for k, c in e.store.policy.counters.items()} for e in engines]
    assert hits[0] == hits[1] and sum(hits[0].values()) > 0
    victims = []
    for store in (deferred, stepwise):
        where = dict(store.policy.where)
        assert store.shrink(3) == 3
        victims.append(sorted(set(where) - set(store.policy.where)))
    assert victims[0] == victims[1] and not deferred._deferred
    for name in ("_value", "_co", "_seen", "_reuse"):
        assert np.array_equal(getattr(deferred.policy, name), getattr(stepwise.policy, name)), name
    for engine in engines:
        engine.close()


def test_a_record_read_ahead_counts_as_used_when_the_native_loop_runs_it(model_dir, monkeypatch):
    """The native layer loop runs resident records without acquire: one read ahead is used all the same.
    Reads ahead go in the ring's background queue, behind the layer's own reads."""
    engine = Engine.open(model_dir, ram_budget=4 * record_bytes(model_dir), max_seq=64, preload=False,
                         watch_memory=False)
    store = engine.store
    store.begin_step(5)
    store.routed(0, [0, 1])
    held = store.acquire(0, [0, 1])
    submit, queued = store.ring.submit, []

    def submit_noting_the_queue(slot, offset, length, crc32, background=False, widen=0):
        queued.append(background)
        submit(slot, offset, length, crc32, background, widen)

    monkeypatch.setattr(store.ring, "submit", submit_noting_the_queue)
    assert store.read_ahead(0, held) == 2
    assert queued == [True, True]
    store.release(held)
    ahead = sorted(e for (layer, e), slot in store.policy.where.items() if layer == 1)
    for slot in list(store._reading):
        store.ring.wait(slot)
    store._reap_ahead()  # landed: in the slot table, as the native loop would find them
    store.used(1, ahead)  # what ran_natively says of the layer
    assert store.io.ahead_used == 2 and not store._ahead


class RoutingRecorder:
    """An expert executor that notes each MoE layer's input and routing on the way through."""

    def __init__(self, inner):
        self.inner, self.x, self.ids = inner, {}, {}

    def __call__(self, layer, x, topk_weights, topk_ids):
        self.x[layer], self.ids[layer] = x.clone(), topk_ids.clone()
        return self.inner(layer, x, topk_weights, topk_ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_router_lookahead_names_what_the_next_router_would(model_dir):
    """The lookahead applies the next MoE layer's router (past the dense layer between) to this layer's FFN
    input re-normed with the next layer's norm weight: given the next layer's own input as this layer's
    norm weight would have scaled it, it names exactly the experts that layer routed to, best first."""
    from mosaic_runtime.models.lookahead import RouterLookahead
    engine = Engine.open(model_dir, max_seq=64)
    recorder = engine.model.experts = RoutingRecorder(engine.model.experts)
    engine.logits(PROMPT)
    layers = engine.model.weights.layers
    assert sorted(recorder.ids) == [0, 1, 3]
    # layer 1's norm weight: layer 3's times powers of two, so that re-norming is exact
    scale = 2.0 ** torch.randint(-2, 3, layers[3].post_norm.shape, generator=torch.Generator().manual_seed(0))
    layers[1].post_norm = layers[3].post_norm.float() * scale
    lookahead = RouterLookahead(engine.model)
    x = recorder.x[3] * scale  # layer 3's input under layer 1's norm weight
    assert torch.equal(lookahead.guesses(1, x), recorder.ids[3])
    assert lookahead.guess(1, x[0].numpy()) == recorder.ids[3][0].tolist()
    assert lookahead.guess(3, recorder.x[3][0].numpy()) is None  # the last MoE layer guesses nothing


def test_the_decode_step_reads_ahead_the_router_lookaheads_guess(model_dir, monkeypatch):
    """With router_lookahead, a MoE layer the native step hands back (its records not all held) reads the
    next MoE layer ahead with the router lookahead's guess, made from its FFN input; the next layer's
    routing then scores it. Without it (the default), the read-ahead has no guess."""
    rec = record_bytes(model_dir)
    plain = Engine.open(model_dir, ram_budget=4 * rec, max_seq=64)
    given = []
    plan = plain.store.policy.plan_ahead
    monkeypatch.setattr(plain.store.policy, "plan_ahead",
                        lambda layer, excluded, g=None: given.append(g) or plan(layer, excluded, g))
    run(plain)
    assert plain.model.native.lookahead is None and given and given == [None] * len(given)

    engine = Engine.open(model_dir, ram_budget=4 * rec, max_seq=64, router_lookahead=True)
    policy, lookahead = engine.store.policy, engine.model.native.lookahead
    made, given = [], []
    guess, plan = lookahead.guess, policy.plan_ahead
    monkeypatch.setattr(lookahead, "guess", lambda layer, h: made.append((layer, guess(layer, h))) or made[-1][1])
    monkeypatch.setattr(policy, "plan_ahead",
                        lambda layer, excluded, g=None: given.append((layer, g)) or plan(layer, excluded, g))
    run(engine)
    assert made and given == [({0: 1, 1: 3}[layer], g) for layer, g in made]
    assert all(g is not None and len(g) == 2 for _, g in made)
    assert policy._checked[[1, 2]].sum() == len(made)  # every guess scored by the routing it guessed


def test_a_backbone_that_does_not_fit_says_what_would():
    """With no RAM budget, a backbone (bf16, as exact precision holds it) larger than what the process may
    take is refused with the way out, not with a negative ring budget."""
    from types import SimpleNamespace

    from mosaic_runtime.engine import ring_slots
    from mosaic_runtime.limits import MemoryLimit
    vault = SimpleNamespace(header=SimpleNamespace(record_bytes=24 << 20, num_records=14_848),
                            arch={"num_experts_per_tok": 8})
    limit = MemoryLimit(available=30 << 30, bound="MemAvailable")
    with pytest.raises(ValueError, match=r"backbone and the sequence state take 32\.00 GiB.*backbone='int8' or 'q4'"):
        ring_slots(vault, None, 32 << 30, limit)
    assert ring_slots(vault, None, 11 << 30, limit) > 8  # the q4 backbone leaves a ring


@pytest.mark.parametrize("user, spins", [({}, "10000"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),
                                         ({"GOMP_SPINCOUNT": "500"}, "500")])
def test_openmp_threads_spin_briefly_unless_the_user_chose(user, spins):
    """Importing mosaic_runtime before torch sets how long libgomp's idle threads spin (its own report,
    OMP_DISPLAY_ENV, read when torch loads it); a policy or spin count the user set is kept as is."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(user, OMP_DISPLAY_ENV="VERBOSE")
    out = subprocess.run([sys.executable, "-c", "import mosaic_runtime, torch; torch.zeros(1)"], env=env,
                         capture_output=True, text=True, check=True)
    assert re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr).group(1) == spins
