// Python bindings of the C++ SDK (kvcomp::client): kvcomp._kvcomp._Client and _PutStream. The
// Pythonic layer (kvcomp/client.py) wraps them; statuses become Python exceptions here.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bindings.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/policy.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"

namespace nb = nanobind;

namespace kvcomp {
namespace python {
namespace {

using client::Client;
using client::PutStream;

[[noreturn]] void Raise(const absl::Status& s) {
  ThrowIfError(s.ok() ? absl::InternalError("error without a status") : s);
  throw std::logic_error("unreachable");
}

// Runs `call` with the GIL released (the SDK's calls block on the network and the device) and
// returns what it returns.
template <typename Call>
auto WithoutGil(Call&& call) {
  nb::gil_scoped_release release;
  return call();
}

std::string KeyString(const nb::bytes& key) {
  return std::string(static_cast<const char*>(key.data()), key.size());
}

std::vector<std::string> KeyStrings(const std::vector<nb::bytes>& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const nb::bytes& k : keys) out.push_back(KeyString(k));
  return out;
}

// A read's per-call deadline from Python seconds (None: the client's). ValueError when not
// positive; the SDK checks the range.
client::ReadOptions Read(std::optional<double> timeout) {
  client::ReadOptions r;
  if (!timeout.has_value()) return r;
  if (!(*timeout > 0)) {
    Raise(absl::InvalidArgumentError(absl::StrCat("timeout must be positive seconds, got ",
                                                  *timeout)));
  }
  r.timeout = absl::Seconds(*timeout);
  return r;
}

// A CUDA stream handed in from Python as an integer (0: the default stream).
void* StreamPtr(uint64_t stream) { return reinterpret_cast<void*>(static_cast<uintptr_t>(stream)); }

using AnyArray = nb::ndarray<nb::device::cpu>;

// The dtype an array holds: float32, float16, bfloat16 (ml_dtypes), or uint16 holding bf16 bits
// when `dtype_hint` is "bf16".
DType ArrayDType(const AnyArray& a, const std::string& dtype_hint, const char* what) {
  const nb::dlpack::dtype t = a.dtype();
  if (t == nb::dtype<float>()) return DType::kF32;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) {
    return DType::kF16;
  }
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) {
    return DType::kBF16;
  }
  if (t == nb::dtype<uint16_t>() && dtype_hint == "bf16") return DType::kBF16;
  Raise(absl::InvalidArgumentError(absl::StrCat(
      what, ": unsupported array dtype (float32, float16, bfloat16, or uint16 with dtype='bf16')")));
}

bool CContiguous(const AnyArray& a) {
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

// Checks a [layers, kv_heads, tokens, head_dim] (or [kv_heads, tokens, head_dim] for one layer)
// array against the layout, and returns it as a base pointer.
const void* CheckLayerArray(const AnyArray& a, const KvLayout& layout, uint64_t tokens,
                            bool whole_cache, const char* what) {
  if (!CContiguous(a)) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(what, ": array is not C-contiguous (use numpy.ascontiguousarray)")));
  }
  std::vector<uint64_t> want;
  if (whole_cache) want.push_back(layout.num_layers);
  want.insert(want.end(), {layout.num_kv_heads, tokens, layout.head_dim});
  bool ok = a.ndim() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = static_cast<uint64_t>(a.shape(i)) == want[i];
  if (!ok) {
    std::string got = "(";
    for (size_t i = 0; i < a.ndim(); ++i) absl::StrAppend(&got, i ? ", " : "", a.shape(i));
    std::string exp = "(";
    for (size_t i = 0; i < want.size(); ++i) absl::StrAppend(&exp, i ? ", " : "", want[i]);
    Raise(absl::InvalidArgumentError(
        absl::StrCat(what, ": shape ", got, ") does not match the layout ", exp, ")")));
  }
  return a.data();
}

struct PyPutStream {
  std::unique_ptr<PutStream> stream;
  std::string dtype_hint;

