// nanobind glue for the native decode step (native/include/mosaic/decode.h): typed objects built once per
// model from the backbone's arrays (each keeps the arrays it points into alive), and the per-token call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <string>
#include <vector>

#include "mosaic/decode.h"
#include "mosaic/expert_ring.h"

namespace nb = nanobind;
using namespace mosaic;

namespace {

using Vector = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OutVector = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using AnyMatrix = nb::ndarray<nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using AnyArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

void check(bool ok, const std::string& what) {
  if (!ok) throw nb::value_error(what.c_str());
}

// Everything a native object points into, kept alive with it.
struct Keep {
  std::vector<nb::object> objects;
  void hold(nb::handle h) { objects.push_back(nb::borrow(h)); }
};

struct PyMatrix : Keep {
  BackboneMatrix m;
};

struct PyAttention : Keep {
  AttentionMixer a;
};

struct PyLatent : Keep {
  LatentMixer m;
};

struct PyDeltaNet : Keep {
  DeltaNetMixer d;
};

struct PyRouter : Keep {
  Router r;
};

struct PyLayer : Keep {
  DecodeLayer L;
};

struct PyHead : Keep {
  DecodeHead head{};
};

struct PyLoopExperts : Keep {
  LoopExperts e{};
  int layers = 0, top_k = 0, n_slots = 0;
};

// The layers of one model and its head, held contiguously for the per-token call.
struct PyDecodeStep : Keep {
  std::vector<DecodeLayer> layers;
  const DecodeHead* head = nullptr;
  int top_k = 1, n_attention = 0, n_windowed = 0, kv_heads = 0, head_dim = 0, hidden = 0;
  uint64_t scratch_floats = 0;
};

using KvArray = nb::ndarray<nb::ndim<4>, nb::device::cpu>;
using ScaleArray = nb::ndarray<float, nb::ndim<3>, nb::device::cpu>;

// One KV run [layers, kv_heads, rows >= min_rows, head_dim] of float32, bf16 (as uint16) or int8 codes with
// their row scales [layers, kv_heads, rows], checked against the step's geometry.
KvRun kv_run_of(nb::handle k_run, nb::handle v_run, nb::handle k_scale, nb::handle v_scale, const PyDecodeStep& s,
                int layers, int64_t min_rows, const std::string& what) {
  KvRun kv;
  check(!k_run.is_none() && !v_run.is_none(), what + ": K and V runs");
  KvArray k = nb::cast<KvArray>(k_run), v = nb::cast<KvArray>(v_run);
  check(k.dtype() == v.dtype(), what + ": K and V of one dtype");
  if (k.dtype() == nb::dtype<uint16_t>()) kv.dtype = KvDtype::Bf16;
  else if (k.dtype() == nb::dtype<int8_t>()) kv.dtype = KvDtype::I8;
  else check(k.dtype() == nb::dtype<float>(), what + ": a KV cache of float32, bf16 (as uint16) or int8");
  const size_t d = static_cast<size_t>(s.head_dim);
  check(k.shape(0) == static_cast<size_t>(layers) && v.shape(0) == k.shape(0) &&
            k.shape(1) == static_cast<size_t>(s.kv_heads) && v.shape(1) == k.shape(1) && k.shape(3) == d &&
            v.shape(3) == d && k.shape(2) == v.shape(2) && min_rows >= 0 &&
            static_cast<size_t>(min_rows) <= k.shape(2),
        what + ": KV runs [attention layers, kv_heads, rows > pos, head_dim]");
  check(k.stride(3) == 1 && k.stride(2) == static_cast<int64_t>(d) && v.stride(3) == 1 &&
            v.stride(2) == static_cast<int64_t>(d), what + ": KV rows must be contiguous");
  kv.k = k.data(), kv.v = v.data(), kv.rows = static_cast<int64_t>(k.shape(2));
  kv.k_layer_stride = k.stride(0), kv.v_layer_stride = v.stride(0);
  kv.k_head_stride = k.stride(1), kv.v_head_stride = v.stride(1);
  check((kv.dtype == KvDtype::I8) == !k_scale.is_none() && k_scale.is_none() == v_scale.is_none(),
        what + ": row scales for an int8 cache only");
  if (kv.dtype == KvDtype::I8) {
    ScaleArray ks = nb::cast<ScaleArray>(k_scale), vs = nb::cast<ScaleArray>(v_scale);
    for (const ScaleArray* a : {&ks, &vs})
      check(a->shape(0) == k.shape(0) && a->shape(1) == k.shape(1) && a->shape(2) == k.shape(2) && a->stride(2) == 1,
            what + ": scale runs [attention layers, kv_heads, rows], contiguous rows");
    check(ks.stride(0) == vs.stride(0) && ks.stride(1) == vs.stride(1), what + ": K and V scales of one layout");
    kv.k_scale = ks.data(), kv.v_scale = vs.data();
    kv.scale_layer_stride = ks.stride(0), kv.scale_head_stride = ks.stride(1);
  }
  return kv;
}

const BackboneMatrix& matrix_of(nb::handle h, int rows, int cols, const std::string& what, Keep& keep) {
  check(nb::isinstance<PyMatrix>(h), what + ": a Matrix");
  const PyMatrix& p = nb::cast<const PyMatrix&>(h);
  check((rows < 0 || p.m.rows == rows) && (cols < 0 || p.m.cols == cols),
        what + ": shape [" + std::to_string(p.m.rows) + ", " + std::to_string(p.m.cols) + "], want [" +
            std::to_string(rows) + ", " + std::to_string(cols) + "]");
  keep.hold(h);
  return p.m;
}

const float* vector_of(nb::handle h, size_t n, const std::string& what, Keep& keep) {
  if (h.is_none()) return nullptr;
  Vector v = nb::cast<Vector>(h);
  check(v.shape(0) == n, what + ": " + std::to_string(v.shape(0)) + " values, want " + std::to_string(n));
  keep.hold(h);
  return v.data();
}

float* state_of(nb::handle h, size_t n, const std::string& what, Keep& keep) {
  AnyArray a = nb::cast<AnyArray>(h);
  check(a.dtype() == nb::dtype<float>() && a.size() == n, what + ": float32 of " + std::to_string(n) + " values");
  keep.hold(h);
  return static_cast<float*>(a.data());
}

template <typename T>
T enum_of(int value, int count, const char* what) {
  check(value >= 0 && value < count, std::string(what) + " out of range");
  return static_cast<T>(value);
}

}  // namespace

