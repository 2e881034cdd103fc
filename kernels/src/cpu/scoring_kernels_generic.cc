// The portable build of the row kernels (SSE2 on x86-64, NEON on arm64), and the dispatch.
#define KVCOMP_ROW_NS generic
#define KVCOMP_VEC_BYTES 16
#include "scoring_kernels.inc"

namespace kvcomp {
namespace cpu {
namespace {

bool UseAvx2() {
#if defined(KVCOMP_HAVE_AVX2_KERNELS)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

}  // namespace

const RowKernels* RowKernelsFor(DType dtype, uint32_t head_dim) {
#if defined(KVCOMP_HAVE_AVX2_KERNELS)
  if (UseAvx2()) return avx2::Table(dtype, head_dim);
#endif
  return generic::Table(dtype, head_dim);
}

const char* RowKernelsIsa() { return UseAvx2() ? "avx2" : "generic"; }

}  // namespace cpu
}  // namespace kvcomp
