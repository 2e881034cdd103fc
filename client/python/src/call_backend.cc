#include "call_backend.h"

#include <nanobind/stl/string.h>

#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "bindings.h"

#ifdef KVCOMP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nb = nanobind;

namespace kvcomp {
namespace python {
namespace {

// DLPack device types (dlpack.h DLDeviceType) kvcomp reads.
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLCUDAHost = 3;
constexpr int kDLCUDAManaged = 13;

[[noreturn]] void ValueError(const std::string& msg) { throw nb::value_error(msg.c_str()); }

#ifdef KVCOMP_HAVE_CUDA
void CheckCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(absl::StrFormat("%s: %s", what, cudaGetErrorString(err)));
}

// The stream a number names (the numbering DLPack and __cuda_array_interface__ share).
cudaStream_t StreamOfNumber(uint64_t s) {
  if (s == 0 || s == 1) return cudaStreamLegacy;
  if (s == 2) return cudaStreamPerThread;
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s));
}

// Per thread, kept for its life (never freed: freeing may synchronise the device, and at exit
// the CUDA runtime may already be gone).
struct ThreadCuda {
  std::map<int, cudaStream_t> own_stream;                    // per device
  std::map<std::pair<int, cudaStream_t>, Backend*> backend;  // per (device, stream)
};
ThreadCuda& ThisThread() {
  thread_local ThreadCuda* t = new ThreadCuda();
  return *t;
}

int PointerDevice(const void* p) {
  cudaPointerAttributes attr{};
  CheckCuda(cudaPointerGetAttributes(&attr, p), "__cuda_array_interface__ pointer");
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    ValueError("__cuda_array_interface__: the pointer is not device memory");
  }
  return attr.device;
}

