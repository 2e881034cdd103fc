// Python bindings of Engine III (KVSplice): kvcomp.Projection, and the native halves of
// kvcomp.calibrate, kvcomp.compress(..., projection=) and kvcomp.decompress (kvcomp/__init__.py
// wraps them). Calibration arrays come in as C-contiguous float32 NumPy arrays (the Python side
// converts) or, with backend "cuda", as CUDA arrays of any float dtype read in place on the call's
// stream (call_backend.h); outputs are NumPy arrays that own copies.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bindings.h"
#include "call_backend.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/projection.h"

namespace nb = nanobind;

namespace kvcomp {
namespace python {
namespace {

// A [layers, heads, tokens, head_dim] calibration array: float32 on the host (the Python side
// converts), float32/float16/bfloat16 on a CUDA device.
struct CalArray {
  CallArray a;
  DType dtype = DType::kF32;
  uint64_t shape(size_t i) const { return a.shape(i); }
};

CalArray ImportCalArray(nb::handle obj, const CallBackend& call, const char* what) {
  CalArray c{ImportArray(obj, call, what)};
  const nb::dlpack::dtype dt = c.a.dtype();
  using C = nb::dlpack::dtype_code;
  if (dt == nb::dtype<float>()) {
    c.dtype = DType::kF32;
  } else if (SpaceOf(c.a) == MemorySpace::kDevice && dt.code == static_cast<uint8_t>(C::Float) &&
             dt.bits == 16) {
    c.dtype = DType::kF16;
  } else if (SpaceOf(c.a) == MemorySpace::kDevice && dt.code == static_cast<uint8_t>(C::Bfloat) &&
             dt.bits == 16) {
    c.dtype = DType::kBF16;
  } else {
    throw nb::value_error(absl::StrFormat("calibrate: %s must be float32 (CUDA arrays: float32, "
                                          "float16 or bfloat16)",
                                          what)
                              .c_str());
  }
  if (c.a.ndim() != 4) {
    throw nb::value_error(
        absl::StrFormat("calibrate: %s must be [layers, kv_heads, tokens, head_dim]", what)
            .c_str());
  }
  return c;
}

HeadsView LayerView(const CalArray& c, uint64_t layer) {
  const uint64_t h = c.a.shape(1), t = c.a.shape(2), d = c.a.shape(3);
  return HeadsView::Dense(
      static_cast<const char*>(c.a.data()) + DTypeBytes(c.dtype, layer * h * t * d), c.dtype,
      static_cast<uint32_t>(h), t, static_cast<uint32_t>(d), SpaceOf(c.a));
}

std::vector<CalArray> ImportCalArrays(const std::vector<nb::object>& objs, const CallBackend& call,
                                      const char* what) {
  std::vector<CalArray> out;
  for (const nb::object& o : objs) out.push_back(ImportCalArray(o, call, what));
  return out;
}

int DeviceOfAll(const std::vector<nb::object>& a, const std::vector<nb::object>& b,
                const std::vector<nb::object>& c) {
  std::vector<nb::handle> all(a.begin(), a.end());
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());
  return CommonDevice(all);
}

using ProjectionPtr = std::shared_ptr<Projection>;

ProjectionPtr Calibrate(const std::vector<nb::object>& value_objs,
                        const std::vector<nb::object>& key_objs,
                        const std::vector<nb::object>& query_objs, uint32_t rank, double budget,
                        const std::string& metric, const std::string& codec, uint32_t group_size,
                        bool gamma_aware, const std::string& model_id, const std::string& backend,
                        uint32_t max_samples, uint32_t max_queries, uint64_t seed,
                        std::optional<uint64_t> stream) {
  if (value_objs.empty()) throw nb::value_error("calibrate: no values given");
  if (!key_objs.empty() && key_objs.size() != value_objs.size()) {
    throw nb::value_error("calibrate: give keys for every values array, or none");
  }
  if (rank != 0 && budget > 0)
    throw nb::value_error("calibrate: give rank or error_budget, not both");
  const CallBackend call =
      CallBackend::Open(backend, DeviceOfAll(value_objs, key_objs, query_objs), stream);
  const std::vector<CalArray> values = ImportCalArrays(value_objs, call, "values");
  const std::vector<CalArray> keys = ImportCalArrays(key_objs, call, "keys");
  const std::vector<CalArray> queries = ImportCalArrays(query_objs, call, "queries");
  for (const CalArray& q : queries) {
    if (SpaceOf(q.a) != MemorySpace::kHost) {
      throw nb::value_error("calibrate: queries must be host arrays");
    }
  }
  if (budget > 0 && SpaceOf(values[0].a) == MemorySpace::kDevice) {
    // The auto-tuner measures its error on host samples, which device inputs do not leave.
    throw nb::value_error(
        "calibrate: error_budget tunes on host samples; pass host arrays, or a rank, for CUDA "
        "arrays");
  }
  const CalArray& first = values[0];
  CalibrationOptions opt;
  opt.model_id = model_id;
  opt.num_layers = static_cast<uint32_t>(first.shape(0));
  opt.num_kv_heads = static_cast<uint32_t>(first.shape(1));
  opt.head_dim = static_cast<uint32_t>(first.shape(3));
  opt.max_samples_per_head = max_samples;
  opt.max_queries_per_head = max_queries;
  opt.seed = seed;
  auto cal = Unwrap(Calibrator::Create(opt, &call.get()));
  auto same_shape = [&](const CalArray& a) {
    return a.shape(0) == first.shape(0) && a.shape(1) == first.shape(1) &&
           a.shape(3) == first.shape(3);
  };
  absl::StatusOr<Projection> result;
  {
    nb::gil_scoped_release release;
    result = [&]() -> absl::StatusOr<Projection> {
      for (size_t i = 0; i < values.size(); ++i) {
        if (!same_shape(values[i]) ||
            (!keys.empty() && (keys[i].shape(2) != values[i].shape(2) || !same_shape(keys[i])))) {
          return absl::InvalidArgumentError(
              "calibrate: every array must be [layers, kv_heads, tokens, head_dim] of the same "
              "layers, kv heads and head_dim (keys: the same tokens as their values)");
        }
        for (uint64_t l = 0; l < opt.num_layers; ++l) {
          HeadsView kv;
          if (!keys.empty()) kv = LayerView(keys[i], l);
          KVCOMP_RETURN_IF_ERROR(cal.AddLayer(static_cast<uint32_t>(l), LayerView(values[i], l),
                                              keys.empty() ? nullptr : &kv));
        }
      }
      for (const CalArray& q : queries) {
        if (q.shape(0) != opt.num_layers || q.shape(3) != opt.head_dim) {
          return absl::InvalidArgumentError("calibrate: queries must be [layers, q_heads, n, d]");
        }
        for (uint64_t l = 0; l < opt.num_layers; ++l) {
          KVCOMP_RETURN_IF_ERROR(cal.AddQueries(static_cast<uint32_t>(l), LayerView(q, l)));
        }
      }
      if (budget <= 0) return cal.Finish(rank != 0 ? rank : opt.head_dim);
      TuneOptions t;
      t.budget = budget;
      KVCOMP_ASSIGN_OR_RETURN(t.metric, ParseErrorMetric(metric));
      KVCOMP_ASSIGN_OR_RETURN(t.codec, ParseValueCodec(codec));
      t.group_size = group_size;
      t.gamma_aware = gamma_aware;
      KVCOMP_ASSIGN_OR_RETURN(TuneResult r, AutoTune(cal, t));
      return std::move(r.projection);
    }();
  }
  return std::make_shared<Projection>(Unwrap(std::move(result)));
}

using PqPtr = std::shared_ptr<pq::Calibration>;

const pq::Calibration* PqOf(const std::optional<PqPtr>& p) {
  return p.has_value() ? p->get() : nullptr;
}

// kvcomp.calibrate_pq: keys and values [layers, kv_heads, n, head_dim] float32 (C-contiguous;
// the Python side converts and concatenates).
PqPtr CalibratePq(nb::ndarray<const float, nb::ndim<4>, nb::c_contig, nb::device::cpu> keys,
                  nb::ndarray<const float, nb::ndim<4>, nb::c_contig, nb::device::cpu> values,
                  uint32_t key_bits, uint32_t value_bits, const std::string& model_id) {
  for (int i = 0; i < 4; ++i) {
    if (keys.shape(i) != values.shape(i)) {
      throw nb::value_error("calibrate_pq: keys and values must have the same shape");
    }
  }
  const uint64_t n = keys.shape(2);
  absl::StatusOr<pq::Calibration> c;
  {
    nb::gil_scoped_release release;
    c = pq::FitCalibration(absl::MakeConstSpan(keys.data(), keys.size()),
                           absl::MakeConstSpan(values.data(), values.size()), n,
                           static_cast<uint32_t>(keys.shape(0)),
                           static_cast<uint32_t>(keys.shape(1)),
                           static_cast<uint32_t>(keys.shape(3)), key_bits, value_bits);
  }
  pq::Calibration out = Unwrap(std::move(c));
  out.model_id = model_id;
  return std::make_shared<pq::Calibration>(std::move(out));
}

CompressedCache EncodeKeptPy(const CompressedCache& cache, const CompressionPolicy& policy,
                             std::optional<ProjectionPtr> projection, const std::string& backend,
                             std::optional<uint64_t> stream, std::optional<PqPtr> pq) {
  const CallBackend call = CallBackend::Open(backend, -1, stream);
  Backend* be = &call.get();
  CompressedCache out = cache;
  absl::Status s;
  {
    nb::gil_scoped_release release;
    s = EncodeKept(*be, policy, projection.has_value() ? projection->get() : nullptr, &out,
                   PqOf(pq));
  }
  ThrowIfError(s);
  out.policy = policy;
  return out;
}

CompressionPolicy RawCodecs(const CompressionPolicy& p) {
  CompressionPolicy r = p;
  r.key_codec = KeyCodec::kRaw;
  r.value_codec = ValueCodec::kRaw;
  r.rank = 0;
  return r;
}

// (keys [total_kept, d] f32, values [total_kept, d] f32, offsets [heads + 1])
nb::tuple Decompress(const CompressedCache& cache, std::optional<ProjectionPtr> projection,
                     const std::string& backend, std::optional<uint64_t> stream,
                     std::optional<PqPtr> pq) {
  const CallBackend call = CallBackend::Open(backend, -1, stream);
  Backend* be = &call.get();
  absl::StatusOr<DecodedKept> d;
  {
    nb::gil_scoped_release release;
    d = DecodeKept(*be, cache, projection.has_value() ? projection->get() : nullptr, DType::kF32,
                   PqOf(pq));
  }
  DecodedKept k = Unwrap(std::move(d));
  const size_t total = k.offsets.back(), dim = k.layout.head_dim;
  std::vector<float> keys(total * dim), values(total * dim);
  if (total > 0) {
    std::memcpy(keys.data(), k.keys.data(), keys.size() * 4);
    std::memcpy(values.data(), k.values.data(), values.size() * 4);
  }
  return nb::make_tuple(NumpyArray(std::move(keys), {total, dim}),
                        NumpyArray(std::move(values), {total, dim}),
                        NumpyArray(std::move(k.offsets), {k.layout.num_heads_total() + 1}));
}

// Decodes into the caller's arrays (`keys`, `values`: total_kept x head_dim elements each, one
// float dtype, C-contiguous), host arrays with backend "cpu", CUDA arrays with "cuda": there the
// encoded arrays go up on the call's stream and the rows are decoded in place.
void DecompressInto(const CompressedCache& cache, std::optional<ProjectionPtr> projection,
                    nb::handle keys_obj, nb::handle values_obj, const std::string& backend,
                    std::optional<uint64_t> stream, std::optional<PqPtr> pq) {
  const CallBackend call =
      CallBackend::Open(backend, CommonDevice({keys_obj, values_obj}), stream);
  const CallArray keys = ImportArray(keys_obj, call, "keys");
  const CallArray values = ImportArray(values_obj, call, "values");
  const DType dtype = CallArrayDType(keys);
  if (CallArrayDType(values) != dtype) {
    throw nb::value_error("keys and values must have the same dtype");
  }
  const MemorySpace space = call.get().space();
  if (SpaceOf(keys) != space || SpaceOf(values) != space) {
    throw nb::value_error(call.cuda() ? "with backend \"cuda\" the arrays must be CUDA arrays"
                                      : "with backend \"cpu\" the arrays must be host arrays");
  }
  const uint64_t elems = cache.total_kept() * cache.layout.head_dim;
  if (keys.size() != elems || values.size() != elems) {
    throw nb::value_error(absl::StrFormat(
                              "keys and values must hold total_kept x head_dim = %u elements "
                              "each, got %u and %u",
                              elems, keys.size(), values.size())
                              .c_str());
  }
  absl::Status s;
  {
    nb::gil_scoped_release release;
    s = DecodeKeptInto(call.get(), cache, projection.has_value() ? projection->get() : nullptr,
                       dtype, const_cast<void*>(keys.data()), const_cast<void*>(values.data()),
                       PqOf(pq));
  }
  ThrowIfError(s);
}

// A pq basis in its byte format (docs/format.md, KVPQ).
nb::bytes BasisBytes(const pq::Basis& basis) {
  const std::string b = basis.Serialize();
  return nb::bytes(b.data(), b.size());
}

}  // namespace

void RegisterCodec(nb::module_& m) {
  nb::class_<Projection>(m, "Projection",
                         "A calibrated KVSplice projection (kvcomp.calibrate): per (layer, kv "
                         "head) orthonormal value directions, eigenvalues and gamma scales.")
      .def_prop_ro("version", [](const Projection& p) { return p.version; })
      .def_prop_ro("model_id", [](const Projection& p) { return p.model_id; })
      .def_prop_ro("num_layers", [](const Projection& p) { return p.num_layers; })
      .def_prop_ro("num_kv_heads", [](const Projection& p) { return p.num_kv_heads; })
      .def_prop_ro("head_dim", [](const Projection& p) { return p.head_dim; })
      .def_prop_ro(
          "rank", [](const Projection& p) { return p.rows; },
          "basis rows kept per head: the largest rank a cache can use")
      .def_prop_ro("samples", [](const Projection& p) { return p.samples; })
      .def_prop_ro(
          "tuned_rank", [](const Projection& p) { return p.tuned_rank; },
          "per layer, the auto-tuner's rank (empty unless error_budget was given)")
      .def_prop_ro(
          "tuned_error", [](const Projection& p) { return p.tuned_error; },
          "per layer, the error the auto-tuner measured at that rank")
      .def_prop_ro("basis",
                   [](const Projection& p) {
                     std::vector<float> b = p.basis;
                     return NumpyArray(std::move(b),
                                       {p.num_layers, p.num_kv_heads, p.rows, p.head_dim});
                   })
      .def_prop_ro("eigenvalues",
                   [](const Projection& p) {
                     std::vector<float> e = p.eigenvalues;
                     return NumpyArray(std::move(e), {p.num_layers, p.num_kv_heads, p.head_dim});
                   })
      .def_prop_ro("gamma",
                   [](const Projection& p) {
                     std::vector<float> g = p.gamma;
                     return NumpyArray(std::move(g), {p.num_layers, p.num_kv_heads, p.rows});
                   })
      .def("to_bytes",
           [](const Projection& p) {
             const std::string s = p.Serialize();
             return nb::bytes(s.data(), s.size());
           })
      .def_static("from_bytes",
                  [](nb::bytes b) {
                    return std::make_shared<Projection>(
                        Unwrap(Projection::Parse(absl::string_view(b.c_str(), b.size()))));
                  })
      .def(
          "truncated",
          [](const Projection& p, uint32_t rank) {
            return std::make_shared<Projection>(Unwrap(p.Truncated(rank)));
          },
          nb::arg("rank"))
      .def("__repr__", &Projection::DebugString);

  nb::class_<pq::Calibration>(
      m, "PqCalibration",
      "A model's pq calibration (kvcomp.calibrate_pq): the calibrated basis codec's keys' and "
      "values' bases per (layer, kv head), fitted at key_bits / value_bits per element.")
      .def_prop_ro("version", [](const pq::Calibration& c) { return c.version; })
      .def_prop_ro("model_id", [](const pq::Calibration& c) { return c.model_id; })
      .def_prop_ro("key_bits", &pq::Calibration::key_bits)
      .def_prop_ro("value_bits", &pq::Calibration::value_bits)
      .def_prop_ro("num_layers", [](const pq::Calibration& c) { return c.keys.num_layers; })
      .def_prop_ro("num_kv_heads", [](const pq::Calibration& c) { return c.keys.num_kv_heads; })
      .def_prop_ro("head_dim", [](const pq::Calibration& c) { return c.keys.head_dim; })
      .def_prop_ro("key_fingerprint", [](const pq::Calibration& c) { return c.key_fingerprint; })
      .def_prop_ro("value_fingerprint",
                   [](const pq::Calibration& c) { return c.value_fingerprint; })
      .def_prop_ro(
          "key_basis", [](const pq::Calibration& c) { return BasisBytes(c.keys); },
          "the keys' basis in its byte format (docs/format.md, KVPQ)")
      .def_prop_ro(
          "value_basis", [](const pq::Calibration& c) { return BasisBytes(c.values); },
          "the values' basis in its byte format (docs/format.md, KVPQ)")
      .def("to_bytes",
           [](const pq::Calibration& c) {
             const std::string s = c.Serialize();
             return nb::bytes(s.data(), s.size());
           })
      .def_static("from_bytes",
                  [](nb::bytes b) {
                    return std::make_shared<pq::Calibration>(Unwrap(
                        pq::Calibration::Parse(absl::string_view(b.c_str(), b.size()))));
                  })
      .def("__repr__", [](const pq::Calibration& c) {
        return absl::StrFormat(
            "PqCalibration(version=%016x, k%uv%u, %u layers x %u kv heads x dim %u)", c.version,
            c.key_bits(), c.value_bits(), c.keys.num_layers, c.keys.num_kv_heads,
            c.keys.head_dim);
      });
  m.def("_calibrate_pq", &CalibratePq, nb::arg("keys"), nb::arg("values"), nb::arg("key_bits"),
        nb::arg("value_bits"), nb::arg("model_id"));
  m.def("_calibrate", &Calibrate, nb::arg("values"), nb::arg("keys"), nb::arg("queries"),
        nb::arg("rank"), nb::arg("budget"), nb::arg("metric"), nb::arg("codec"),
        nb::arg("group_size"), nb::arg("gamma_aware"), nb::arg("model_id"), nb::arg("backend"),
        nb::arg("max_samples"), nb::arg("max_queries"), nb::arg("seed"),
        nb::arg("stream") = nb::none());
  m.def("_encode_kept", &EncodeKeptPy, nb::arg("cache"), nb::arg("policy"),
        nb::arg("projection").none(), nb::arg("backend"), nb::arg("stream") = nb::none(),
        nb::arg("pq") = nb::none());
  m.def("_raw_codecs", &RawCodecs, nb::arg("policy"));
  m.def("_decompress", &Decompress, nb::arg("cache"), nb::arg("projection").none(),
        nb::arg("backend"), nb::arg("stream") = nb::none(), nb::arg("pq") = nb::none());
  m.def("_decompress_into", &DecompressInto, nb::arg("cache"), nb::arg("projection").none(),
        nb::arg("keys"), nb::arg("values"), nb::arg("backend"), nb::arg("stream") = nb::none(),
        nb::arg("pq") = nb::none());
  m.def("_cache_codecs", [](const CompressedCache& c) {
    nb::dict d;
    d["key_codec"] = std::string(KeyCodecName(c.key_codec));
    d["value_codec"] = std::string(ValueCodecName(c.value_codec));
    d["rank"] = c.rank;
    d["layer_rank"] =
        c.layer_rank.empty() ? std::vector<uint32_t>(c.layout.num_layers, c.rank) : c.layer_rank;
    d["group_size"] = c.ValueGroups() > 0 ? c.group_size : 0;
    d["gamma_aware"] = c.value_gamma;
    d["raw_value_rows"] = c.raw_value_rows.size();
    d["projection_version"] = c.projection_version;
    d["pq_key_bits"] = c.pq_key_bits;
    d["pq_value_bits"] = c.pq_value_bits;
    d["pq_key_basis"] = c.pq_key_basis;
    d["pq_value_basis"] = c.pq_value_basis;
    const CacheBytes b = c.Breakdown();
    nb::dict bytes;
    bytes["header"] = b.header;
    bytes["positions"] = b.positions;
    bytes["keys"] = b.keys;
    bytes["key_scales"] = b.key_scales;
    bytes["values"] = b.values;
    bytes["value_scales"] = b.value_scales;
    bytes["raw_values"] = b.raw_values;
    bytes["moments"] = b.moments;
    bytes["total"] = b.total();
    d["bytes"] = bytes;
    return d;
  });
}

}  // namespace python
}  // namespace kvcomp