  void Append(uint32_t layer, const AnyArray& keys, const AnyArray& values, uint64_t token_begin) {
    if (!stream) Raise(absl::FailedPreconditionError("put stream is closed"));
    const KvLayout& l = stream->layout();
    if (keys.ndim() != 3) {
      Raise(absl::InvalidArgumentError("keys: expected [kv_heads, tokens, head_dim]"));
    }
    const uint64_t n = keys.shape(1);
    if (ArrayDType(keys, dtype_hint, "keys") != l.dtype ||
        ArrayDType(values, dtype_hint, "values") != l.dtype) {
      Raise(absl::InvalidArgumentError(
          absl::StrCat("keys/values dtype differs from the put's ", DTypeName(l.dtype))));
    }
    const void* k = CheckLayerArray(keys, l, n, false, "keys");
    const void* v = CheckLayerArray(values, l, n, false, "values");
    ThrowIfError(WithoutGil([&] { return stream->Append(layer, token_begin, n, k, v); }));
  }
};

// A device put fed layer by layer (Client::OpenDevicePutStream).
struct PyDevicePutStream {
  std::unique_ptr<client::DevicePutStream> stream;
  KvLayout layout;
  uint64_t tokens = 0;
};

// A dense device get handed back layer by layer (Client::OpenDeviceGetStream).
struct PyDeviceGetStream {
  std::unique_ptr<client::DeviceGetStream> stream;
};

nb::dict PutResultDict(const client::PutResult& r);

nb::dict GetResultDict(const client::DeviceGetResult& g) {
  nb::dict d;
  d["bytes"] = g.bytes;
  d["path"] = g.path;
  d["transfer_seconds"] = g.transfer_seconds;
  return d;
}

nb::dict PutResultDict(const client::PutResult& r) {
  nb::dict d;
  d["original_bytes"] = r.original_bytes;
  d["stored_bytes"] = r.stored_bytes;
  d["total_kept"] = r.total_kept;
  d["endpoints"] = r.endpoints;
  if (!r.path.empty()) {
    d["path"] = r.path;
    d["transfer_seconds"] = r.transfer_seconds;
  }
  return d;
}

KvLayout MakeLayout(uint32_t layers, uint32_t kv_heads, uint32_t q_heads, uint32_t head_dim,
                    DType dtype);

// A CUDA array read or written in place by the device calls (from a DLPack capsule the Python
// layer made with the call's stream, so the producer's pending writes come first).
using CudaArray = nb::ndarray<nb::device::cuda, nb::c_contig>;

DType CudaDType(const CudaArray& a, const char* what) {
  const nb::dlpack::dtype t = a.dtype();
  if (t == nb::dtype<float>()) return DType::kF32;
  if (t.bits == 16 && t.lanes == 1) {
    if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float)) return DType::kF16;
    if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat)) return DType::kBF16;
  }
  Raise(absl::InvalidArgumentError(
      absl::StrCat(what, ": dtype unsupported on the device path (float32, float16, bfloat16)")));
}

// The layout of a [layers, kv_heads, tokens, head_dim] K/V pair on one device, and its tokens.
std::pair<KvLayout, uint64_t> CudaPairLayout(const CudaArray& k, const CudaArray& v,
                                             uint32_t q_heads) {
  if (k.ndim() != 4 || v.ndim() != 4) {
    Raise(absl::InvalidArgumentError("keys/values: expected [layers, kv_heads, tokens, head_dim]"));
  }
  for (size_t i = 0; i < 4; ++i) {
    if (k.shape(i) != v.shape(i)) Raise(absl::InvalidArgumentError("keys and values differ in shape"));
  }
  const DType dt = CudaDType(k, "keys");
  if (CudaDType(v, "values") != dt) {
    Raise(absl::InvalidArgumentError("keys and values have different dtypes"));
  }
  if (k.device_id() != v.device_id()) {
    Raise(absl::InvalidArgumentError("keys and values are on different CUDA devices"));
  }
  return {MakeLayout(static_cast<uint32_t>(k.shape(0)), static_cast<uint32_t>(k.shape(1)), q_heads,
                     static_cast<uint32_t>(k.shape(3)), dt),
          k.shape(2)};
}

KvLayout MakeLayout(uint32_t layers, uint32_t kv_heads, uint32_t q_heads, uint32_t head_dim,
                    DType dtype) {
  KvLayout l{layers, kv_heads, q_heads == 0 ? kv_heads : q_heads, head_dim, dtype};
  ThrowIfError(l.Validate());
  return l;
}

