// The device scan of FindFp16KeyOverflow (kvcomp/kernels/fp16_range.h): one thread per key,
// grid-stride; a key beyond the half range reports its flat index (head, token, channel in that
// order, as the CPU scan meets them) with an atomicMin, so the lowest one wins whatever the
// thread order; its value is then read back from the view itself.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda_status.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/fp16_range.h"

namespace kvcomp {
namespace fp16_range_internal {
namespace {

template <typename T>
__device__ float ToFloat(T x);
template <>
__device__ float ToFloat<float>(float x) {
  return x;
}
template <>
__device__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__global__ void FindBeyondHalf(const T* keys, uint32_t heads, uint64_t tokens, uint32_t dim,
                               uint64_t token_stride, uint64_t head_stride,
                               unsigned long long* first) {
  const uint64_t total = uint64_t{heads} * tokens * dim;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t c = i % dim;
    const uint64_t t = (i / dim) % tokens;
    const uint64_t h = i / (dim * tokens);
    const float x = ToFloat(keys[h * head_stride + t * token_stride + c]);
    if (isfinite(x) && fabsf(x) > 65504.0f) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

// Restores the calling thread's current device when it goes.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (device != previous_) set_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~DeviceGuard() {
    if (set_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool set_ = false;
};

// Launches the scan into `first` (device) and reads the lowest index found back into `*at`.
absl::Status Scan(const HeadsView& keys, cudaStream_t stream, unsigned long long* first,
                  unsigned long long* at) {
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(first, 0xFF, sizeof(*first), stream));
  const uint64_t total = uint64_t{keys.num_heads} * keys.num_tokens * keys.head_dim;
  const unsigned threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<uint64_t>((total + threads - 1) / threads, 4096));
  if (keys.dtype == DType::kF32) {
    FindBeyondHalf<float><<<blocks, threads, 0, stream>>>(
        static_cast<const float*>(keys.data), keys.num_heads, keys.num_tokens, keys.head_dim,
        keys.token_stride, keys.head_stride, first);
  } else {
    FindBeyondHalf<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(keys.data), keys.num_heads, keys.num_tokens,
        keys.head_dim, keys.token_stride, keys.head_stride, first);
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(at, first, sizeof(*at), cudaMemcpyDeviceToHost, stream));
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Fp16Overflow> FindOnDevice(const HeadsView& keys, void* stream_arg) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, keys.data) != cudaSuccess ||
      (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        "fp16 key range: keys marked device are not CUDA device memory");
  }
  DeviceGuard guard(attr.device);
  cudaStream_t stream = stream_arg != nullptr ? static_cast<cudaStream_t>(stream_arg)
                                              : cudaStreamPerThread;
  unsigned long long* first = nullptr;
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaMallocAsync(reinterpret_cast<void**>(&first), sizeof(*first), stream));
  unsigned long long at = ~0ull;
  const absl::Status st = Scan(keys, stream, first, &at);
  cudaFreeAsync(first, stream);
  KVCOMP_RETURN_IF_ERROR(st);
  Fp16Overflow o;
  if (at == ~0ull) return o;
  o.found = true;
  o.channel = static_cast<uint32_t>(at % keys.head_dim);
  o.token = (at / keys.head_dim) % keys.num_tokens;
  o.head = static_cast<uint32_t>(at / (uint64_t{keys.head_dim} * keys.num_tokens));
  // The key itself, read back from the view: the same value the CPU scan would give.
  const size_t bytes = DTypeBytes(keys.dtype, 1);
  const uint64_t element = keys.offset(o.head, o.token) + o.channel;
  alignas(4) unsigned char raw[4] = {0, 0, 0, 0};
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      raw, static_cast<const unsigned char*>(keys.data) + element * bytes, bytes,
      cudaMemcpyDeviceToHost));
  o.value = LoadAsFloat(raw, keys.dtype, 0);
  return o;
}

}  // namespace fp16_range_internal
}  // namespace kvcomp
