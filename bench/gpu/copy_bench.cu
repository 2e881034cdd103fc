// Device-to-device copy bandwidth at the sizes the scoring benchmarks move (K plus V of one layer,
// 8 kv heads, head_dim 128, bf16): the ceiling every GPU figure is compared against.
#include <cstdio>

#include "bench_util.cuh"

int main() {
  cudaStream_t stream;
  BENCH_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop;
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  for (size_t tokens : {8192, 65536, 131072, 524288}) {
    const size_t bytes = 2 * 8 * tokens * 128 * 2;  // K and V, bf16
    double us = 0;
    const double gbps = kvcomp::bench::CopyGBps(bytes, stream, 2, &us);
    std::printf("RESULT bench=copy tokens=%zu MiB=%.0f us=%.1f GBps=%.0f\n", tokens,
                bytes / 1048576.0, us, gbps);
  }
  BENCH_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
