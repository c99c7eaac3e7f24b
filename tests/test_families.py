"""One runner every family passes through (the table is tests/families.py): each case converted to Q4 and
FP8 from each expert layout transformers writes, its logits held against transformers' own model loaded
with the vault's backbone and dequantised experts (so the only difference left is Mosaic's code), its
greedy tokens checked, its decode steps checked to have taken the native step, native decode held against
the torch path, and the family's real-scale skeleton probed against TENSORS.md.

The reference is one full forward over the prompt and the generated tokens: transformers' own cached
decode (generate) diverges from its full forward on the hybrids with its torch fallbacks."""

from __future__ import annotations

import shutil

import pytest
import torch

from builders import skeleton
from families import ATTENTION_ATOL, CASES, SKELETONS, Case
from mosaic_runtime import routing
from mosaic_runtime.engine import Engine
from mosaic_runtime.kv_cache import WINDOW_SLACK
from mosaic_runtime.models import decoder as decoder_module
from mosaic_runtime.models.state import SequenceState
from mosaic_runtime.recipe import read_recipe
from mosaic_runtime.vault.format import QUANT_NAMES, record_layout
from mosaic_runtime.vault.record import unpack_record
from mosaic_shatter.checkpoint import Checkpoint
from mosaic_shatter.cli import probe_report
from mosaic_shatter.convert import ConvertError, convert
from mosaic_shatter.plan import make_plan
from reference import StepSpy, reference_model

transformers = pytest.importorskip("transformers")

PROMPT = [(37 * i + 11) % 320 for i in range(70)]  # past a 64-token delta-rule chunk and a 24-token window
DECODE_STEPS = 12
MIN_ROUTING_MARGIN = 1e-6  # below it, float rounding could pick another expert: the case needs another seed
RUNS = [(case, quant, layout) for case, c in sorted(CASES.items()) for layout in c.layouts for quant in c.quants]


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    ckpts, out = {}, {}

    def get(case: str, quant: str, layout: str):
        if (case, layout) not in ckpts:
            ckpts[(case, layout)] = CASES[case].build(root / f"{case}-{layout}", layout)
        if (case, quant, layout) not in out:
            ckpt = ckpts[(case, layout)]
            out[(case, quant, layout)] = ckpt, convert(str(ckpt), root / f"{case}-{layout}-{quant}", quant,
                                                       progress=False).out
        return out[(case, quant, layout)]
    return get


def routing_margin(engine: Engine, ids: list[int]) -> float:
    """The smallest gap between the k-th chosen and the best unchosen expert score over a torch forward."""
    margins = []

    def spy(logits, router, bias=None):
        _, choice = routing.choice_scores(logits, router, bias)
        top = choice.topk(router.top_k + 1, dim=-1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))
        return routing.route(logits, router, bias)
    real, decoder_module.route = decoder_module.route, spy
    try:
        engine.logits(ids)
    finally:
        decoder_module.route = real
    return min(margins)


@pytest.mark.parametrize("case, quant, layout", RUNS)
def test_matches_transformers(vaults, case, quant, layout):
    ckpt, out = vaults(case, quant, layout)
    engine = Engine.open(out, max_seq=128, precision="exact")
    engine.finish_preload()  # every record held: every decode step must run natively, experts included
    spy = engine.model.native.step_fn = StepSpy(engine.model.native.step_fn, len(engine.model.layers))
    logits = [engine.logits(PROMPT)]
    tokens = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(engine.model.forward(torch.tensor([tokens[-1]]), engine.model.state.length))
    assert spy.calls == DECODE_STEPS and spy.ran == list(range(len(engine.model.layers))) * DECODE_STEPS
    ref = reference_model(ckpt, engine)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT + tokens])).logits[0]  # one full forward over prompt and answer
    atol = CASES[case].atol
    assert routing_margin(engine, PROMPT + tokens) > MIN_ROUTING_MARGIN, "a routing near-tie: use another seed"
    assert (logits[0] - want[:len(PROMPT)]).abs().max() <= atol
    assert tokens == want[len(PROMPT) - 1:-1].argmax(-1).tolist()  # greedy: each token the argmax before it
    for step in range(1, DECODE_STEPS):
        assert (logits[step][-1] - want[len(PROMPT) - 1 + step]).abs().max() <= atol, step
    assert len(set(logits[0].argmax(-1).tolist())) > 2  # not a comparison of two constant outputs


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_decode_equals_the_torch_path(vaults, case):
    """The native step against the torch reference it replaces, over a float32 and an int8 KV cache."""
    _, out = vaults(case, "q4", CASES[case].layouts[0])
    runs = {}
    for kv_dtype in ("float32", "int8"):
        engine = Engine.open(out, max_seq=128, precision="exact", kv_dtype=kv_dtype)
        for native in (True, False):
            engine.model.use_native_decode = native
            logits = [engine.logits(PROMPT)[-1]]
            for _ in range(DECODE_STEPS):
                logits.append(engine.model.forward(torch.tensor([int(logits[-1].argmax())]),
                                                   engine.model.state.length)[-1])
            runs[(kv_dtype, native)] = torch.stack(logits)
    # float32: the same arithmetic in another order (up to 1.3e-4 on the Qwen3.5 case where torch's MKL
    # takes its AVX-512 paths, as on a Sapphire Rapids; 1.4e-5 with it held to AVX2); int8: the native
    # step's integer attention rounds the queries and probabilities to 16 bits under VNNI, and a row landing
    # on another code flips a step
    for kv_dtype, atol in (("float32", 3e-4), ("int8", 2e-3)):
        native, reference = runs[(kv_dtype, True)], runs[(kv_dtype, False)]
        assert torch.equal(native.argmax(-1), reference.argmax(-1))
        torch.testing.assert_close(native, reference, atol=atol, rtol=0)


