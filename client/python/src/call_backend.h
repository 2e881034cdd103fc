// How a call of the Python binding reaches a backend and takes caller arrays in, so that every
// entry point follows one stream contract (docs/engine.md, "CUDA streams"):
//
//   - A CUDA call runs on one stream: the `stream` the caller names (kvcomp/__init__.py passes
//     torch's current stream when a torch CUDA tensor is among the inputs), else a non-blocking
//     stream of the calling thread's own, one per device.
//   - A CUDA array enters ordered after its producer's stream: through DLPack, __dlpack__ is
//     called with stream=<the call's stream> so the producer makes that stream wait for its
//     pending writes; through __cuda_array_interface__, an event is recorded on the "stream" it
//     names and the call's stream waits for it. Nothing synchronises the device.
//   - Results written into caller arrays are ordered on the call's stream; results returned as
//     NumPy arrays or caches are complete when the call returns (it waits for the call's stream
//     only).
#ifndef KVCOMP_CLIENT_PYTHON_SRC_CALL_BACKEND_H_
#define KVCOMP_CLIENT_PYTHON_SRC_CALL_BACKEND_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {
namespace python {

// An array a call reads in place: C-contiguous, host or CUDA memory.
using CallArray = nanobind::ndarray<nanobind::ro>;

// The backend of one call and, for CUDA, the stream it issues on.
class CallBackend {
 public:
  // name: "cpu" or "cuda". device: CUDA ordinal, -1 = 0. stream: the caller's stream as a
  // number (0 or 1: the legacy default stream, 2: the per-thread default stream, else a
  // cudaStream_t); nullopt = the calling thread's own stream for `device`. CUDA backends are
  // kept per (thread, device, stream) for the thread's life: making one allocates pinned memory
  // and library handles, and freeing those may synchronise the device. Raises on failure.
  static CallBackend Open(const std::string& name, int device, std::optional<uint64_t> stream);

  Backend& get() const { return *backend_; }
  bool cuda() const { return cuda_; }
  int device() const { return device_; }
  // The call's cudaStream_t (cuda only).
  void* stream() const { return stream_; }
  // The call's stream as __dlpack__(stream=...) wants it: 1 legacy, 2 per-thread, else handle.
  int64_t dlpack_stream() const;

 private:
  std::unique_ptr<Backend> owned_;  // cpu
  Backend* backend_ = nullptr;
  bool cuda_ = false;
  int device_ = 0;
  void* stream_ = nullptr;
};

// Host memory for CPU and pinned (CUDA host) arrays, device memory for CUDA arrays.
MemorySpace SpaceOf(const CallArray& a);

// The element type of a float array: float32, float16 or bfloat16 (with hint "bf16", a uint16
// array holding bfloat16 bits); ValueError for other dtypes.
DType CallArrayDType(const CallArray& a, const std::string& hint = "");

// The CUDA device an input lives on, -1 for host memory (or None). Raises ValueError for other
// devices.
int ArrayDevice(nanobind::handle obj);

// The one CUDA device of `objs` (-1 when all are host memory); ValueError when they differ.
int CommonDevice(const std::vector<nanobind::handle>& objs);

// `obj` (NumPy or any buffer, DLPack producer, __cuda_array_interface__ object, capsule) as an
// array the call reads in place, ordered after its producer's stream on `call`'s stream (see
// the file comment). ValueError for non-contiguous arrays and for CUDA arrays on a CPU call or
// on another device than the call's.
CallArray ImportArray(nanobind::handle obj, const CallBackend& call, const char* what);

}  // namespace python
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_PYTHON_SRC_CALL_BACKEND_H_
