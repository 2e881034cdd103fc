// Python bindings of Engine II: CompressedCache.moments(layer, head) and the decode-side
// attention over a compressed cache, kvcomp.attention(q, cache, layer, correct=True) (exposed
// by the native module as _attention; kvcomp/__init__.py wraps it). Queries and `out` may be CUDA
// arrays (backend "cuda"), taken in and written on the call's stream (call_backend.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "bindings.h"
#include "call_backend.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/decode/attention.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/projection.h"

namespace nb = nanobind;

namespace kvcomp {
namespace python {
namespace {

void CheckHead(const CompressedCache& c, uint32_t layer, uint32_t head) {
  if (layer >= c.layout.num_layers || head >= c.layout.num_kv_heads) {
    throw nb::index_error(absl::StrFormat("(layer %u, head %u) outside %u layers x %u kv heads",
                                          layer, head, c.layout.num_layers, c.layout.num_kv_heads)
                              .c_str());
  }
}

std::tuple<uint64_t, nb::object, nb::object, nb::object> Moments(const CompressedCache& c,
                                                                 uint32_t layer, uint32_t head) {
  CheckHead(c, layer, head);
  if (!c.has_moments) {
    throw nb::value_error("this cache has no moment summaries (policy.moments was off)");
  }
  const uint64_t h = c.head_index(layer, head);
  const size_t d = c.layout.head_dim;
  std::vector<float> ks(c.moment_key_sum.begin() + h * d, c.moment_key_sum.begin() + (h + 1) * d);
  std::vector<float> vs(c.moment_value_sum.begin() + h * d,
                        c.moment_value_sum.begin() + (h + 1) * d);
  std::vector<float> s(c.moment_vk_sum.begin() + h * d * d,
                       c.moment_vk_sum.begin() + (h + 1) * d * d);
  return {c.moment_count[h], NumpyArray(std::move(ks), {d}), NumpyArray(std::move(vs), {d}),
          NumpyArray(std::move(s), {d, d})};
}

DType QueryDType(const CallArray& q) {
  const auto dt = q.dtype();
  using C = nb::dlpack::dtype_code;
  if (dt.code == static_cast<uint8_t>(C::Float) && dt.bits == 32) return DType::kF32;
  if (dt.code == static_cast<uint8_t>(C::Float) && dt.bits == 16) return DType::kF16;
  if (dt.code == static_cast<uint8_t>(C::Bfloat) && dt.bits == 16) return DType::kBF16;
  throw nb::value_error("queries must be float32, float16 or bfloat16");
}

// The caller's output array: float32, [q_heads, n_queries, head_dim] (or [q_heads, head_dim]
// for 2-D queries), in host or device memory.
float* OutputArray(const CallArray& out, const CallArray& q) {
  bool ok = out.ndim() == q.ndim() && out.dtype() == nb::dtype<float>();
  for (size_t i = 0; ok && i < q.ndim(); ++i) ok = out.shape(i) == q.shape(i);
  if (!ok) throw nb::value_error("out must be float32 and shaped like the queries");
  return static_cast<float*>(const_cast<void*>(out.data()));
}

nb::object Attention(nb::handle q_obj, const CompressedCache& c, uint32_t layer, bool correct,
                     const std::string& backend, float scale, nb::handle out_obj,
                     std::optional<uint64_t> stream,
                     std::optional<std::shared_ptr<Projection>> projection,
                     bool expand_in_attention) {
  const CallBackend call = CallBackend::Open(backend, CommonDevice({q_obj, out_obj}), stream);
  const CallArray q = ImportArray(q_obj, call, "queries");
  std::optional<CallArray> out_arr;
  float* out_ptr = nullptr;
  if (!out_obj.is_none()) {
    out_arr = ImportArray(out_obj, call, "out");
    out_ptr = OutputArray(*out_arr, q);
  }
  const bool out_on_device = out_arr.has_value() && SpaceOf(*out_arr) == MemorySpace::kDevice;
  if (layer >= c.layout.num_layers) {
    throw nb::index_error(
        absl::StrFormat("layer %u outside %u layers", layer, c.layout.num_layers).c_str());
  }
  if (IsProjectionCodec(c.value_codec) && !projection.has_value()) {
    throw nb::value_error(absl::StrFormat("this cache's values are KVSplice-encoded: pass the "
                                          "projection it was encoded with (version %016x)",
                                          c.projection_version)
                              .c_str());
  }
  if (q.ndim() != 3 && q.ndim() != 2) {
    throw nb::value_error(
        "queries must be [q_heads, n_queries, head_dim] (or [q_heads, head_dim])");
  }
  const uint32_t hq = static_cast<uint32_t>(q.shape(0));
  const uint64_t nq = q.ndim() == 3 ? q.shape(1) : 1;
  const uint32_t d = static_cast<uint32_t>(q.shape(q.ndim() - 1));
  const KvLayout& L = c.layout;
  if (d != L.head_dim) {
    throw nb::value_error(
        absl::StrFormat("queries have head_dim %u, the cache %u", d, L.head_dim).c_str());
  }
  if (hq != L.num_q_heads && L.num_q_heads != 0) {
    throw nb::value_error(
        absl::StrFormat("queries have %u heads, the cache's layout %u q heads", hq, L.num_q_heads)
            .c_str());
  }
  std::vector<float> out(out_ptr != nullptr ? 0 : size_t{hq} * nq * d);
  if (out_ptr == nullptr) out_ptr = out.data();
  // Placing the layer on the call's backend, decoding and the correction: kvcomp::decode.
  decode::Decoder decoder(call.get());
  decode::AttendParams p;
  p.queries = HeadsView::Dense(q.data(), QueryDType(q), hq, nq, d, SpaceOf(q));
  p.layer = layer;
  p.correct = correct;
  p.scale = scale;
  p.expand_in_attention = expand_in_attention;
  p.out = out_ptr;
  p.out_space = out_on_device ? MemorySpace::kDevice : MemorySpace::kHost;
  absl::Status st;
  {
    nb::gil_scoped_release release;
    std::shared_ptr<const Projection> proj;
    if (IsProjectionCodec(c.value_codec)) proj = *projection;
    st = decode::AttendOnce(decoder, c, std::move(proj), p);
  }
  ThrowIfError(st);
  if (out_arr.has_value()) return nb::borrow(out_obj);
  return NumpyArray(std::move(out), {hq, static_cast<size_t>(nq), d});
}

}  // namespace

void RegisterMoments(nb::module_& m) {
  nb::handle cache = nb::type<CompressedCache>();
  nb::setattr(cache, "moments",
              nb::cpp_function(&Moments, nb::is_method(), nb::arg("layer"), nb::arg("head"),
                               nb::name("moments"), nb::scope(cache),
                               "MomentKV summary of (layer, kv head)'s evicted tokens: (count, "
                               "key_sum [d], value_sum [d], vk_sum [d, d] with [i, j] = sum v_i "
                               "k_j), fp32"));
  m.def("_attention", &Attention, nb::arg("q"), nb::arg("cache"), nb::arg("layer"),
        nb::arg("correct") = true, nb::arg("backend") = "cpu", nb::arg("scale") = 0.0f,
        nb::arg("out").none() = nb::none(), nb::arg("stream") = nb::none(),
        nb::arg("projection").none() = nb::none(), nb::arg("expand_in_attention") = false,
        "Decode attention of queries [q_heads, n_queries, head_dim] over `layer` of a "
        "compressed cache (kept tokens + the evicted set's virtual token when correct; "
        "KVSplice values attended over their latent codes with `projection`), -> float32 [q_heads, n_queries, head_dim] (`out` when given)");
}

}  // namespace python
}  // namespace kvcomp
