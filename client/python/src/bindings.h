// Shared pieces of kvcomp's Python bindings: one Register* function per concern (module.cc calls
// them in order), the mapping of absl statuses to Python exceptions, and NumPy arrays that own
// their data.
#ifndef KVCOMP_CLIENT_PYTHON_SRC_BINDINGS_H_
#define KVCOMP_CLIENT_PYTHON_SRC_BINDINGS_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcomp {
namespace python {

// Engine I: Policy, score, compress, CompressedCache (bind_engine.cc).
void RegisterEngine(nanobind::module_& m);
// Engine II: CompressedCache.moments, _attention (bind_moments.cc).
void RegisterMoments(nanobind::module_& m);
// The C++ SDK: _Client, _PutStream (bind_client.cc); kvcomp/client.py wraps them.
void RegisterClient(nanobind::module_& m);
// Engine III: Projection, _calibrate, _encode_kept, _decompress (bind_codec.cc).
void RegisterCodec(nanobind::module_& m);

// Raises the Python exception that matches `status` (ValueError for InvalidArgument,
// OutOfRange and DataLoss, NotImplementedError for Unimplemented, KeyError for NotFound,
// PermissionError for Unauthenticated/PermissionDenied, TimeoutError for DeadlineExceeded,
// ConnectionError for Unavailable, MemoryError for ResourceExhausted, RuntimeError otherwise);
// no-op when OK.
inline void ThrowIfError(const absl::Status& status) {
  if (status.ok()) return;
  const std::string msg = status.ToString();
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kDataLoss:  // malformed bytes handed in
      throw nanobind::value_error(msg.c_str());
    case absl::StatusCode::kUnimplemented:
      PyErr_SetString(PyExc_NotImplementedError, msg.c_str());
      throw nanobind::python_error();
    case absl::StatusCode::kNotFound:
      PyErr_SetString(PyExc_KeyError, msg.c_str());
      throw nanobind::python_error();
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      PyErr_SetString(PyExc_PermissionError, msg.c_str());
      throw nanobind::python_error();
    case absl::StatusCode::kDeadlineExceeded:
      PyErr_SetString(PyExc_TimeoutError, msg.c_str());
      throw nanobind::python_error();
    case absl::StatusCode::kUnavailable:
      PyErr_SetString(PyExc_ConnectionError, msg.c_str());
      throw nanobind::python_error();
    case absl::StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, msg.c_str());
      throw nanobind::python_error();
    default:
      throw std::runtime_error(msg);
  }
}

// A NumPy array of `shape` that owns `data` (freed with the array).
template <typename T>
nanobind::object NumpyArray(std::vector<T>&& data, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(data));
  nanobind::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nanobind::ndarray<nanobind::numpy, T>(heap->data(), shape.size(), shape.data(), owner)
      .cast();
}

// The value of `v`, or ThrowIfError's exception.
template <typename T>
T Unwrap(absl::StatusOr<T> v) {
  ThrowIfError(v.status());
  return std::move(v).value();
}

}  // namespace python
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_PYTHON_SRC_BINDINGS_H_