// Per-layer views into [layer][head][token][dim] arrays `k` and `v`: Layer is LayerData,
// DeviceLayerData or DeviceLayerOut, Byte const char or char.
template <typename Layer, typename Byte>
std::vector<Layer> LayerViews(Byte* k, Byte* v, const KvLayout& l, uint64_t tokens) {
  std::vector<Layer> layers;
  for (uint32_t i = 0; i < l.num_layers; ++i) {
    layers.push_back({k + i * l.LayerBytes(tokens), v + i * l.LayerBytes(tokens)});
  }
  return layers;
}

// A K/V pair of [layers, kv_heads, tokens, head_dim] CUDA arrays as the SDK's device calls take
// them: its layout, its tokens and per-layer views (Layer: DeviceLayerData or DeviceLayerOut).
template <typename Layer>
struct CudaPair {
  KvLayout layout;
  uint64_t tokens = 0;
  std::vector<Layer> layers;
};

template <typename Layer>
CudaPair<Layer> CudaPairViews(const CudaArray& keys, const CudaArray& values, uint32_t q_heads) {
  CudaPair<Layer> p;
  std::tie(p.layout, p.tokens) = CudaPairLayout(keys, values, q_heads);
  p.layers = LayerViews<Layer>(static_cast<char*>(keys.data()), static_cast<char*>(values.data()),
                               p.layout, p.tokens);
  return p;
}

// Commits the put of `p` (a PyPutStream or a PyDevicePutStream) and closes the stream.
template <typename PyStream>
nb::dict CommitPut(PyStream& p) {
  if (!p.stream) Raise(absl::FailedPreconditionError("put stream is closed"));
  absl::StatusOr<client::PutResult> r = WithoutGil([&] { return p.stream->Commit(); });
  p.stream.reset();
  return PutResultDict(Unwrap(std::move(r)));
}

// The fields every per-endpoint answer has: the endpoint, ok, and the error ("" when ok).
nb::dict EndpointDict(const std::string& endpoint, const absl::Status& status) {
  nb::dict d;
  d["endpoint"] = endpoint;
  d["ok"] = status.ok();
  d["error"] = status.ok() ? std::string() : status.ToString();
  return d;
}

}  // namespace