@pytest.mark.parametrize("case", ["qwen2_moe", "deepseek_v2-lite"])
def test_a_ring_too_small_gives_the_same_bits_with_shared_experts(vaults, case):
    """A ring of one layer's top-k reads every layer's experts while the layer's shared expert runs
    (add_decode's `shared`); a ring of the whole vault runs both in the native layer loop. The residual
    stream takes the shared expert first either way, so the logits are the same bits."""
    _, out = vaults(case, "q4", CASES[case].layouts[0])
    full = Engine.open(out, max_seq=128)
    full.finish_preload()
    top_k = int(full.vault.arch["num_experts_per_tok"])
    tiny = Engine.open(out, max_seq=128, ram_budget=top_k * full.vault.header.record_bytes)
    assert tiny.store.ring.n_slots == top_k
    shared_calls = []
    real_add = tiny.model.experts.add_decode

    def add_decode(layer, h, w, ids, x, shared=None, guess=None):
        shared_calls.append(shared is not None)
        real_add(layer, h, w, ids, x, shared, guess)
    tiny.model.experts.add_decode = add_decode
    runs = []
    for engine in (tiny, full):
        logits = [engine.logits(PROMPT)[-1]]
        for _ in range(DECODE_STEPS):
            logits.append(engine.model.forward(torch.tensor([int(logits[-1].argmax())]),
                                               engine.model.state.length)[-1])
        runs.append(torch.stack(logits))
    assert shared_calls and all(shared_calls)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("family", sorted(SKELETONS))
def test_probe_of_the_real_scale_skeleton(tmp_path, family, monkeypatch):
    want = SKELETONS[family]
    monkeypatch.setattr(Checkpoint, "read", lambda *a, **k: pytest.fail("probe read a weight"))
    ckpt = Checkpoint(str(skeleton(want.config, tmp_path / family)))
    assert len(ckpt.tensors) == want.tensors
    plan = make_plan(ckpt)
    report = probe_report(ckpt, plan)
    assert report["problems"] == [] and report["model_type"] == family
    assert report["num_records"] * report["record_bytes"]["q4"] == want.q4  # records fill whole pages
    assert 0 < report["vault_bytes"]["q4"] - want.q4 < 1 << 20
    # TENSORS.md's backbone counts an MTP layer's tensors but its experts, as bf16 (F32 at 4 B); probe leaves
    # the whole layer out
    mtp = [t for name, t in ckpt.tensors.items()
           if name in plan.dropped and ".experts." not in name and not name.endswith("_scale_inv")]
    assert report["backbone_bytes"] == want.backbone - sum(t.numel * (4 if t.dtype == "F32" else 2) for t in mtp)
    assert set(plan.dropped.values()) <= {"mtp"}
    recipe = read_recipe(plan.arch)  # the runtime reads every key the converter wrote
    held = report["resident_bytes"]
    assert held["bf16"] == report["backbone_bytes"] and held["q4"] < held["int8"] == held["fp8"] < held["bf16"]
    # what a token leaves in the KV cache: a latent row a layer for latent attention, else keys and values
    mla = plan.arch.get("latent_attention")
    per_token = (mla["kv_lora_rank"] + mla["qk_rope_head_dim"] if mla else
                 2 * plan.arch["num_key_value_heads"] * plan.arch["head_dim"]) * len(recipe.attention_layers)
    assert report["kv_bytes_per_1k_tokens"]["bfloat16"] == 2 * 1024 * per_token