// Restores the thread's current CUDA device on scope exit (frameworks read it).
class DeviceGuard {
 public:
  DeviceGuard() {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};
#endif  // KVCOMP_HAVE_CUDA

bool HasAttr(nb::handle obj, const char* name) { return nb::hasattr(obj, name); }

bool CContiguous(const CallArray& a) {
  for (size_t i = 0; i < a.ndim(); ++i) {
    if (a.shape(i) == 0) return true;  // empty: any strides
  }
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

// __cuda_array_interface__ (v2/v3): the array in place, the call's stream ordered after the
// "stream" it names.
CallArray FromCudaArrayInterface(nb::handle obj, const CallBackend& call, const char* what) {
#ifdef KVCOMP_HAVE_CUDA
  nb::dict d = nb::cast<nb::dict>(obj.attr("__cuda_array_interface__"));
  nb::tuple data = nb::cast<nb::tuple>(d["data"]);
  const uintptr_t ptr = nb::cast<uintptr_t>(data[0]);
  nb::tuple shape_t = nb::cast<nb::tuple>(d["shape"]);
  std::vector<size_t> shape;
  for (nb::handle s : shape_t) shape.push_back(nb::cast<size_t>(s));
  const std::string typestr = nb::cast<std::string>(d["typestr"]);
  using C = nb::dlpack::dtype_code;
  nb::dlpack::dtype dt{};
  if (typestr.size() == 3 && typestr[2] == '4' && typestr[1] == 'f') {
    dt = {static_cast<uint8_t>(C::Float), 32, 1};
  } else if (typestr.size() == 3 && typestr[2] == '2' && typestr[1] == 'f') {
    dt = {static_cast<uint8_t>(C::Float), 16, 1};
  } else if (typestr.size() == 3 && typestr[2] == '2' && typestr[1] == 'u') {
    dt = {static_cast<uint8_t>(C::UInt), 16, 1};
  } else {
    ValueError(absl::StrFormat("%s: __cuda_array_interface__ typestr %s is not <f4, <f2 or <u2",
                               what, typestr));
  }
  if (typestr[0] == '>')
    ValueError(absl::StrFormat("%s: big-endian arrays are not supported", what));
  if (d.contains("strides") && !d["strides"].is_none()) {
    nb::tuple st = nb::cast<nb::tuple>(d["strides"]);
    int64_t expect = dt.bits / 8;
    for (size_t i = shape.size(); i-- > 0;) {
      if (shape[i] != 1 && nb::cast<int64_t>(st[i]) != expect) {
        ValueError(absl::StrFormat("%s: array is not C-contiguous", what));
      }
      expect *= static_cast<int64_t>(shape[i]);
    }
  }
  const int device = ptr == 0 ? call.device() : PointerDevice(reinterpret_cast<void*>(ptr));
  if (device != call.device()) {
    ValueError(absl::StrFormat("%s: array on cuda:%d, the call runs on cuda:%d", what, device,
                               call.device()));
  }
  if (d.contains("stream") && !d["stream"].is_none()) {
    const uint64_t s = nb::cast<uint64_t>(d["stream"]);
    if (s == 0)
      ValueError(absl::StrFormat("%s: __cuda_array_interface__ stream 0 is invalid", what));
    cudaStream_t producer = StreamOfNumber(s);
    cudaStream_t consumer = static_cast<cudaStream_t>(call.stream());
    if (producer != consumer) {
      DeviceGuard guard;
      CheckCuda(cudaSetDevice(call.device()), "cudaSetDevice");
      cudaEvent_t ev;
      CheckCuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
      cudaError_t err = cudaEventRecord(ev, producer);
      if (err == cudaSuccess) err = cudaStreamWaitEvent(consumer, ev, 0);
      cudaEventDestroy(ev);  // released once the wait is done
      CheckCuda(err, "ordering after the producer's stream");
    }
  }
  return CallArray(reinterpret_cast<const void*>(ptr), shape.size(), shape.data(), obj, nullptr, dt,
                   nb::device::cuda::value, device);
#else
  (void)obj;
  (void)call;
  ValueError(absl::StrFormat("%s: a CUDA array, and this build of kvcomp has no CUDA", what));
#endif
}

}  // namespace

CallBackend CallBackend::Open(const std::string& name, int device, std::optional<uint64_t> stream) {
  CallBackend c;
  if (name != "cuda") {
    absl::StatusOr<std::unique_ptr<Backend>> b = MakeBackend(name);
    ThrowIfError(b.status());
    c.owned_ = std::move(*b);
    c.backend_ = c.owned_.get();
    return c;
  }
#ifdef KVCOMP_HAVE_CUDA
  if (!CudaAvailable()) ThrowIfError(MakeBackend("cuda").status());  // says why
  c.cuda_ = true;
  c.device_ = device < 0 ? 0 : device;
  ThreadCuda& t = ThisThread();
  DeviceGuard guard;
  cudaStream_t s;
  if (stream.has_value()) {
    s = StreamOfNumber(*stream);
  } else {
    auto it = t.own_stream.find(c.device_);
    if (it == t.own_stream.end()) {
      CheckCuda(cudaSetDevice(c.device_), "cudaSetDevice");
      cudaStream_t own;
      CheckCuda(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking), "cudaStreamCreate");
      it = t.own_stream.emplace(c.device_, own).first;
    }
    s = it->second;
  }
  c.stream_ = s;
  Backend*& b = t.backend[{c.device_, s}];
  if (b == nullptr) {
    CudaBackendOptions opt;
    opt.device = c.device_;
    opt.stream = s;
    absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(opt);
    if (!made.ok()) {
      t.backend.erase({c.device_, s});
      ThrowIfError(made.status());
    }
    b = made->release();
  }
  c.backend_ = b;
  return c;
#else
  (void)device;
  (void)stream;
  ThrowIfError(MakeBackend("cuda").status());  // FailedPrecondition: no CUDA in this build
  throw std::logic_error("unreachable");
#endif
}

int64_t CallBackend::dlpack_stream() const {
#ifdef KVCOMP_HAVE_CUDA
  if (stream_ == cudaStreamLegacy || stream_ == nullptr) return 1;
  if (stream_ == cudaStreamPerThread) return 2;
#endif
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(stream_));
}

MemorySpace SpaceOf(const CallArray& a) {
  const int type = a.device_type();
  return type == kDLCPU || type == kDLCUDAHost ? MemorySpace::kHost : MemorySpace::kDevice;
}

