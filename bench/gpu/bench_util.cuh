// Timing helpers shared by kvcomp's CUDA benchmarks: CUDA-event timing with warm-up, median of
// many repetitions, and the device-to-device copy that every figure is set next to.
#ifndef KVCOMP_BENCH_GPU_BENCH_UTIL_CUH_
#define KVCOMP_BENCH_GPU_BENCH_UTIL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#if __has_include("kvcomp/kernels/backend.h")  // benchmarks of the library (not the bare copy)
#include "kvcomp/kernels/backend.h"
#define KVCOMP_BENCH_HAS_BACKEND 1
#endif

#define BENCH_CUDA_CHECK(expr)                                                       \
  do {                                                                               \
    cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,             \
                   cudaGetErrorString(e_));                                          \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace kvcomp {
namespace bench {

// Median time in microseconds of `fn(i)` (i = repetition index, for rotating buffers), timed
// with events around each call after `warmup` untimed calls.
inline double MedianMicros(const std::function<void(int)>& fn, cudaStream_t stream, int warmup,
                           int reps) {
  for (int i = 0; i < warmup; ++i) fn(i);
  BENCH_CUDA_CHECK(cudaStreamSynchronize(stream));
  BENCH_CUDA_CHECK(cudaGetLastError());
  cudaEvent_t start, stop;
  BENCH_CUDA_CHECK(cudaEventCreate(&start));
  BENCH_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA_CHECK(cudaEventRecord(start, stream));
    fn(warmup + i);
    BENCH_CUDA_CHECK(cudaEventRecord(stop, stream));
    BENCH_CUDA_CHECK(cudaEventSynchronize(stop));
    BENCH_CUDA_CHECK(cudaEventElapsedTime(&ms[i], start, stop));
  }
  BENCH_CUDA_CHECK(cudaGetLastError());
  BENCH_CUDA_CHECK(cudaEventDestroy(start));
  BENCH_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[reps / 2];
}

// Device-to-device copy bandwidth in GB/s (bytes read plus bytes written, 1e9), over `bytes`,
// rotating among `sets` source/destination pairs so the L2 cache does not serve the reads.
inline double CopyGBps(size_t bytes, cudaStream_t stream, int sets = 2, double* micros = nullptr) {
  std::vector<void*> src(sets), dst(sets);
  for (int s = 0; s < sets; ++s) {
    BENCH_CUDA_CHECK(cudaMalloc(&src[s], bytes));
    BENCH_CUDA_CHECK(cudaMalloc(&dst[s], bytes));
    BENCH_CUDA_CHECK(cudaMemsetAsync(src[s], 0x5a, bytes, stream));
  }
  const double us = MedianMicros(
      [&](int i) {
        BENCH_CUDA_CHECK(cudaMemcpyAsync(dst[i % sets], src[i % sets], bytes,
                                         cudaMemcpyDeviceToDevice, stream));
      },
      stream, 5, 30);
  for (int s = 0; s < sets; ++s) {
    BENCH_CUDA_CHECK(cudaFree(src[s]));
    BENCH_CUDA_CHECK(cudaFree(dst[s]));
  }
  if (micros) *micros = us;
  return 2.0 * static_cast<double>(bytes) / (us * 1e3);
}

#if defined(KVCOMP_BENCH_HAS_BACKEND)
// The backend's options for a benchmark: KVCOMP_BENCH_POOL_KEEP_BYTES sets how much freed
// device memory its pool keeps mapped (CudaBackendOptions::pool_keep_bytes; 0 returns it all at
// each host wait, as the device's default pool does), for comparisons.
inline CudaBackendOptions BackendOptions() {
  CudaBackendOptions o;
  if (const char* keep = std::getenv("KVCOMP_BENCH_POOL_KEEP_BYTES")) {
    o.pool_keep_bytes = std::strtoull(keep, nullptr, 10);
    std::printf("backend pool keeps %llu bytes\n",
                static_cast<unsigned long long>(o.pool_keep_bytes));
  }
  return o;
}
#endif

}  // namespace bench
}  // namespace kvcomp

#endif  // KVCOMP_BENCH_GPU_BENCH_UTIL_CUH_