# gpt-oss releases: tensors; MXFP4 and Q4 g32 expert weight bytes (bias planes aside); the bf16 backbone
# less the expert biases, which the records hold. 20b: TENSORS.md (its "Original MXFP4 expert payload", its
# Q4 g32 vault, its backbone less 24 x 32 x (5760 + 2880) bf16 biases); 120b: computed from its config.
GPT_OSS_SKELETONS = {
    "gpt-oss-20b": ("gpt-oss-20b.config.json", 459, 10_152_345_600, 10_749_542_400, 3_608_919_168 - 13_271_040),
    "gpt-oss-120b": ("gpt-oss-120b.config.json", 687, 60_914_073_600, 64_497_254_400, 4_255_115_904),
}


@pytest.mark.parametrize("release", sorted(GPT_OSS_SKELETONS))
def test_probe_of_the_gpt_oss_skeletons(tmp_path, release, monkeypatch):
    config, tensors, mxfp4, q4, backbone = GPT_OSS_SKELETONS[release]
    monkeypatch.setattr(Checkpoint, "read", lambda *a, **k: pytest.fail("probe read a weight"))
    ckpt = Checkpoint(str(skeleton(config, tmp_path / release)))
    assert len(ckpt.tensors) == tensors
    plan = make_plan(ckpt)
    report = probe_report(ckpt, plan)
    assert report["problems"] == [] and report["model_type"] == "gpt_oss" and plan.expert_bias
    assert plan.source_format["expert_dtype"] == "MXFP4" and plan.passthrough(QUANT_NAMES["mxfp4"])
    n, hidden, inter = report["num_records"], plan.hidden, plan.intermediate
    for quant, weights in (("mxfp4", mxfp4), ("q4", q4)):
        layout = record_layout(QUANT_NAMES[quant], plan.scale_dtype(QUANT_NAMES[quant]), hidden, inter, bias=True)
        assert n * sum(p.nbytes for p in layout.planes if p.kind != "bias") == weights
        assert sum(p.nbytes for p in layout.planes if p.kind == "bias") == 4 * (2 * inter + hidden)
        assert report["record_bytes"][quant] == layout.record_bytes
        assert 0 < report["vault_bytes"][quant] - n * layout.record_bytes < 1 << 20
    assert report["backbone_bytes"] == backbone
    recipe = read_recipe(plan.arch)
    assert [layer.mixer.sliding_window for layer in recipe.layers[:2]] == [128, None]
    # a token grows the cache in the full-attention half of the layers; the windowed half is a fixed ring
    layers = plan.arch["num_hidden_layers"]
    assert report["kv_bytes_per_1k_tokens"]["bfloat16"] == 2 * 1024 * (layers // 2) * 2 * 8 * 64
    assert report["kv_window_bytes"]["bfloat16"] == 2 * (layers // 2) * 2 * (128 + WINDOW_SLACK) * 8 * 64 * 2


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c].model_type.startswith("deepseek")))
def test_latent_cache_holds_one_latent_row_a_token(vaults, case):
    """Latent attention caches kv_lora_rank + qk_rope_head_dim values a token a layer, one row that is key
    and value, and the engine sized the ring for exactly what it allocated."""
    from mosaic_runtime.models.state import SequenceState
    _, out = vaults(case, "q4", CASES[case].layouts[0])
    engine = Engine.open(out, max_seq=300, precision="exact", kv_dtype="bfloat16")
    kv, cfg = engine.model.state.kv, CASES[case].config
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert kv.v is kv.k and kv.k.shape == (len(engine.model.layers), 1, 2, 256, latent)
    assert kv.page_bytes == len(engine.model.layers) * 256 * latent * 2
    assert SequenceState.bytes_for(engine.model.recipe, 300, torch.bfloat16) == kv.k.numel() * 2


