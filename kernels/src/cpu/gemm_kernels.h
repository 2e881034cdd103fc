// The dense products of the CPU moment and attention tiles (row-major float matrices), built
// with the AVX2+FMA and AVX-512 flags beside the library's portable build, and chosen at run time
// with the row kernels (RowKernelsIsa: the same CPU check and the same KVCOMP_CPU_ISA cap).
#ifndef KVCOMP_KERNELS_SRC_CPU_GEMM_KERNELS_H_
#define KVCOMP_KERNELS_SRC_CPU_GEMM_KERNELS_H_

#include <cstddef>

namespace kvcomp {
namespace cpu {

struct GemmKernels {
  // C[p x q] += A[m x p]^T B[m x q]
  void (*add_at_b)(const float* a, const float* b, float* c, size_t m, size_t p, size_t q);
  // C[m x q] = A[m x p] B[q x p]^T
  void (*a_bt)(const float* a, const float* b, float* c, size_t m, size_t p, size_t q);
  // C[m x q] += A[m x p] B[p x q]
  void (*add_a_b)(const float* a, const float* b, float* c, size_t m, size_t p, size_t q);
  // C[m x q] = A[m x p] B[p x q] with every element the chain of fused multiply-adds over p in
  // order, from +0: c = fma(a[p-1] b[p-1], ..., fma(a[0], b[0], +0)). Each step is exactly
  // rounded, so every build (and the CUDA twin of the KVSplice encoder) gets the same bits.
  void (*chain_a_b)(const float* a, const float* b, float* c, size_t m, size_t p, size_t q);
  // out[i] = the same chain over the squares of row i of A[m x p].
  void (*chain_row_squares)(const float* a, float* out, size_t m, size_t p);
};

// The AVX2 or AVX-512 build the running CPU takes, or nullptr where only the portable one runs
// or none was built.
const GemmKernels* WideGemm();
// The build the running CPU takes: WideGemm's, else the portable one (built with Eigen only).
const GemmKernels& Gemm();

namespace generic {
const GemmKernels* GemmTable();
}
namespace avx2 {
const GemmKernels* GemmTable();
}
namespace avx512 {
const GemmKernels* GemmTable();
}

}  // namespace cpu
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CPU_GEMM_KERNELS_H_