int ArrayDevice(nb::handle obj) {
  if (!obj.is_valid() || obj.is_none()) return -1;
  if (HasAttr(obj, "__dlpack_device__")) {
    nb::tuple dev = nb::cast<nb::tuple>(obj.attr("__dlpack_device__")());
    const int type = nb::cast<int>(dev[0]);
    if (type == kDLCPU || type == kDLCUDAHost) return -1;
    if (type == kDLCUDA || type == kDLCUDAManaged) return nb::cast<int>(dev[1]);
    ValueError(
        absl::StrFormat("arrays must live in CPU or CUDA memory (DLPack device type %d)", type));
  }
  if (HasAttr(obj, "__cuda_array_interface__")) {
#ifdef KVCOMP_HAVE_CUDA
    nb::dict d = nb::cast<nb::dict>(obj.attr("__cuda_array_interface__"));
    const uintptr_t ptr = nb::cast<uintptr_t>(nb::cast<nb::tuple>(d["data"])[0]);
    return ptr == 0 ? 0 : PointerDevice(reinterpret_cast<void*>(ptr));
#else
    ValueError("a CUDA array, and this build of kvcomp has no CUDA");
#endif
  }
  return -1;
}

int CommonDevice(const std::vector<nb::handle>& objs) {
  int device = -1;
  for (nb::handle o : objs) {
    const int d = ArrayDevice(o);
    if (d < 0) continue;
    if (device >= 0 && d != device) {
      ValueError(absl::StrFormat("arrays on cuda:%d and cuda:%d in one call", device, d));
    }
    device = d;
  }
  return device;
}

DType CallArrayDType(const CallArray& a, const std::string& hint) {
  const auto dt = a.dtype();
  using C = nb::dlpack::dtype_code;
  if (dt.lanes != 1) throw nb::value_error("vector dtypes are not supported");
  if (dt.code == static_cast<uint8_t>(C::Float) && dt.bits == 32) return DType::kF32;
  if (dt.code == static_cast<uint8_t>(C::Float) && dt.bits == 16) return DType::kF16;
  if (dt.code == static_cast<uint8_t>(C::Bfloat) && dt.bits == 16) return DType::kBF16;
  if (dt.code == static_cast<uint8_t>(C::UInt) && dt.bits == 16 && hint == "bf16") {
    return DType::kBF16;
  }
  throw nb::value_error(
      "arrays must be float32, float16 or bfloat16 (bfloat16 may be a uint16 array with "
      "dtype=\"bf16\")");
}

CallArray ImportArray(nb::handle obj, const CallBackend& call, const char* what) {
  const int device = ArrayDevice(obj);
  nb::object src = nb::borrow(obj);
  if (device >= 0) {
    if (!call.cuda()) {
      ValueError(absl::StrFormat("%s: a CUDA array needs backend=\"cuda\"", what));
    }
    if (device != call.device()) {
      ValueError(absl::StrFormat("%s: array on cuda:%d, the call runs on cuda:%d", what, device,
                                 call.device()));
    }
    if (!HasAttr(obj, "__dlpack__")) return FromCudaArrayInterface(obj, call, what);
    // The producer orders the call's stream after its pending writes (DLPack's stream argument).
    src = obj.attr("__dlpack__")(nb::arg("stream") = call.dlpack_stream());
  }
  CallArray a;
  if (!nb::try_cast(src, a)) {
    ValueError(absl::StrFormat(
        "%s: not an array kvcomp can read (NumPy, DLPack or __cuda_array_interface__)", what));
  }
  if (!CContiguous(a)) {
    ValueError(
        absl::StrFormat("%s: array is not C-contiguous (numpy.ascontiguousarray, "
                        "tensor.contiguous())",
                        what));
  }
  const int type = a.device_type();
  const bool host = type == kDLCPU || type == kDLCUDAHost;
  if (host != (device < 0) || (!host && type != kDLCUDA && type != kDLCUDAManaged)) {
    ValueError(absl::StrFormat("%s: arrays must live in CPU or CUDA memory", what));
  }
  return a;
}

}  // namespace python
}  // namespace kvcomp
