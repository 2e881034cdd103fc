// GPU test helpers. A test binary that needs a CUDA device puts KVCOMP_GPU_TEST_BINARY() at
// namespace scope in one of its files: before the first test runs it exits with code 77, which
// ctest reports as skipped (kvcomp_cc_test sets SKIP_RETURN_CODE 77), when kvcomp was built
// without CUDA or no device is visible.
#ifndef KVCOMP_TESTS_COMMON_GPU_H_
#define KVCOMP_TESTS_COMMON_GPU_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

#if defined(KVCOMP_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace kvcomp {
namespace testing {

inline constexpr int kSkipExitCode = 77;

// True when a CUDA device can be used from this process.
inline bool GpuPresent() {
#if defined(KVCOMP_HAVE_CUDA)
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
#else
  return false;
#endif
}

// Why no device can be used, in words for a test report; empty when one can.
inline std::string NoGpuReason() {
#if defined(KVCOMP_HAVE_CUDA)
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaSuccess && count > 0) return "";
  cudaGetLastError();  // clear the sticky error
  if (e == cudaSuccess || e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    return std::string("skipped: needs an NVIDIA GPU; this machine has none (or no NVIDIA "
                       "driver): ") + (e == cudaSuccess ? "no device" : cudaGetErrorString(e));
  }
  return std::string("skipped: needs an NVIDIA GPU; the CUDA runtime says: ") +
         cudaGetErrorString(e);
#else
  return "skipped: needs an NVIDIA GPU and a CUDA build (this build has KVCOMP_CUDA off)";
#endif
}

// Exits 77 (skipped) when no device is present, saying why on its last line.
inline void RequireGpuOrSkip() {
  const std::string why = NoGpuReason();
  if (!why.empty()) {
    std::fprintf(stderr, "%s\n", why.c_str());
    std::fflush(stderr);
    std::exit(kSkipExitCode);
  }
}

class GpuEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { RequireGpuOrSkip(); }
};

}  // namespace testing
}  // namespace kvcomp

#define KVCOMP_GPU_TEST_BINARY()                                           \
  static ::testing::Environment* const kvcomp_gpu_environment_ =           \
      ::testing::AddGlobalTestEnvironment(new ::kvcomp::testing::GpuEnvironment)

#endif  // KVCOMP_TESTS_COMMON_GPU_H_