@pytest.mark.parametrize("quant", ["fp8", "q4"])
def test_deepseek_v3_block_fp8_release(tmp_path, quant):
    """DeepSeek-V3's release layout: every Linear but the router in E4M3 with F32 128 x 128 scales (latent
    attention's included). Experts pass through to an FP8 vault bit for bit (or re-encode to Q4), the
    backbone's FP8 tensors are dequantised once, and the model matches transformers on those weights."""
    from builders import to_block_fp8
    bf16 = CASES["deepseek_v3"].build(tmp_path / "bf16", "per-expert")
    src = to_block_fp8(bf16, tmp_path / "fp8-src", scale_dtype=torch.float32)
    out = convert(str(src), tmp_path / quant, quant, progress=False).out
    engine = Engine.open(out, max_seq=128, precision="exact")
    assert engine.vault.lineage["quant"].get("passthrough", False) is (quant == "fp8")
    ref = reference_model(bf16, engine)  # transformers' model of the same network, holding the vault's weights
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    assert (engine.logits(PROMPT) - want).abs().max() <= ATTENTION_ATOL


@pytest.fixture(scope="module")
def int4_release(tmp_path_factory):
    """A tiny DeepSeek-V3 network laid out as Kimi-K2-Thinking's release: int4 routed experts."""
    from builders import to_int4_pack
    root = tmp_path_factory.mktemp("int4")
    case = CASES["deepseek_v3"]  # its expert width a whole number of int4 groups
    bf16 = Case(case.model_type, dict(case.config, moe_intermediate_size=64)).build(root / "bf16", "per-expert")
    return bf16, to_int4_pack(bf16, root / "int4")


def test_int4_backbone_tensors_are_dequantised_once(int4_release, tmp_path):
    """A pack-quantized checkpoint that packs more than the routed experts (here the shared experts too):
    those tensors reach the bf16 backbone as their int4 values, under their `.weight` names."""
    from builders import to_int4_pack
    from safetensors import safe_open
    from safetensors.torch import load_file

    from mosaic_shatter import int4_source
    from mosaic_runtime.vault.format import BACKBONE_FILE
    bf16, _ = int4_release
    src = to_int4_pack(bf16, tmp_path / "src", packed=r"\.mlp\.(shared_)?experts\.(\d+\.)?(gate|up|down)_proj\.weight$")
    out = convert(str(src), tmp_path / "q4", "q4", progress=False).out
    backbone = load_file(out / BACKBONE_FILE)
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        want = int4_source.dequantize(f.get_tensor(name + "_packed"), f.get_tensor(name + "_scale"))
    assert name + "_packed" not in backbone and torch.equal(backbone[name], want.to(torch.bfloat16))
    Engine.open(out, max_seq=64).logits(PROMPT[:8])  # and it runs


def test_int4_experts_reach_a_q4_vault_as_they_are(int4_release, tmp_path):
    """compressed-tensors' int4 codes are the Q4 vault's codes, moved to its nibble order, and their bf16
    scales its f16 scales: every dequantised expert equals the checkpoint's int4 weights exactly (held to
    compressed-tensors' own unpacking), with no trip through bf16."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open
    _, src = int4_release
    out = convert(str(src), tmp_path / "q4", "q4", progress=False).out
    engine = Engine.open(out, max_seq=64, precision="exact")
    assert engine.vault.lineage["quant"]["passthrough"] is True
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for layer in engine.vault.moe_layers:
            for e in range(engine.arch["num_experts"]):
                got = dict(zip(("gate", "up", "down"), engine.vault.dequantize_expert(layer, e)))
                for proj, w in got.items():
                    base = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
                    packed, scale = f.get_tensor(base + "_packed"), f.get_tensor(base + "_scale")
                    q = unpack_from_int32(packed, 4, torch.Size(w.shape)).float()
                    want = (q.view(w.shape[0], -1, 32) * scale.float()[..., None]).reshape(w.shape)
                    assert torch.equal(w, want), (layer, e, proj)


def test_mxfp4_experts_reach_an_mxfp4_vault_bit_for_bit(vaults):
    """gpt-oss's MXFP4 release into an MXFP4 vault: each record's codes and scales are the checkpoint's rows
    (gate the even rows of gate_up, up the odd ones) byte for byte, its biases the checkpoint's, and every
    dequantised expert equals transformers' own dequantisation of the release exactly."""
    from safetensors import safe_open
    transformers = pytest.importorskip("transformers")
    ckpt, out = vaults("gpt_oss", "mxfp4", "mxfp4")
    engine = Engine.open(out, max_seq=64, precision="exact")
    vault = engine.vault
    assert vault.lineage["quant"]["passthrough"] is True and vault.layout.bias
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for layer in vault.moe_layers:
            p = f"model.layers.{layer}.mlp.experts."
            blocks = {n: f.get_tensor(f"{p}{n}_proj_blocks") for n in ("gate_up", "down")}
            scales = {n: f.get_tensor(f"{p}{n}_proj_scales") for n in ("gate_up", "down")}
            biases = {n: f.get_tensor(f"{p}{n}_proj_bias") for n in ("gate_up", "down")}
            experts = ref.model.layers[layer].mlp.experts
            for e in range(engine.arch["num_experts"]):
                planes = unpack_record(vault.layout, vault.read_record(layer, e))
                rows = {"gate": ("gate_up", slice(0, None, 2)), "up": ("gate_up", slice(1, None, 2)),
                        "down": ("down", slice(None))}
                got_biases = vault.expert_biases(layer, e)
                for proj, (name, r) in rows.items():
                    codes, sc = planes[proj]
                    assert torch.equal(codes, blocks[name][e][r].reshape(codes.shape)), (layer, e, proj)
                    assert torch.equal(sc, scales[name][e][r]), (layer, e, proj)
                    assert torch.equal(got_biases[proj], biases[name][e][r].float())
                gate, up, down = vault.dequantize_expert(layer, e)
                assert torch.equal(gate.T, experts.gate_up_proj[e][:, 0::2].float())
                assert torch.equal(up.T, experts.gate_up_proj[e][:, 1::2].float())
                assert torch.equal(down.T, experts.down_proj[e].float())


