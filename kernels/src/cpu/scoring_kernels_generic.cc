// The portable build of the row kernels (SSE2 on x86-64, NEON on arm64), and the dispatch.
#define KVCOMP_ROW_NS generic
#define KVCOMP_VEC_BYTES 16
#include "scoring_kernels.inc"

#include <cstdlib>
#include <cstring>

namespace kvcomp {
namespace cpu {
namespace {

enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa Detect() {
  Isa best = Isa::kGeneric;
#if defined(KVCOMP_HAVE_AVX2_KERNELS)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    best = Isa::kAvx2;
#if defined(KVCOMP_HAVE_AVX512_KERNELS)
    if (__builtin_cpu_supports("avx512f")) best = Isa::kAvx512;
#endif
  }
#endif
  // KVCOMP_CPU_ISA caps the choice (never raises it).
  const char* cap = std::getenv("KVCOMP_CPU_ISA");
  if (cap != nullptr && std::strcmp(cap, "generic") == 0) best = Isa::kGeneric;
  if (cap != nullptr && std::strcmp(cap, "avx2") == 0 && best == Isa::kAvx512) best = Isa::kAvx2;
  return best;
}

Isa Chosen() {
  static const Isa isa = Detect();
  return isa;
}

}  // namespace

const RowKernels* RowKernelsFor(DType dtype, uint32_t head_dim) {
  switch (Chosen()) {
#if defined(KVCOMP_HAVE_AVX512_KERNELS)
    case Isa::kAvx512: return avx512::Table(dtype, head_dim);
#endif
#if defined(KVCOMP_HAVE_AVX2_KERNELS)
    case Isa::kAvx2: return avx2::Table(dtype, head_dim);
#endif
    default: return generic::Table(dtype, head_dim);
  }
}

const char* RowKernelsIsa() {
  switch (Chosen()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

}  // namespace cpu
}  // namespace kvcomp