void init_decode(nb::module_& m) {
  nb::module_ d = m.def_submodule("decode", "The native decode step: every layer of a recipe in one call");

  nb::class_<PyMatrix>(d, "Matrix", "A backbone matrix: bf16 bits, int8 / E4M3 codes and row scales, or Q4_G32")
      .def("__init__", [](PyMatrix* self, nb::handle codes, nb::handle scales, int kind, int cols) {
        new (self) PyMatrix();
        BackboneMatrix& p = self->m;
        AnyMatrix w = nb::cast<AnyMatrix>(codes);
        p.kind = enum_of<BackboneMatrix::Kind>(kind, 4, "Matrix: kind");
        const bool q4 = p.kind == BackboneMatrix::Q4;
        p.rows = static_cast<int>(w.shape(0));
        p.cols = cols;
        check(p.kind == BackboneMatrix::Bf16 ? w.dtype() == nb::dtype<uint16_t>() : w.dtype() == nb::dtype<uint8_t>(),
              "Matrix: codes have the wrong dtype for their kind");
        check(q4 ? w.shape(1) == static_cast<size_t>((cols + 31) / 32 * 16) : w.shape(1) == static_cast<size_t>(cols),
              "Matrix: codes shape against cols");
        p.w = w.data();
        self->hold(codes);
        if (p.kind == BackboneMatrix::Bf16) {
          check(scales.is_none(), "Matrix: a bf16 matrix has no scales");
          return;
        }
        AnyArray sc = nb::cast<AnyArray>(scales);
        const size_t want = q4 ? static_cast<size_t>(p.rows) * ((cols + 31) / 32) : static_cast<size_t>(p.rows);
        check(sc.size() == want && (q4 ? sc.dtype() == nb::dtype<uint16_t>() : sc.dtype() == nb::dtype<float>()),
              "Matrix: scales");
        p.scales = sc.data();
        self->hold(scales);
      }, nb::arg("codes"), nb::arg("scales").none(), nb::arg("kind"), nb::arg("cols"))
      .def_prop_ro("rows", [](const PyMatrix& p) { return p.m.rows; })
      .def_prop_ro("cols", [](const PyMatrix& p) { return p.m.cols; });

  nb::class_<PyAttention>(d, "AttentionMixer")
      .def("__init__", [](PyAttention* self, int hidden, int heads, int kv_heads, int head_dim, int rot_dim, int qk_norm,
                          bool output_gate, int sliding_window, float clip_qkv, float scale, nb::handle q, nb::handle k,
                          nb::handle v, nb::handle o, nb::handle q_bias, nb::handle k_bias, nb::handle v_bias,
                          nb::handle o_bias, nb::handle q_norm, nb::handle k_norm, nb::handle sinks, bool windowed,
                          int kv_layer) {
        new (self) PyAttention();
        AttentionMixer& a = self->a;
        check(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0, "AttentionMixer: heads");
        check(rot_dim % 2 == 0 && rot_dim <= head_dim, "AttentionMixer: rot_dim");
        check(sliding_window >= 0 && clip_qkv >= 0.f && kv_layer >= 0, "AttentionMixer: window, clip or KV layer");
        a.heads = heads, a.kv_heads = kv_heads, a.head_dim = head_dim, a.rot_dim = rot_dim;
        a.qk_norm = enum_of<QkNorm>(qk_norm, 3, "AttentionMixer: qk_norm");
        a.output_gate = output_gate, a.sliding_window = sliding_window, a.clip_qkv = clip_qkv, a.scale = scale;
        a.kv_layer = kv_layer;
        const int qn = heads * head_dim, kn = kv_heads * head_dim, q_rows = output_gate ? 2 * qn : qn;
        a.q = matrix_of(q, q_rows, hidden, "AttentionMixer: q", *self);
        a.k = matrix_of(k, kn, hidden, "AttentionMixer: k", *self);
        a.v = matrix_of(v, kn, hidden, "AttentionMixer: v", *self);
        a.o = matrix_of(o, hidden, qn, "AttentionMixer: o", *self);
        a.q_bias = vector_of(q_bias, q_rows, "AttentionMixer: q_bias", *self);
        a.k_bias = vector_of(k_bias, kn, "AttentionMixer: k_bias", *self);
        a.v_bias = vector_of(v_bias, kn, "AttentionMixer: v_bias", *self);
        a.o_bias = vector_of(o_bias, hidden, "AttentionMixer: o_bias", *self);
        a.sinks = vector_of(sinks, heads, "AttentionMixer: sinks", *self);
        a.windowed = windowed;
        check(!windowed || sliding_window > 0, "AttentionMixer: a window ring needs a sliding window");
        const bool per_head = a.qk_norm == QkNorm::Head;
        if (a.qk_norm != QkNorm::None) {
          check(!q_norm.is_none() && !k_norm.is_none(), "AttentionMixer: q_norm and k_norm");
          a.q_norm = vector_of(q_norm, per_head ? head_dim : qn, "AttentionMixer: q_norm", *self);
          a.k_norm = vector_of(k_norm, per_head ? head_dim : kn, "AttentionMixer: k_norm", *self);
        }
      }, nb::kw_only(), nb::arg("hidden"), nb::arg("heads"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("rot_dim"),
         nb::arg("qk_norm"), nb::arg("output_gate"), nb::arg("sliding_window"), nb::arg("clip_qkv"), nb::arg("scale"),
         nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("q_bias").none(), nb::arg("k_bias").none(),
         nb::arg("v_bias").none(), nb::arg("o_bias").none(), nb::arg("q_norm").none(), nb::arg("k_norm").none(),
         nb::arg("sinks").none() = nb::none(), nb::arg("windowed") = false, nb::arg("kv_layer"));

  nb::class_<PyLatent>(d, "LatentMixer")
      .def("__init__", [](PyLatent* self, int hidden, int heads, int q_lora_rank, int kv_lora_rank, int nope_dim,
                          int rope_dim, int v_dim, float eps, float scale, nb::handle q, nb::handle q_a,
                          nb::handle q_a_norm, nb::handle q_b, nb::handle kv_a, nb::handle kv_a_norm, nb::handle uk_t,
                          nb::handle uv, nb::handle o, int kv_layer) {
        new (self) PyLatent();
        LatentMixer& m = self->m;
        check(heads > 0 && q_lora_rank >= 0 && kv_lora_rank > 0 && nope_dim > 0 && rope_dim > 0 && rope_dim % 2 == 0 &&
                  v_dim > 0 && kv_layer >= 0, "LatentMixer: geometry");
        m.heads = heads, m.q_lora_rank = q_lora_rank, m.kv_lora_rank = kv_lora_rank, m.nope_dim = nope_dim;
        m.rope_dim = rope_dim, m.v_dim = v_dim, m.eps = eps, m.scale = scale, m.kv_layer = kv_layer;
        const int dq = heads * (nope_dim + rope_dim);
        if (q_lora_rank) {
          m.q_a = matrix_of(q_a, q_lora_rank, hidden, "LatentMixer: q_a", *self);
          m.q_a_norm = vector_of(q_a_norm, q_lora_rank, "LatentMixer: q_a_norm", *self);
          m.q_b = matrix_of(q_b, dq, q_lora_rank, "LatentMixer: q_b", *self);
          check(m.q_a_norm != nullptr, "LatentMixer: q_a_norm");
        } else {
          m.q = matrix_of(q, dq, hidden, "LatentMixer: q", *self);
        }
        m.kv_a = matrix_of(kv_a, kv_lora_rank + rope_dim, hidden, "LatentMixer: kv_a", *self);
        m.kv_a_norm = vector_of(kv_a_norm, kv_lora_rank, "LatentMixer: kv_a_norm", *self);
        check(m.kv_a_norm != nullptr, "LatentMixer: kv_a_norm");
        m.uk_t = matrix_of(uk_t, heads * kv_lora_rank, nope_dim, "LatentMixer: uk_t", *self);
        m.uv = matrix_of(uv, heads * v_dim, kv_lora_rank, "LatentMixer: uv", *self);
        m.o = matrix_of(o, hidden, heads * v_dim, "LatentMixer: o", *self);
      }, nb::kw_only(), nb::arg("hidden"), nb::arg("heads"), nb::arg("q_lora_rank"), nb::arg("kv_lora_rank"),
         nb::arg("nope_dim"), nb::arg("rope_dim"), nb::arg("v_dim"), nb::arg("eps"), nb::arg("scale"),
         nb::arg("q").none(), nb::arg("q_a").none(), nb::arg("q_a_norm").none(), nb::arg("q_b").none(),
         nb::arg("kv_a"), nb::arg("kv_a_norm"), nb::arg("uk_t"), nb::arg("uv"), nb::arg("o"), nb::arg("kv_layer"));

  nb::class_<PyDeltaNet>(d, "DeltaNetMixer")
      .def("__init__", [](PyDeltaNet* self, int hidden, int key_heads, int value_heads, int key_dim, int value_dim,
                          int conv_kernel, float eps, nb::handle qkv, nb::handle z, nb::handle b, nb::handle a,
                          nb::handle out, nb::handle conv, nb::handle neg_decay, nb::handle dt_bias, nb::handle norm,
                          nb::handle conv_state, nb::handle recurrent) {
        new (self) PyDeltaNet();
        DeltaNetMixer& m = self->d;
        check(key_heads > 0 && value_heads > 0 && value_heads % key_heads == 0 && key_dim > 0 && value_dim > 0 &&
                  value_dim <= kMaxDeltaValueDim && conv_kernel >= 1, "DeltaNetMixer: geometry");
        m.key_heads = key_heads, m.value_heads = value_heads, m.key_dim = key_dim, m.value_dim = value_dim;
        m.conv_kernel = conv_kernel, m.eps = eps;
        const int C = m.channels(), vd = value_heads * value_dim;
        m.qkv = matrix_of(qkv, C, hidden, "DeltaNetMixer: qkv", *self);
        m.z = matrix_of(z, vd, hidden, "DeltaNetMixer: z", *self);
        m.b = matrix_of(b, value_heads, hidden, "DeltaNetMixer: b", *self);
        m.a = matrix_of(a, value_heads, hidden, "DeltaNetMixer: a", *self);
        m.out = matrix_of(out, hidden, vd, "DeltaNetMixer: out", *self);
        m.conv = state_of(conv, static_cast<size_t>(C) * conv_kernel, "DeltaNetMixer: conv", *self);
        m.neg_decay = vector_of(neg_decay, value_heads, "DeltaNetMixer: neg_decay", *self);
        m.dt_bias = vector_of(dt_bias, value_heads, "DeltaNetMixer: dt_bias", *self);
        m.norm = vector_of(norm, value_dim, "DeltaNetMixer: norm", *self);
        check(m.neg_decay && m.dt_bias && m.norm, "DeltaNetMixer: neg_decay, dt_bias and norm");
        m.conv_state = state_of(conv_state, static_cast<size_t>(C) * (conv_kernel - 1), "DeltaNetMixer: conv_state", *self);
        m.recurrent = state_of(recurrent, static_cast<size_t>(vd) * key_dim, "DeltaNetMixer: recurrent", *self);
      }, nb::kw_only(), nb::arg("hidden"), nb::arg("key_heads"), nb::arg("value_heads"), nb::arg("key_dim"),
         nb::arg("value_dim"), nb::arg("conv_kernel"), nb::arg("eps"), nb::arg("qkv"), nb::arg("z"), nb::arg("b"),
         nb::arg("a"), nb::arg("out"), nb::arg("conv"), nb::arg("neg_decay"), nb::arg("dt_bias"), nb::arg("norm"),
         nb::arg("conv_state"), nb::arg("recurrent"));

  nb::class_<PyRouter>(d, "Router")
      .def("__init__", [](PyRouter* self, int hidden, nb::handle gate, int scoring, int method, int top_k, int n_group,
                          int topk_group, bool norm_topk_prob, float scaling, nb::handle score_bias,
                          nb::handle logit_bias) {
        new (self) PyRouter();
        Router& r = self->r;
        r.gate = matrix_of(gate, -1, hidden, "Router: gate", *self);
        const int E = r.gate.rows;
        r.scoring = enum_of<Scoring>(scoring, 2, "Router: scoring");
        r.method = enum_of<TopkMethod>(method, 3, "Router: method");
        check(top_k >= 1 && top_k <= 64 && top_k <= E, "Router: top_k must be 1..64 and at most the experts");
        check(n_group >= 1 && n_group <= 256 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
              "Router: groups");
        r.top_k = top_k, r.n_group = n_group, r.topk_group = topk_group, r.norm_topk_prob = norm_topk_prob;
        r.scaling = scaling;
        r.score_bias = vector_of(score_bias, E, "Router: score_bias", *self);
        r.logit_bias = vector_of(logit_bias, E, "Router: logit_bias", *self);
      }, nb::kw_only(), nb::arg("hidden"), nb::arg("gate"), nb::arg("scoring"), nb::arg("method"), nb::arg("top_k"),
         nb::arg("n_group"), nb::arg("topk_group"), nb::arg("norm_topk_prob"), nb::arg("scaling"),
         nb::arg("score_bias").none(), nb::arg("logit_bias").none() = nb::none());

  nb::class_<PyLayer>(d, "DecodeLayer", "One layer's decode step: its mixer, then its FFN")
      .def("__init__", [](PyLayer* self, int hidden, float eps, nb::handle input_norm, nb::handle post_norm,
                          nb::handle mixer, nb::handle router, nb::handle gate, nb::handle up, nb::handle down,
                          nb::handle shared_gate) {
        new (self) PyLayer();
        DecodeLayer& L = self->L;
        L.hidden = hidden, L.eps = eps;
        L.input_norm = vector_of(input_norm, hidden, "DecodeLayer: input_norm", *self);
        L.post_norm = vector_of(post_norm, hidden, "DecodeLayer: post_norm", *self);
        check(L.input_norm && L.post_norm, "DecodeLayer: norms");
        if (nb::isinstance<PyAttention>(mixer)) {
          L.attention = nb::cast<const PyAttention&>(mixer).a;
        } else if (nb::isinstance<PyLatent>(mixer)) {
          L.mixer = DecodeLayer::Latent;
          L.latent = nb::cast<const PyLatent&>(mixer).m;
        } else {
          check(nb::isinstance<PyDeltaNet>(mixer),
                "DecodeLayer: mixer is an AttentionMixer, a LatentMixer or a DeltaNetMixer");
          L.mixer = DecodeLayer::DeltaNet;
          L.delta = nb::cast<const PyDeltaNet&>(mixer).d;
        }
        self->hold(mixer);
        if (!router.is_none()) {
          check(nb::isinstance<PyRouter>(router), "DecodeLayer: router is a Router");
          L.ffn.router = nb::cast<const PyRouter&>(router).r;
          check(L.ffn.router.gate.cols == hidden, "DecodeLayer: router width");
          self->hold(router);
        }
        if (!gate.is_none()) {
          L.ffn.gate = matrix_of(gate, -1, hidden, "DecodeLayer: gate", *self);
          L.ffn.up = matrix_of(up, L.ffn.gate.rows, hidden, "DecodeLayer: up", *self);
          L.ffn.down = matrix_of(down, hidden, L.ffn.gate.rows, "DecodeLayer: down", *self);
        } else {
          check(!router.is_none(), "DecodeLayer: a layer with neither routed experts nor an MLP");
        }
        if (!shared_gate.is_none()) {
          check(!gate.is_none(), "DecodeLayer: a shared-expert gate without a shared expert");
          L.ffn.shared_gate = matrix_of(shared_gate, 1, hidden, "DecodeLayer: shared_gate", *self);
        }
      }, nb::kw_only(), nb::arg("hidden"), nb::arg("eps"), nb::arg("input_norm"), nb::arg("post_norm"), nb::arg("mixer"),
         nb::arg("router").none(), nb::arg("gate").none(), nb::arg("up").none(), nb::arg("down").none(),
         nb::arg("shared_gate").none());

  nb::class_<PyHead>(d, "DecodeHead", "The final RMSNorm and lm_head")
      .def("__init__", [](PyHead* self, nb::handle norm, float eps, nb::handle lm_head) {
        new (self) PyHead();
        Vector n = nb::cast<Vector>(norm);
        self->head.norm = vector_of(norm, n.shape(0), "DecodeHead: norm", *self);
        self->head.eps = eps;
        self->head.lm_head = matrix_of(lm_head, -1, static_cast<int>(n.shape(0)), "DecodeHead: lm_head", *self);
      }, nb::kw_only(), nb::arg("norm"), nb::arg("eps"), nb::arg("lm_head"));

  nb::class_<PyLoopExperts>(d, "LoopExperts", "The expert ring's held records, for decode_layers to run itself")
      .def("__init__", [](PyLoopExperts* self, int isa, int threads, const ExpertFormat& format, int top_k,
                          nb::handle ring, nb::handle slot_of, nb::handle scratch) {
        new (self) PyLoopExperts();
        LoopExperts& e = self->e;
        e.isa = Isa(isa);
        e.threads = threads;
        check(isa_available(e.isa), "LoopExperts: this CPU lacks that ISA");
        e.layout = format.layout;
        e.act = format.act;
        const ExpertRing& r = nb::cast<const ExpertRing&>(ring);
        check(e.layout.record_bytes <= r.slot_bytes(), "LoopExperts: records larger than the ring's slots");
        e.ring = &r;
        // The slot table is the store's, updated in place between steps; run() checks it each call.
        auto table = nb::cast<nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>>(slot_of);
        e.slot_of = table.data();
        e.n_experts = static_cast<int>(table.shape(1));
        self->layers = static_cast<int>(table.shape(0));
        self->n_slots = static_cast<int>(r.n_slots());
        check(top_k >= 1 && top_k <= 64, "LoopExperts: top_k");
        self->top_k = top_k;
        OutVector s = nb::cast<OutVector>(scratch);
        check(s.shape(0) >= moe_scratch_floats(e.layout, top_k, 1, threads), "LoopExperts: scratch too small");
        e.scratch = s.data();
        for (nb::handle h : {ring, slot_of, scratch}) self->hold(h);
      }, nb::kw_only(), nb::arg("isa"), nb::arg("threads"), nb::arg("format"), nb::arg("top_k"), nb::arg("ring"),
         nb::arg("slot_of"), nb::arg("scratch"));

  nb::class_<PyDecodeStep>(d, "DecodeStep", "A model's layers and head, run a token at a time by run()")
      .def("__init__", [](PyDecodeStep* self, std::vector<nb::handle> layers, nb::handle head) {
        new (self) PyDecodeStep();
        check(!layers.empty(), "DecodeStep: no layers");
        for (nb::handle h : layers) {
          check(nb::isinstance<PyLayer>(h), "DecodeStep: layers are DecodeLayer objects");
          const DecodeLayer& L = nb::cast<const PyLayer&>(h).L;
          check(self->layers.empty() || L.hidden == self->layers[0].hidden, "DecodeStep: one hidden size");
          self->layers.push_back(L);
          self->hold(h);
          self->scratch_floats = std::max(self->scratch_floats, decode_layer_scratch_floats(L));
          self->top_k = std::max(self->top_k, L.ffn.router.top_k);
          if (L.mixer != DecodeLayer::DeltaNet) {  // a KV cache row: per KV head, or one latent row
            const bool latent = L.mixer == DecodeLayer::Latent;
            const int kv_heads = latent ? 1 : L.attention.kv_heads;
            const int head_dim = latent ? L.latent.latent_dim() : L.attention.head_dim;
            check(self->n_attention == 0 || (kv_heads == self->kv_heads && head_dim == self->head_dim),
                  "DecodeStep: attention layers of one KV geometry");
            self->kv_heads = kv_heads, self->head_dim = head_dim;
            int& count = !latent && L.attention.windowed ? self->n_windowed : self->n_attention;
            count = std::max(count, (latent ? L.latent.kv_layer : L.attention.kv_layer) + 1);
          }
        }
        self->hidden = self->layers[0].hidden;
        if (!head.is_none()) {
          check(nb::isinstance<PyHead>(head), "DecodeStep: head is a DecodeHead");
          self->head = &nb::cast<const PyHead&>(head).head;
          check(self->head->lm_head.cols == self->hidden, "DecodeStep: head width");
          self->hold(head);
          self->scratch_floats = std::max<uint64_t>(self->scratch_floats, self->hidden);
        }
      }, nb::arg("layers"), nb::arg("head").none())
      .def_prop_ro("scratch_floats", [](const PyDecodeStep& s) { return s.scratch_floats; })
      .def_prop_ro("top_k", [](const PyDecodeStep& s) { return s.top_k; })
      .def_prop_ro("vocab", [](const PyDecodeStep& s) { return s.head ? s.head->lm_head.rows : 0; })
      // Layers first.. of one token at position pos: x [hidden] (updated), h [hidden]; cos / signed_sin the
      // position's RoPE tables (unused without attention); k_run / v_run [attention layers, kv_heads, rows,
      // head_dim] (float32, bf16 as uint16, or int8; row p is position p), k_scale / v_scale
      // [attention layers, kv_heads, rows] for int8; topk_weights / topk_ids [layers, top_k]; experts: the
      // ring's records, or None; logits [vocab] with a head. Returns (the layer whose routed experts are
      // left to the caller, or len(layers); the experts' kernel seconds).
      .def("run", [](PyDecodeStep& s, int first, int isa, int threads, OutVector x, OutVector h, int pos, Vector cos,
                     Vector signed_sin, nb::handle k_run, nb::handle v_run, nb::handle k_scale, nb::handle v_scale,
                     nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> topk_weights,
                     nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> topk_ids, OutVector scratch,
                     nb::handle experts, nb::handle logits, nb::handle kw_run, nb::handle vw_run, nb::handle kw_scale,
                     nb::handle vw_scale) {
        const int n = static_cast<int>(s.layers.size());
        check(first >= 0 && first <= n, "run: first layer");
        check(isa_available(Isa(isa)), "run: this CPU lacks that ISA");
        check(x.shape(0) == static_cast<size_t>(s.hidden) && h.shape(0) == x.shape(0), "run: x and h [hidden]");
        check(topk_weights.shape(0) == static_cast<size_t>(n) && topk_ids.shape(0) == topk_weights.shape(0) &&
                  topk_weights.shape(1) >= static_cast<size_t>(s.top_k) && topk_ids.shape(1) == topk_weights.shape(1),
              "run: top-k arrays [layers, top_k]");
        check(scratch.shape(0) >= s.scratch_floats, "run: scratch too small");
        check(cos.shape(0) == signed_sin.shape(0), "run: RoPE tables");
        KvRuns kv;
        if (s.n_attention > 0 || s.n_windowed > 0) {
          for (const DecodeLayer& L : s.layers) {
            const int rot = L.mixer == DecodeLayer::Latent ? L.latent.rope_dim : L.attention.rot_dim;
            check(L.mixer == DecodeLayer::DeltaNet || static_cast<size_t>(rot) == cos.shape(0),
                  "run: RoPE table width");
          }
        }
        if (s.n_attention > 0) kv.full = kv_run_of(k_run, v_run, k_scale, v_scale, s, s.n_attention, pos + 1, "run");
        if (s.n_windowed > 0) {  // the ring's rows: two copies of ring positions, a window at most
          kv.window = kv_run_of(kw_run, vw_run, kw_scale, vw_scale, s, s.n_windowed, 2, "run (window ring)");
          for (const DecodeLayer& L : s.layers)
            check(L.mixer != DecodeLayer::Attention || !L.attention.windowed ||
                      (kv.window.rows % 2 == 0 && kv.window.rows / 2 >= L.attention.sliding_window),
                  "run (window ring): rows must be twice a ring of at least the window");
        }
        const LoopExperts* loop = nullptr;
        if (!experts.is_none()) {
          const PyLoopExperts& e = nb::cast<const PyLoopExperts&>(experts);
          check(e.e.layout.planes[4].rows == static_cast<uint64_t>(s.hidden), "run: experts' hidden size");
          check(e.layers == n && e.top_k >= s.top_k, "run: the experts' slot table [layers, experts] and top_k");
          const int64_t cells = static_cast<int64_t>(e.layers) * e.e.n_experts;
          for (int64_t i = 0; i < cells; ++i) check(e.e.slot_of[i] < e.n_slots, "run: slot out of range");
          loop = &e.e;
        }
        float* out = nullptr;
        if (s.head) {
          OutVector l = nb::cast<OutVector>(logits);
          check(l.shape(0) == static_cast<size_t>(s.head->lm_head.rows), "run: logits [vocab]");
          out = l.data();
        }
        DecodeLayersResult r;
        {
          nb::gil_scoped_release release;
          r = decode_layers(s.layers.data(), n, first, kv, loop, s.head, x.data(), h.data(), pos, cos.data(),
                            signed_sin.data(), topk_weights.data(), topk_ids.data(),
                            static_cast<int>(topk_weights.shape(1)), out, scratch.data(), threads, Isa(isa));
        }
        return std::make_tuple(r.stop, r.kernel_s);
      }, nb::arg("first"), nb::arg("isa"), nb::arg("threads"), nb::arg("x"), nb::arg("h"), nb::arg("pos"), nb::arg("cos"),
         nb::arg("signed_sin"), nb::arg("k_run").none(), nb::arg("v_run").none(), nb::arg("k_scale").none(),
         nb::arg("v_scale").none(), nb::arg("topk_weights"), nb::arg("topk_ids"), nb::arg("scratch"),
         nb::arg("experts").none(), nb::arg("logits").none(), nb::arg("kw_run").none() = nb::none(),
         nb::arg("vw_run").none() = nb::none(), nb::arg("kw_scale").none() = nb::none(),
         nb::arg("vw_scale").none() = nb::none())
      // x [hidden] += layer's shared expert or dense MLP of h [hidden]: what run() leaves to the caller at the
      // layer it stops at, before the caller adds that layer's routed experts.
      .def("mlp", [](PyDecodeStep& s, int layer, int isa, int threads, OutVector x, Vector h, OutVector scratch) {
        check(layer >= 0 && layer < static_cast<int>(s.layers.size()), "mlp: layer");
        check(isa_available(Isa(isa)), "mlp: this CPU lacks that ISA");
        check(x.shape(0) == static_cast<size_t>(s.hidden) && h.shape(0) == x.shape(0), "mlp: x and h [hidden]");
        check(scratch.shape(0) >= s.scratch_floats, "mlp: scratch too small");
        nb::gil_scoped_release release;
        decode_mlp(s.layers[layer], h.data(), x.data(), scratch.data(), threads, Isa(isa));
      }, nb::arg("layer"), nb::arg("isa"), nb::arg("threads"), nb::arg("x"), nb::arg("h"), nb::arg("scratch"));
}