def test_sliding_window_layers_keep_only_their_window(vaults):
    """With max_seq past twice its window ring, gpt-oss's sliding layers keep their keys and values in a
    bounded ring: the KV cache holds its one full-attention layer, the ring its two sliding layers at
    2 x (24 + WINDOW_SLACK) rows whatever max_seq. A sequence that wraps the ring twice still gives
    transformers' logits, its prefill in ring-sized steps and its decode steps native; the sequence can be
    cut back by the slack, no further."""
    ckpt, out = vaults("gpt_oss", "q4", "mxfp4")
    rows = 24 + WINDOW_SLACK
    n, decode = 2 * rows + 100, 6
    ids = [(37 * i + 11) % 320 for i in range(n)]
    engine = Engine.open(out, max_seq=n + 64, precision="exact")
    state = engine.model.state
    assert state.windowed == [0, 2] and state.kv.k.shape[0] == 1 and tuple(state.window.k.shape[:3]) == (2, 2, 2 * rows)
    held = sum(t.numel() * t.element_size() for c in (state.kv, state.window) for t in (c.k, c.v))
    assert SequenceState.bytes_for(engine.model.recipe, n + 64, torch.float32) == held
    engine.finish_preload()
    spy = engine.model.native.step_fn = StepSpy(engine.model.native.step_fn, len(engine.model.layers))
    logits = engine.logits(ids[:n - decode])[-40:]
    steps = [engine.model.forward(torch.tensor([t]), state.length)[-1] for t in ids[n - decode:]]
    assert spy.calls == decode
    with torch.no_grad():
        want = reference_model(ckpt, engine)(torch.tensor([ids])).logits[0]
    assert (logits - want[n - decode - 40:n - decode]).abs().max() <= ATTENTION_ATOL
    assert (torch.stack(steps) - want[n - decode:]).abs().max() <= ATTENTION_ATOL
    assert state.resumable(state.length - WINDOW_SLACK - 1) and not state.resumable(state.length - WINDOW_SLACK - 2)
    with pytest.raises(ValueError, match="continues from its state"):
        engine.model.forward(torch.tensor([1]), state.length - WINDOW_SLACK - 2)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_a_prefill_for_its_last_logits_computes_the_head_once(vaults, case, monkeypatch):
    """forward(last_only=True), what a prefill before sampling asks, gives the full pass's last row and runs
    the head on one row, not the prompt's; gpt-oss's prompt is past its window ring, so it goes through the
    ring-sized steps."""
    _, out = vaults(case, "q4", CASES[case].layouts[0])
    n = 2 * (24 + WINDOW_SLACK) + 40 if case == "gpt_oss" else 150
    model = Engine.open(out, max_seq=n + 8, precision="exact").model
    ids = torch.tensor([(37 * i + 11) % 320 for i in range(n)])
    full = model.forward(ids, 0)
    import mosaic_runtime.models.decoder as decoder
    head_rows, lm_head, real_linear = [], model.weights.lm_head, decoder.linear
    monkeypatch.setattr(decoder, "linear",
                        lambda x, w, *a: (head_rows.append(x.shape[0]) if w is lm_head else None) or real_linear(x, w, *a))
    last = model.forward(ids, 0, last_only=True)
    assert last.shape == (1, full.shape[1]) and torch.equal(last[0], full[-1])
    assert head_rows == ([1] if case != "gpt_oss" else [1, 1, 1])  # one row a ring-sized step


