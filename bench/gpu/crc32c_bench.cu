// CRC32C of device memory (DeviceCrc32c) against a device-to-device copy of the same bytes, at
// the sizes of compressed caches (a Llama-3.1-8B-shaped cache at ratio 0.5 is 0.5 GB at 8K
// tokens and 2 GB at 32K). The CRC reads each byte once; the copy reads and writes it. One
// result is checked against the CPU CRC32C.
#include <cstdio>
#include <cstdint>
#include <vector>

#include "bench_util.cuh"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/kernels/device_crc32c.h"

int main() {
  cudaStream_t stream;
  BENCH_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop;
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  uint32_t* word = nullptr;
  BENCH_CUDA_CHECK(cudaMalloc(&word, 4));
  for (size_t mib : {16, 256, 1024, 2048}) {
    const size_t bytes = mib << 20;
    constexpr int kSets = 2;  // rotated, so the L2 cache does not serve the reads
    std::vector<uint8_t*> buf(kSets);
    for (int s = 0; s < kSets; ++s) {
      BENCH_CUDA_CHECK(cudaMalloc(&buf[s], bytes + 3));
      BENCH_CUDA_CHECK(cudaMemsetAsync(buf[s], 0x5a + s, bytes + 3, stream));
    }
    const double us = kvcomp::bench::MedianMicros(
        [&](int i) {
          // Starts 3 bytes past an aligned address, as a section seldom does: the worst case.
          kvcomp::DeviceCrcRange r{buf[i % kSets] + 3, bytes, word};
          if (!kvcomp::DeviceCrc32c({r}, stream).ok()) std::exit(1);
        },
        stream, 3, 15);
    double copy_us = 0;
    const double copy_gbps = kvcomp::bench::CopyGBps(bytes, stream, kSets, &copy_us);
    bool match = true;
    if (mib == 256) {
      kvcomp::DeviceCrcRange r{buf[0] + 3, bytes, word};
      if (!kvcomp::DeviceCrc32c({r}, stream).ok()) std::exit(1);
      uint32_t got = 0;
      BENCH_CUDA_CHECK(cudaMemcpyAsync(&got, word, 4, cudaMemcpyDeviceToHost, stream));
      std::vector<uint8_t> host(bytes);
      BENCH_CUDA_CHECK(
          cudaMemcpyAsync(host.data(), buf[0] + 3, bytes, cudaMemcpyDeviceToHost, stream));
      BENCH_CUDA_CHECK(cudaStreamSynchronize(stream));
      match = got == kvcomp::Crc32c(host.data(), bytes);
    }
    std::printf(
        "RESULT bench=crc32c MiB=%zu us=%.1f read_GBps=%.0f copy_us=%.1f copy_GBps=%.0f "
        "crc_vs_copy_time=%.2f cpu_match=%s\n",
        mib, us, bytes / (us * 1e3), copy_us, copy_gbps, us / copy_us, match ? "yes" : "NO");
    for (int s = 0; s < kSets; ++s) BENCH_CUDA_CHECK(cudaFree(buf[s]));
  }
  BENCH_CUDA_CHECK(cudaFree(word));
  BENCH_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
