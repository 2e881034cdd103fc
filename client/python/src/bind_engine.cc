// Python bindings of Engine I: kvcomp.Policy, kvcomp.score, kvcomp.compress and
// kvcomp.CompressedCache. Arrays come in as anything DLPack/NumPy-like, shaped
// [kv_heads, tokens, head_dim] or [layers, kv_heads, tokens, head_dim], C-contiguous, f32/f16/bf16
// (bf16 as a bfloat16 dtype, or a uint16 array with dtype="bf16"); CUDA arrays are read in place
// by the CUDA backend, ordered after their producer's stream (call_backend.h). Outputs are NumPy
// arrays that own copies.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/strings/str_format.h"
#include "bindings.h"
#include "call_backend.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/heads.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/core/policy_fields.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"

namespace nb = nanobind;

namespace kvcomp {
namespace python {
namespace {

using AnyArray = CallArray;

// --- arrays in ---

DType ArrayDType(const AnyArray& a, const std::string& hint) { return CallArrayDType(a, hint); }

// Per-layer HeadsViews over a [H, T, D] or [L, H, T, D] array.
struct LayerViews {
  std::vector<HeadsView> layers;
  uint32_t heads = 0;
  uint64_t tokens = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kF32;
};

LayerViews ViewsOf(const AnyArray& a, const std::string& hint, const char* what) {
  if (a.ndim() != 3 && a.ndim() != 4) {
    throw nb::value_error(absl::StrFormat("%s must be [kv_heads, tokens, head_dim] or [layers, "
                                          "kv_heads, tokens, head_dim], got %d dimensions",
                                          what, a.ndim())
                              .c_str());
  }
  LayerViews v;
  v.dtype = ArrayDType(a, hint);
  const size_t o = a.ndim() - 3;
  const uint64_t layers = a.ndim() == 4 ? a.shape(0) : 1;
  v.heads = static_cast<uint32_t>(a.shape(o));
  v.tokens = a.shape(o + 1);
  v.head_dim = static_cast<uint32_t>(a.shape(o + 2));
  const MemorySpace space = SpaceOf(a);
  const uint64_t layer_elems = uint64_t{v.heads} * v.tokens * v.head_dim;
  const size_t eb = v.dtype == DType::kF32 ? 4 : 2;
  for (uint64_t l = 0; l < layers; ++l) {
    v.layers.push_back(HeadsView::Dense(static_cast<const char*>(a.data()) + l * layer_elems * eb,
                                        v.dtype, v.heads, v.tokens, v.head_dim, space));
  }
  return v;
}

std::unique_ptr<Backend> BackendNamed(const std::string& name) { return Unwrap(MakeBackend(name)); }

// --- arrays out ---

template <typename T>
nb::object NumpyOwning(std::vector<T>&& data, std::vector<size_t> shape, nb::dlpack::dtype dt) {
  auto* heap = new std::vector<T>(std::move(data));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy>(heap->data(), shape.size(), shape.data(), owner, nullptr, dt)
      .cast();
}

// A uint16 array of bf16 bits as ml_dtypes.bfloat16 when that package is there.
nb::object MaybeBf16(nb::object arr) {
  try {
    nb::module_ ml = nb::module_::import_("ml_dtypes");
    return arr.attr("view")(ml.attr("bfloat16"));
  } catch (const nb::python_error&) {
    return arr;
  }
}

nb::object RowsOut(const CompressedCache& c, const std::vector<uint8_t>& bytes, uint32_t layer,
                   uint32_t head, bool keys) {
  if (layer >= c.layout.num_layers || head >= c.layout.num_kv_heads) {
    throw nb::index_error(absl::StrFormat("(layer %u, head %u) outside %u layers x %u kv heads",
                                          layer, head, c.layout.num_layers, c.layout.num_kv_heads)
                              .c_str());
  }
  if ((keys && c.key_codec != KeyCodec::kRaw) || (!keys && c.value_codec != ValueCodec::kRaw)) {
    throw nb::value_error("this cache's tokens are encoded; decode them with the codec API");
  }
  const uint32_t h = c.head_index(layer, head);
  const uint64_t row = keys ? c.KeyTokenBytes() : c.ValueTokenBytes();
  const uint64_t off = c.token_offset(h) * row;
  const uint64_t n = c.kept[h];
  const uint32_t d = c.layout.head_dim;
  using C = nb::dlpack::dtype_code;
  switch (c.layout.dtype) {
    case DType::kF32: {
      std::vector<float> out(n * d);
      std::memcpy(out.data(), bytes.data() + off, n * row);
      return NumpyOwning(std::move(out), {n, d}, nb::dtype<float>());
    }
    case DType::kF16: {
      std::vector<uint16_t> out(n * d);
      std::memcpy(out.data(), bytes.data() + off, n * row);
      return NumpyOwning(std::move(out), {n, d},
                         nb::dlpack::dtype{static_cast<uint8_t>(C::Float), 16, 1});
    }
    default: {
      std::vector<uint16_t> out(n * d);
      std::memcpy(out.data(), bytes.data() + off, n * row);
      return MaybeBf16(NumpyOwning(std::move(out), {n, d}, nb::dtype<uint16_t>()));
    }
  }
}

// --- policy ---

CompressionPolicy MakePolicy(const std::string& scorer, double ratio,
                             std::optional<uint32_t> budget, const std::string& head_budget,
                             double alpha_safeguard, uint32_t n_sink, uint32_t n_recent,
                             bool protect, uint32_t window, uint32_t snapkv_window,
                             uint32_t snapkv_pool, uint64_t seed, uint32_t block_size, bool moments,
                             bool moment_aware, const std::string& key_codec,
                             const std::string& value_codec, uint32_t rank, uint32_t group_size,
                             bool gamma_aware, double value_outlier_factor,
                             double value_raw_fraction, double recent_fraction,
                             uint32_t key_bits, uint32_t value_bits) {
  CompressionPolicy p;
  p.scorer = Unwrap(ParseScorer(scorer));
  p.ratio = ratio;
  p.token_budget = budget.value_or(0);
  if (budget.has_value() && *budget == 0) {
    throw nb::value_error("budget of zero tokens: nothing would be kept (None = use ratio)");
  }
  p.head_budget = Unwrap(ParseHeadBudget(head_budget));
  p.alpha_safeguard = alpha_safeguard;
  p.n_sink = n_sink;
  p.n_recent = n_recent;
  p.recent_fraction = recent_fraction;
  p.protect = protect;
  p.window = window;
  p.snapkv_window = snapkv_window;
  p.snapkv_pool = snapkv_pool;
  p.seed = seed;
  p.block_size = block_size;
  p.moments = moments;
  p.moment_aware = moment_aware;
  p.key_codec = Unwrap(ParseKeyCodec(key_codec));
  p.value_codec = Unwrap(ParseValueCodec(value_codec));
  p.rank = rank;
  p.group_size = group_size;
  p.gamma_aware = gamma_aware;
  p.value_outlier_factor = value_outlier_factor;
  p.value_raw_fraction = value_raw_fraction;
  p.key_bits = key_bits;
  p.value_bits = value_bits;
  ThrowIfError(p.Validate());
  return p;
}

// A read-only attribute per declared policy field (policy_fields.def): enums by name.
template <typename T>
void BindPolicyField(nb::class_<CompressionPolicy>& cls, const char* name,
                     T CompressionPolicy::*member) {
  if constexpr (std::is_enum_v<T>) {
    cls.def_prop_ro(name, [member](const CompressionPolicy& p) {
      return std::string(PolicyEnum<T>::Name(p.*member));
    });
  } else {
    cls.def_ro(name, member);
  }
}

// --- entry points ---

nb::object Score(nb::handle keys_obj, const CompressionPolicy& policy, const std::string& backend,
                 const std::string& dtype, nb::handle queries_obj, std::optional<uint64_t> stream) {
  const CallBackend call =
      CallBackend::Open(backend, CommonDevice({keys_obj, queries_obj}), stream);
  const AnyArray keys = ImportArray(keys_obj, call, "keys");
  LayerViews k = ViewsOf(keys, dtype, "keys");
  std::optional<AnyArray> queries;
  std::optional<LayerViews> q;
  if (!queries_obj.is_none()) {
    queries = ImportArray(queries_obj, call, "queries");
    q = ViewsOf(*queries, dtype, "queries");
  }
  if (q && q->layers.size() != k.layers.size()) {
    throw nb::value_error("queries and keys have different layer counts");
  }
  Backend* b = &call.get();
  std::vector<float> all;
  {
    nb::gil_scoped_release release;
    for (uint32_t l = 0; l < k.layers.size(); ++l) {
      auto s = ScoreLayer(*b, k.layers[l], policy, l, q ? q->layers[l] : HeadsView{});
      if (!s.ok()) {
        nb::gil_scoped_acquire acquire;
        ThrowIfError(s.status());
      }
      all.insert(all.end(), s->begin(), s->end());
    }
  }
  std::vector<size_t> shape = {k.heads, k.tokens};
  if (keys.ndim() == 4) shape.insert(shape.begin(), k.layers.size());
  return NumpyOwning(std::move(all), shape, nb::dtype<float>());
}

CompressedCache CompressArrays(nb::handle keys_obj, nb::handle values_obj,
                               const CompressionPolicy& policy, const std::string& backend,
                               const std::string& dtype, nb::handle queries_obj,
                               std::optional<uint32_t> num_q_heads,
                               std::optional<uint64_t> stream) {
  const CallBackend call =
      CallBackend::Open(backend, CommonDevice({keys_obj, values_obj, queries_obj}), stream);
  const AnyArray keys = ImportArray(keys_obj, call, "keys");
  const AnyArray values = ImportArray(values_obj, call, "values");
  std::optional<AnyArray> queries;
  if (!queries_obj.is_none()) queries = ImportArray(queries_obj, call, "queries");
  LayerViews k = ViewsOf(keys, dtype, "keys");
  LayerViews v = ViewsOf(values, dtype, "values");
  if (keys.ndim() != values.ndim()) throw nb::value_error("keys and values differ in rank");
  KvCacheView c;
  c.layout.num_layers = static_cast<uint32_t>(k.layers.size());
  c.layout.num_kv_heads = k.heads;
  c.layout.head_dim = k.head_dim;
  c.layout.dtype = k.dtype;
  c.num_tokens = k.tokens;
  c.keys = k.layers;
  c.values = v.layers;
  if (queries.has_value()) {
    LayerViews q = ViewsOf(*queries, dtype, "queries");
    c.queries = q.layers;
    c.layout.num_q_heads = q.heads;
  } else {
    c.layout.num_q_heads = num_q_heads.value_or(k.heads);
  }
  Backend* b = &call.get();
  absl::StatusOr<CompressedCache> out;
  {
    nb::gil_scoped_release release;
    out = Compress(*b, c, policy);
  }
  return Unwrap(std::move(out));
}

}  // namespace

void RegisterEngine(nb::module_& m) {
  // Every keyword below is a field of kvcomp/core/policy_fields.def (token_budget is `budget`,
  // None = use ratio); ctest policy_fields_check and tests/python/test_policy_fields.py hold them
  // to it. The attributes are generated from the declaration.
  nb::class_<CompressionPolicy> policy(
      m, "Policy", "Compression policy (see kvcomp/core/policy_fields.def for every field)");
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  if (std::string_view(#name) != "token_budget") {                                         \
    BindPolicyField(policy, #name, &CompressionPolicy::name);                              \
  }
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
  policy
      .def(nb::new_(&MakePolicy), nb::arg("scorer") = "manifold", nb::arg("ratio") = 0.5,
           nb::arg("budget") = nb::none(), nb::arg("head_budget") = "uniform",
           nb::arg("alpha_safeguard") = 0.20, nb::arg("n_sink") = 4, nb::arg("n_recent") = 0,
           nb::arg("protect") = true, nb::arg("window") = 4096, nb::arg("snapkv_window") = 64,
           nb::arg("snapkv_pool") = 5, nb::arg("seed") = 0, nb::arg("block_size") = 0,
           nb::arg("moments") = false, nb::arg("moment_aware") = false, nb::arg("key_codec") = "raw",
           nb::arg("value_codec") = "none", nb::arg("rank") = 0, nb::arg("group_size") = 32,
           nb::arg("gamma_aware") = true, nb::arg("value_outlier_factor") = 4.0,
           nb::arg("value_raw_fraction") = 0.02, nb::arg("recent_fraction") = 0.75,
           nb::arg("key_bits") = 3, nb::arg("value_bits") = 2)
      .def_prop_ro("budget",
                   [](const CompressionPolicy& p) -> std::optional<uint32_t> {
                     if (p.token_budget == 0) return std::nullopt;
                     return p.token_budget;
                   })
      .def("kept_per_head", &CompressionPolicy::KeptPerHead, nb::arg("num_tokens"),
           "Tokens a head of num_tokens keeps (kvpress rounding, or the budget)")
      .def("effective_recent", &CompressionPolicy::EffectiveRecent, nb::arg("kept_per_head"),
           "Recent tokens protected for a head keeping kept_per_head tokens: "
           "max(n_recent, min(floor(recent_fraction * kept_per_head), kept_per_head - n_sink))")
      .def("__eq__", [](const CompressionPolicy& a, const CompressionPolicy& b) { return a == b; })
      .def("__repr__", &CompressionPolicy::DebugString);

  nb::class_<CompressedCache>(m, "CompressedCache",
                              "One sequence's compressed KV cache (ragged per (layer, kv head))")
      .def(
          "kept_positions",
          [](const CompressedCache& c, uint32_t layer, uint32_t head) {
            if (layer >= c.layout.num_layers || head >= c.layout.num_kv_heads) {
              throw nb::index_error("(layer, head) out of range");
            }
            const uint32_t h = c.head_index(layer, head);
            const uint64_t off = c.token_offset(h);
            std::vector<uint32_t> p(c.positions.begin() + off,
                                    c.positions.begin() + off + c.kept[h]);
            const size_t n = p.size();
            return NumpyOwning(std::move(p), {n}, nb::dtype<uint32_t>());
          },
          nb::arg("layer"), nb::arg("head"))
      .def(
          "keys",
          [](const CompressedCache& c, uint32_t layer, uint32_t head) {
            return RowsOut(c, c.keys, layer, head, true);
          },
          nb::arg("layer"), nb::arg("head"))
      .def(
          "values",
          [](const CompressedCache& c, uint32_t layer, uint32_t head) {
            return RowsOut(c, c.values, layer, head, false);
          },
          nb::arg("layer"), nb::arg("head"))
      .def_prop_ro("kept", [](const CompressedCache& c) { return c.kept; })
      .def_prop_ro(
          "nbytes", [](const CompressedCache& c) { return Unwrap(format::EncodedSize(c)); },
          "Bytes of the encoded cache (what it costs stored or sent)")
      .def_prop_ro("original_nbytes", &CompressedCache::original_bytes,
                   "Bytes of the uncompressed K and V")
      .def_ro("original_tokens", &CompressedCache::original_tokens)
      .def_ro("has_moments", &CompressedCache::has_moments)
      .def_ro("policy", &CompressedCache::policy)
      .def_prop_ro("num_layers", [](const CompressedCache& c) { return c.layout.num_layers; })
      .def_prop_ro("num_kv_heads", [](const CompressedCache& c) { return c.layout.num_kv_heads; })
      .def_prop_ro("num_q_heads", [](const CompressedCache& c) { return c.layout.num_q_heads; })
      .def_prop_ro("head_dim", [](const CompressedCache& c) { return c.layout.head_dim; })
      .def_prop_ro("dtype",
                   [](const CompressedCache& c) { return std::string(DTypeName(c.layout.dtype)); })
      .def("to_bytes",
           [](const CompressedCache& c) {
             std::string s = Unwrap(format::EncodeCache(c));
             return nb::bytes(s.data(), s.size());
           })
      .def_static(
          "from_bytes",
          [](nb::bytes b) {
            return Unwrap(format::ParseCache(absl::string_view(b.c_str(), b.size())));
          },
          nb::arg("data"))
      .def("__eq__", [](const CompressedCache& a, const CompressedCache& b) { return a == b; })
      .def("__repr__", &CompressedCache::DebugString);

  m.def(
      "split_heads",
      [](const CompressedCache& c, uint32_t parts) { return Unwrap(SplitHeads(c, parts)); },
      nb::arg("cache"), nb::arg("parts"),
      "The cache split into `parts` equal ranges of kv heads (a tensor-parallel rank's share "
      "each), byte for byte what those heads hold; ValueError when parts does not divide the "
      "kv heads; KVSplice-encoded values are refused");
  m.def(
      "slice_heads",
      [](const CompressedCache& c, uint32_t begin, uint32_t end) {
        return Unwrap(SliceHeads(c, begin, end));
      },
      nb::arg("cache"), nb::arg("begin"), nb::arg("end"),
      "kv heads [begin, end) of every layer of the cache");
  m.def(
      "merge_heads",
      [](const std::vector<CompressedCache>& parts) { return Unwrap(MergeHeads(parts)); },
      nb::arg("parts"),
      "The cache whose kv heads are those of `parts` in order (inverse of split_heads); the "
      "parts must agree on everything but their heads");
  m.def("_score", &Score, nb::arg("keys"), nb::arg("policy"), nb::arg("backend") = "cpu",
        nb::arg("dtype") = "", nb::arg("queries").none() = nb::none(),
        nb::arg("stream") = nb::none());
  m.def("_compress", &CompressArrays, nb::arg("keys"), nb::arg("values"), nb::arg("policy"),
        nb::arg("backend") = "cpu", nb::arg("dtype") = "", nb::arg("queries").none() = nb::none(),
        nb::arg("num_q_heads") = nb::none(), nb::arg("stream") = nb::none());
  m.def("cuda_available", &CudaAvailable, "True when the CUDA backend can run here");
  m.def(
      "backend_description", [](const std::string& name) { return BackendNamed(name)->Describe(); },
      nb::arg("backend") = "cpu");
}

}  // namespace python
}  // namespace kvcomp
