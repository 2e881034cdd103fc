// Python bindings of Engine II: CompressedCache.moments(layer, head) and the decode-side
// attention over a compressed cache, kvcomp.attention(q, cache, layer, correct=True) (exposed
// by the native module as _attention; kvcomp/__init__.py wraps it). Queries and `out` may be CUDA
// arrays (backend "cuda"), taken in and written on the call's stream (call_backend.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
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
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/moment_ops.h"

namespace nb = nanobind;

namespace kvcomp {
namespace python {
namespace {

template <typename T>
nb::object Owning(std::vector<T>&& data, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(data));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner).cast();
}

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
  return {c.moment_count[h], Owning(std::move(ks), {d}), Owning(std::move(vs), {d}),
          Owning(std::move(s), {d, d})};
}

DType QueryDType(const CallArray& q) {
  const auto dt = q.dtype();
  using C = nb::dlpack::dtype_code;
  if (dt.code == static_cast<uint8_t>(C::Float) && dt.bits == 32) return DType::kF32;
  if (dt.code == static_cast<uint8_t>(C::Float) && dt.bits == 16) return DType::kF16;
  if (dt.code == static_cast<uint8_t>(C::Bfloat) && dt.bits == 16) return DType::kBF16;
  throw nb::value_error("queries must be float32, float16 or bfloat16");
}

// Device memory of `bytes` bytes (at least 1), uninitialised.
Buffer DeviceBuffer(Backend& b, size_t bytes) {
  absl::StatusOr<Buffer> buf = Buffer::Allocate(b.allocator(), bytes == 0 ? 1 : bytes);
  ThrowIfError(buf.status());
  return std::move(*buf);
}

// Device copy of `bytes` host bytes.
Buffer Upload(Backend& b, const void* src, size_t bytes) {
  Buffer buf = DeviceBuffer(b, bytes);
  if (bytes > 0) ThrowIfError(b.CopyFromHost(buf.data(), src, bytes));
  return buf;
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
                     std::optional<uint64_t> stream) {
  const CallBackend call = CallBackend::Open(backend, CommonDevice({q_obj, out_obj}), stream);
  const CallArray q = ImportArray(q_obj, call, "queries");
  std::optional<CallArray> out_arr;
  float* out_ptr = nullptr;
  if (!out_obj.is_none()) {
    out_arr = ImportArray(out_obj, call, "out");
    out_ptr = OutputArray(*out_arr, q);
  }
  const bool q_on_device = SpaceOf(q) == MemorySpace::kDevice;
  const bool out_on_device = out_arr.has_value() && SpaceOf(*out_arr) == MemorySpace::kDevice;
  if (layer >= c.layout.num_layers) {
    throw nb::index_error(
        absl::StrFormat("layer %u outside %u layers", layer, c.layout.num_layers).c_str());
  }
  if (c.key_codec != KeyCodec::kRaw || c.value_codec != ValueCodec::kRaw) {
    throw nb::value_error("attention reads raw kept keys/values; decode this cache first");
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
  const uint32_t hk = L.num_kv_heads;
  const uint64_t h0 = c.head_index(layer, 0);
  const std::vector<uint64_t> all = c.TokenOffsets();
  std::vector<uint64_t> off(hk + 1);
  for (uint32_t h = 0; h <= hk; ++h) off[h] = all[h0 + h] - all[h0];
  const uint64_t row = c.KeyTokenBytes();
  const uint8_t* kp = c.keys.data() + all[h0] * row;
  const uint8_t* vp = c.values.data() + all[h0] * row;
  const bool moments = correct && c.has_moments;
  MomentsView mv;
  if (moments) {
    mv = MomentsView{const_cast<uint64_t*>(c.moment_count.data()) + h0,
                     const_cast<float*>(c.moment_key_sum.data()) + h0 * d,
                     const_cast<float*>(c.moment_value_sum.data()) + h0 * d,
                     const_cast<float*>(c.moment_vk_sum.data()) + h0 * d * d,
                     hk,
                     d,
                     MemorySpace::kHost};
  }
  std::vector<float> out(out_ptr != nullptr ? 0 : size_t{hq} * nq * d);
  if (out_ptr == nullptr) out_ptr = out.data();
  const size_t out_elems = size_t{hq} * nq * d;
  Backend* b = &call.get();
  const DType qt = QueryDType(q);
  AttentionParams p;
  p.queries = HeadsView::Dense(q.data(), qt, hq, nq, d);
  p.kv = RaggedKv{kp, vp, L.dtype, off.data(), hk, d};
  if (moments) p.moments = mv;
  p.correct = correct;
  p.scale = scale;
  p.out = out_ptr;
  absl::Status st;
  if (b->space() == MemorySpace::kHost) {
    nb::gil_scoped_release release;
    st = b->moments().Attention(p);
  } else {
    const size_t qbytes = DTypeBytes(qt, size_t{hq} * nq * d);
    Buffer dq, dk = Upload(*b, kp, (off[hk]) * row), dv = Upload(*b, vp, off[hk] * row),
               doff = Upload(*b, off.data(), off.size() * 8), dout;
    if (!q_on_device) dq = Upload(*b, q.data(), qbytes);
    if (!out_on_device) dout = DeviceBuffer(*b, out_elems * 4);
    Buffer dc, dks, dvs, ds;
    p.queries =
        HeadsView::Dense(q_on_device ? q.data() : dq.data(), qt, hq, nq, d, MemorySpace::kDevice);
    p.kv =
        RaggedKv{dk.data(), dv.data(), L.dtype, doff.as<uint64_t>(), hk, d, MemorySpace::kDevice};
    if (moments) {
      dc = Upload(*b, mv.count, hk * 8);
      dks = Upload(*b, mv.key_sum, size_t{hk} * d * 4);
      dvs = Upload(*b, mv.value_sum, size_t{hk} * d * 4);
      ds = Upload(*b, mv.vk_sum, size_t{hk} * d * d * 4);
      p.moments = ConstMomentsView(MomentsView{dc.as<uint64_t>(), dks.as<float>(), dvs.as<float>(),
                                               ds.as<float>(), hk, d, MemorySpace::kDevice});
    }
    p.out = out_on_device ? out_ptr : dout.as<float>();
    {
      nb::gil_scoped_release release;
      st = b->moments().Attention(p);
      // A device `out` is written in place on the call's stream; a host one is copied to.
      if (st.ok() && !out_on_device) st = b->CopyToHost(out_ptr, dout.data(), out_elems * 4);
    }
  }
  ThrowIfError(st);
  if (out_arr.has_value()) return nb::borrow(out_obj);
  return Owning(std::move(out), {hq, static_cast<size_t>(nq), d});
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
        "Decode attention of queries [q_heads, n_queries, head_dim] over `layer` of a "
        "compressed cache (kept tokens + the evicted set's virtual token when correct), "
        "-> float32 [q_heads, n_queries, head_dim] (`out` when given)");
}

}  // namespace python
}  // namespace kvcomp