void RegisterClient(nb::module_& m) {
  nb::class_<PyPutStream>(m, "_PutStream")
      .def("append", &PyPutStream::Append, nb::arg("layer"), nb::arg("keys"), nb::arg("values"),
           nb::arg("token_begin") = 0)
      .def("commit", &CommitPut<PyPutStream>)
      .def("abort", [](PyPutStream& p) {
        if (!p.stream) return;
        absl::Status s = WithoutGil([&] { return p.stream->Abort(); });
        p.stream.reset();
        ThrowIfError(s);
      });

  nb::class_<PyDevicePutStream>(m, "_DevicePutStream")
      .def(
          "append_layer",
          [](PyDevicePutStream& p, uint32_t layer, const CudaArray& keys, const CudaArray& values,
             uint64_t stream) {
            if (!p.stream) Raise(absl::FailedPreconditionError("put stream is closed"));
            const KvLayout& l = p.layout;
            for (const CudaArray* a : {&keys, &values}) {
              if (a->ndim() != 3 || a->shape(0) != l.num_kv_heads || a->shape(1) != p.tokens ||
                  a->shape(2) != l.head_dim) {
                Raise(absl::InvalidArgumentError(absl::StrCat(
                    "keys/values: expected [", l.num_kv_heads, ", ", p.tokens, ", ", l.head_dim,
                    "] for each layer")));
              }
              if (CudaDType(*a, "keys/values") != l.dtype) {
                Raise(absl::InvalidArgumentError(
                    absl::StrCat("keys/values dtype differs from the put's ", DTypeName(l.dtype))));
              }
            }
            ThrowIfError(WithoutGil([&] {
              return p.stream->AppendLayer(layer, {keys.data(), values.data()}, StreamPtr(stream));
            }));
          },
          nb::arg("layer"), nb::arg("keys"), nb::arg("values"), nb::arg("stream") = 0)
      .def("commit", &CommitPut<PyDevicePutStream>)
      .def("close",
           [](PyDevicePutStream& p) {
             nb::gil_scoped_release release;
             p.stream.reset();  // an uncommitted put is aborted
           })
      .def_prop_ro(
          "path", [](PyDevicePutStream& p) { return p.stream ? p.stream->path() : std::string(); });

  nb::class_<PyDeviceGetStream>(m, "_DeviceGetStream")
      .def(
          "wait_layer",
          [](PyDeviceGetStream& p, uint32_t layer, uint64_t stream) {
            if (!p.stream) Raise(absl::FailedPreconditionError("get stream is finished"));
            ThrowIfError(p.stream->WaitLayer(layer, StreamPtr(stream)));
          },
          nb::arg("layer"), nb::arg("stream") = 0)
      .def("finish", [](PyDeviceGetStream& p) {
        if (!p.stream) Raise(absl::FailedPreconditionError("get stream is finished"));
        absl::StatusOr<client::DeviceGetResult> r = WithoutGil([&] { return p.stream->Finish(); });
        p.stream.reset();
        return GetResultDict(Unwrap(std::move(r)));
      });

  nb::class_<Client>(m, "_Client")
      .def_static(
          "connect",
          [](const std::vector<std::string>& endpoints, const std::string& tenant,
             const std::string& token, int replicas, double connect_timeout, double request_timeout,
             uint64_t max_block_bytes, const std::vector<std::pair<std::string, std::string>>& ucx,
             bool connect_now, const std::string& dns_server, double dns_refresh_interval,
             double lookup_timeout, double get_timeout) {
            client::ClientOptions o;
            o.tenant = tenant;
            o.token = token;
            o.replicas = replicas;
            if (!(connect_timeout > 0) || !(request_timeout > 0)) {
              Raise(absl::InvalidArgumentError("timeouts must be positive seconds"));
            }
            o.connect_timeout = absl::Seconds(connect_timeout);
            o.request_timeout = absl::Seconds(request_timeout);
            if (!(lookup_timeout > 0) || !(get_timeout > 0)) {
              Raise(absl::InvalidArgumentError(
                  "lookup_timeout and get_timeout must be positive seconds"));
            }
            o.lookup_timeout = absl::Seconds(lookup_timeout);
            o.get_timeout = absl::Seconds(get_timeout);
            o.max_block_bytes = max_block_bytes;
            o.ucx_overrides = ucx;
            o.dns_server = dns_server;
            if (!(dns_refresh_interval >= 0)) {
              Raise(absl::InvalidArgumentError("dns_refresh_interval must be seconds >= 0"));
            }
            o.dns_refresh_interval = absl::Seconds(dns_refresh_interval);
            return Unwrap(WithoutGil([&] { return Client::Connect(endpoints, o, connect_now); }))
                .release();
          },
          nb::arg("endpoints"), nb::arg("tenant") = "", nb::arg("token") = "",
          nb::arg("replicas") = 1, nb::arg("connect_timeout") = 5.0,
          nb::arg("request_timeout") = 60.0, nb::arg("max_block_bytes") = uint64_t{8} << 20,
          nb::arg("ucx") = std::vector<std::pair<std::string, std::string>>{},
          nb::arg("connect_now") = true, nb::arg("dns_server") = "",
          nb::arg("dns_refresh_interval") = 5.0, nb::arg("lookup_timeout") = 1.0,
          nb::arg("get_timeout") = 10.0, nb::rv_policy::take_ownership)
      .def(
          "put",
          [](Client& c, const std::string& model, nb::bytes key, const AnyArray& keys,
             const AnyArray& values, uint32_t q_heads,
             const std::optional<CompressionPolicy>& policy, const std::string& dtype_hint) {
            if (keys.ndim() != 4) {
              Raise(absl::InvalidArgumentError(
                  "keys: expected [layers, kv_heads, tokens, head_dim]"));
            }
            const DType dt = ArrayDType(keys, dtype_hint, "keys");
            if (ArrayDType(values, dtype_hint, "values") != dt) {
              Raise(absl::InvalidArgumentError("keys and values have different dtypes"));
            }
            const KvLayout l = MakeLayout(keys.shape(0), keys.shape(1), q_heads, keys.shape(3), dt);
            const uint64_t tokens = keys.shape(2);
            const char* k = static_cast<const char*>(CheckLayerArray(keys, l, tokens, true, "keys"));
            const char* v =
                static_cast<const char*>(CheckLayerArray(values, l, tokens, true, "values"));
            const auto layers = LayerViews<client::LayerData>(k, v, l, tokens);
            client::PutOptions po;
            po.policy = policy;
            const std::string key_s = KeyString(key);
            return PutResultDict(
                Unwrap(WithoutGil([&] { return c.Put(model, key_s, l, tokens, layers, po); })));
          },
          nb::arg("model"), nb::arg("key"), nb::arg("keys"), nb::arg("values"),
          nb::arg("q_heads") = 0, nb::arg("policy") = nb::none(), nb::arg("dtype") = "")
      .def(
          "put_device",
          [](Client& c, const std::string& model, nb::bytes key, const CudaArray& keys,
             const CudaArray& values, uint32_t q_heads,
             const std::optional<CompressionPolicy>& policy, uint64_t stream) {
            const auto in = CudaPairViews<client::DeviceLayerData>(keys, values, q_heads);
            client::PutOptions po;
            po.policy = policy;
            const std::string key_s = KeyString(key);
            return PutResultDict(Unwrap(WithoutGil([&] {
              return c.PutDevice(model, key_s, in.layout, in.tokens, in.layers, StreamPtr(stream),
                                 po);
            })));
          },
          nb::arg("model"), nb::arg("key"), nb::arg("keys"), nb::arg("values"),
          nb::arg("q_heads") = 0, nb::arg("policy") = nb::none(), nb::arg("stream") = 0)
      .def(
          "get_kv_into",
          [](Client& c, const std::string& model, nb::bytes key, CudaArray keys, CudaArray values,
             uint32_t q_heads, uint64_t stream) {
            const auto out = CudaPairViews<client::DeviceLayerOut>(keys, values, q_heads);
            const std::string key_s = KeyString(key);
            return GetResultDict(Unwrap(WithoutGil([&] {
              return c.GetKvIntoDevice(model, key_s, out.layout, out.tokens, out.layers,
                                       StreamPtr(stream));
            })));
          },
          nb::arg("model"), nb::arg("key"), nb::arg("keys"), nb::arg("values"),
          nb::arg("q_heads") = 0, nb::arg("stream") = 0)
      .def(
          "get_bytes_into",
          [](Client& c, const std::string& model, nb::bytes key, CudaArray out, bool decoded,
             uint64_t stream) {
            const size_t capacity = out.size() * out.itemsize();
            const std::string key_s = KeyString(key);
            return GetResultDict(Unwrap(WithoutGil([&] {
              return c.GetIntoDevice(model, key_s, out.data(), capacity, StreamPtr(stream),
                                     decoded);
            })));
          },
          nb::arg("model"), nb::arg("key"), nb::arg("out"), nb::arg("decoded") = false,
          nb::arg("stream") = 0)
      .def(
          "probe_gpu_channel",
          [](Client& c, const std::string& endpoint, int device) {
            absl::Status s = WithoutGil([&] { return c.ProbeGpuChannel(endpoint, device); });
            return s.ok() ? std::string() : s.ToString();
          },
          nb::arg("endpoint"), nb::arg("device") = 0)
      .def(
          "open_device_put_stream",
          [](Client& c, const std::string& model, nb::bytes key, uint32_t layers, uint32_t kv_heads,
             uint32_t q_heads, uint32_t head_dim, uint64_t tokens, const std::string& dtype,
             int device, const std::optional<CompressionPolicy>& policy) {
            const KvLayout l =
                MakeLayout(layers, kv_heads, q_heads, head_dim, Unwrap(ParseDType(dtype)));
            client::PutOptions po;
            po.policy = policy;
            const std::string key_s = KeyString(key);
            std::unique_ptr<client::DevicePutStream> s = Unwrap(WithoutGil(
                [&] { return c.OpenDevicePutStream(model, key_s, l, tokens, device, po); }));
            auto* p = new PyDevicePutStream;
            p->stream = std::move(s);
            p->layout = l;
            p->tokens = tokens;
            return p;
          },
          nb::arg("model"), nb::arg("key"), nb::arg("layers"), nb::arg("kv_heads"),
          nb::arg("q_heads"), nb::arg("head_dim"), nb::arg("tokens"), nb::arg("dtype"),
          nb::arg("device") = 0, nb::arg("policy") = nb::none(), nb::rv_policy::take_ownership)
      .def(
          "open_device_get_stream",
          [](Client& c, const std::string& model, nb::bytes key, CudaArray keys, CudaArray values,
             uint32_t q_heads, uint64_t stream) {
            const auto out = CudaPairViews<client::DeviceLayerOut>(keys, values, q_heads);
            const std::string key_s = KeyString(key);
            std::unique_ptr<client::DeviceGetStream> s = Unwrap(WithoutGil([&] {
              return c.OpenDeviceGetStream(model, key_s, out.layout, out.tokens, out.layers,
                                           StreamPtr(stream));
            }));
            auto* p = new PyDeviceGetStream;
            p->stream = std::move(s);
            return p;
          },
          nb::arg("model"), nb::arg("key"), nb::arg("keys"), nb::arg("values"),
          nb::arg("q_heads") = 0, nb::arg("stream") = 0, nb::rv_policy::take_ownership)
      .def("gpu_stats",
           [](Client& c) {
             const client::GpuChannelStats st = c.GpuStats();
             nb::dict d;
             d["nccl_puts"] = st.nccl_puts;
             d["nccl_gets"] = st.nccl_gets;
             d["fallback_puts"] = st.fallback_puts;
             d["fallback_gets"] = st.fallback_gets;
             d["ipc_puts"] = st.ipc_puts;
             d["ipc_gets"] = st.ipc_gets;
             d["channels_opened"] = st.channels_opened;
             d["channel_failures"] = st.channel_failures;
             d["last_fallback_reason"] = st.last_fallback_reason;
             return d;
           })
      .def(
          "open_put_stream",
          [](Client& c, const std::string& model, nb::bytes key, uint32_t layers, uint32_t kv_heads,
             uint32_t q_heads, uint32_t head_dim, uint64_t tokens, const std::string& dtype,
             const std::optional<CompressionPolicy>& policy, bool block_wise) {
            const DType dt = Unwrap(ParseDType(dtype));
            const KvLayout l = MakeLayout(layers, kv_heads, q_heads, head_dim, dt);
            client::PutOptions po;
            po.policy = policy;
            po.block_wise = block_wise;
            const std::string key_s = KeyString(key);
            std::unique_ptr<PutStream> s =
                Unwrap(WithoutGil([&] { return c.OpenPutStream(model, key_s, l, tokens, po); }));
            auto* p = new PyPutStream;
            p->stream = std::move(s);
            p->dtype_hint = dtype;
            return p;
          },
          nb::arg("model"), nb::arg("key"), nb::arg("layers"), nb::arg("kv_heads"),
          nb::arg("q_heads"), nb::arg("head_dim"), nb::arg("tokens"), nb::arg("dtype"),
          nb::arg("policy") = nb::none(), nb::arg("block_wise") = false,
          nb::rv_policy::take_ownership)
      .def(
          "get_bytes",
          [](Client& c, const std::string& model, nb::bytes key, std::optional<double> timeout) {
            const std::string key_s = KeyString(key);
            const client::ReadOptions r = Read(timeout);
            std::string s = Unwrap(WithoutGil([&] { return c.GetBytes(model, key_s, r); }));
            return nb::bytes(s.data(), s.size());
          },
          nb::arg("model"), nb::arg("key"), nb::arg("timeout") = nb::none())
      .def(
          "get",
          [](Client& c, const std::string& model, nb::bytes key, bool decoded,
             std::optional<double> timeout) {
            const std::string key_s = KeyString(key);
            const client::ReadOptions r = Read(timeout);
            return Unwrap(WithoutGil([&] {
              return decoded ? c.GetDecoded(model, key_s, r) : c.Get(model, key_s, r);
            }));
          },
          nb::arg("model"), nb::arg("key"), nb::arg("decoded") = false,
          nb::arg("timeout") = nb::none())
      .def(
          "lookup",
          [](Client& c, const std::string& model, nb::bytes key, std::optional<double> timeout) {
            const std::string key_s = KeyString(key);
            const client::ReadOptions r = Read(timeout);
            const client::LookupResult l =
                Unwrap(WithoutGil([&] { return c.Lookup(model, key_s, r); }));
            nb::dict d;
            d["endpoint"] = l.endpoint;
            d["tier"] = l.tier;
            d["layers"] = l.layout.num_layers;
            d["kv_heads"] = l.layout.num_kv_heads;
            d["q_heads"] = l.layout.num_q_heads;
            d["head_dim"] = l.layout.head_dim;
            d["dtype"] = std::string(DTypeName(l.layout.dtype));
            d["original_tokens"] = l.original_tokens;
            d["total_kept"] = l.total_kept;
            d["original_bytes"] = l.original_bytes;
            d["stored_bytes"] = l.stored_bytes;
            d["key_codec"] = std::string(KeyCodecName(l.key_codec));
            d["value_codec"] = std::string(ValueCodecName(l.value_codec));
            return d;
          },
          nb::arg("model"), nb::arg("key"), nb::arg("timeout") = nb::none())
      .def(
          "delete",
          [](Client& c, const std::string& model, nb::bytes key) {
            const std::string key_s = KeyString(key);
            ThrowIfError(WithoutGil([&] { return c.Delete(model, key_s); }));
          },
          nb::arg("model"), nb::arg("key"))
      .def("stats",
           [](Client& c) {
             std::vector<client::EndpointStats> st = WithoutGil([&] { return c.Stats(); });
             nb::list out;
             for (const auto& s : st) {
               nb::dict d = EndpointDict(s.endpoint, s.status);
               d["caches"] = s.caches;
               d["original_bytes"] = s.original_bytes;
               d["stored_bytes"] = s.stored_bytes;
               d["queue_depth"] = s.queue_depth;
               out.append(d);
             }
             return out;
           })
      .def(
          "calibrate",
          [](Client& c, const std::string& model, const std::string& value_codec, uint32_t rank,
             double error_budget, uint32_t max_caches, uint32_t key_bits, uint32_t value_bits) {
            client::CalibrateOptions o;
            o.value_codec = value_codec;
            o.rank = rank;
            o.error_budget = error_budget;
            o.max_caches = max_caches;
            o.key_bits = key_bits;
            o.value_bits = value_bits;
            absl::StatusOr<std::vector<client::CalibrateResult>> r =
                WithoutGil([&] { return c.Calibrate(model, o); });
            ThrowIfError(r.status());
            nb::list out;
            for (const auto& e : *r) {
              nb::dict d = EndpointDict(e.endpoint, e.status);
              d["projection_version"] = e.projection_version;
              d["rank"] = e.rank;
              d["layer_ranks"] = e.layer_ranks;
              d["achieved_error"] = e.achieved_error;
              d["caches_used"] = e.caches_used;
              out.append(d);
            }
            return out;
          },
          nb::arg("model"), nb::arg("value_codec"), nb::arg("rank"), nb::arg("error_budget"),
          nb::arg("max_caches"), nb::arg("key_bits") = 3, nb::arg("value_bits") = 2)
      .def(
          "lookup_prefix",
          [](Client& c, const std::string& model, const std::vector<nb::bytes>& keys,
             std::optional<double> timeout) {
            const std::vector<std::string> ks = KeyStrings(keys);
            const client::ReadOptions r = Read(timeout);
            return Unwrap(WithoutGil([&] { return c.LookupPrefix(model, ks, r); }));
          },
          nb::arg("model"), nb::arg("keys"), nb::arg("timeout") = nb::none())
      .def(
          "get_chunk_bytes",
          [](Client& c, const std::string& model, const std::vector<nb::bytes>& keys,
             bool decoded, std::optional<double> timeout) {
            const std::vector<std::string> ks = KeyStrings(keys);
            const client::ReadOptions ro = Read(timeout);
            absl::StatusOr<std::vector<std::string>> r =
                WithoutGil([&] { return c.GetChunkBytes(model, ks, decoded, ro); });
            nb::list out;
            for (const std::string& b : Unwrap(std::move(r))) {
              out.append(nb::bytes(b.data(), b.size()));
            }
            return out;
          },
          nb::arg("model"), nb::arg("keys"), nb::arg("decoded") = false,
          nb::arg("timeout") = nb::none())
      .def(
          "get_chunks",
          [](Client& c, const std::string& model, const std::vector<nb::bytes>& keys,
             bool decoded, std::optional<double> timeout) {
            const std::vector<std::string> ks = KeyStrings(keys);
            const client::ReadOptions r = Read(timeout);
            return Unwrap(WithoutGil([&] { return c.GetChunks(model, ks, decoded, r); }));
          },
          nb::arg("model"), nb::arg("keys"), nb::arg("decoded") = false,
          nb::arg("timeout") = nb::none())
      .def(
          "ranking",
          [](Client& c, const std::string& model, nb::bytes key) {
            return c.Ranking(model, KeyString(key));
          },
          nb::arg("model"), nb::arg("key"));
}

}  // namespace python
}  // namespace kvcomp