def test_an_mxfp4_scale_of_nan_is_refused_by_expert(vaults, tmp_path):
    """E8M0 255 is NaN: a release holding one converts to no vault, and the error names the expert."""
    from safetensors.torch import load_file, save_file
    ckpt, _ = vaults("gpt_oss", "mxfp4", "mxfp4")
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_scales"][2, 5, 0] = 255
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="layer 1 expert 2: an E8M0 scale is 255"):
        convert(str(bad), tmp_path / "out", "mxfp4", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant", ["q4", "fp8"])
def test_int4_release_matches_transformers(int4_release, tmp_path, quant):
    """The int4 release converted (Q4 as it is, FP8 re-encoded) runs as transformers' model of the same
    network holding the vault's weights."""
    bf16, src = int4_release
    out = convert(str(src), tmp_path / quant, quant, progress=False).out
    engine = Engine.open(out, max_seq=128, precision="exact")
    ref = reference_model(bf16, engine)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    assert (engine.logits(PROMPT) - want).abs().max() <= ATTENTION_ATOL


@pytest.mark.parametrize("change, message", [
    (dict(group_size=128), "groups of 32"),
    (dict(num_bits=8), "only int4"),
    (dict(symmetric=False), "symmetric"),
])
def test_other_int4_schemes_are_refused_by_name(int4_release, tmp_path, change, message):
    import json
    import shutil
    _, src = int4_release
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (copy / "config.json").write_text(json.dumps(cfg))
    problems = make_plan(Checkpoint(str(copy))).problems
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("backbone", ["int8", "q4"])
def test_latent_attention_under_a_quantised_backbone(vaults, backbone):
    """kv_b_proj's halves are quantised with the backbone (never held as bf16 beside them), the native step
    runs them, and it stays with the torch path (which dequantises them) and near the exact model."""
    from mosaic_runtime.backbone import Q4Matrix, QuantizedMatrix, quantize_matrix
    _, out = vaults("deepseek_v3", "q4", "per-expert")
    engine = Engine.open(out, max_seq=128, backbone=backbone)
    w = engine.model.layers[1].mixer
    assert isinstance(w.uk_t, Q4Matrix if backbone == "q4" else QuantizedMatrix) and type(w.uv) is type(w.uk_t)
    runs = {}
    for native in (True, False):
        engine.model.use_native_decode = native
        logits = [engine.logits(PROMPT)[-1]]
        for token in PROMPT[:DECODE_STEPS]:
            logits.append(engine.model.forward(torch.tensor([token]), engine.model.state.length)[-1])
        runs[native] = torch.stack(logits)
    # the native step runs Q4 against int8 activations, the torch path dequantised weights: both lossy, and
    # a step whose routing that flips moves further
    step_error = (runs[True] - runs[False]).abs().amax(-1) / runs[False].abs().amax(-1)
    assert step_error.median() < 0.05
    exact_engine = Engine.open(out, max_seq=128, precision="exact")
    for half in ("uk_t", "uv"):  # the bf16 halves, quantised once
        want = quantize_matrix(getattr(exact_engine.model.layers[1].mixer, half), backbone)
        assert torch.equal(getattr(w, half).codes, want.codes) and torch.equal(getattr(w, half).scales, want.scales)
    # int8 stays near the exact model token by token (a token whose routing the rounding flips moves
    # further); q4 on 64-wide random matrices moves every model here 20-36 %, latent or not
    if backbone == "int8":
        exact, quant = exact_engine.logits(PROMPT), Engine.open(out, max_seq=128, precision="exact",
                                                                backbone=backbone).logits(PROMPT)
        assert ((quant - exact).abs().amax(-1) / exact.abs().amax(-1)).median() < 0.1
