// Row kernels of the CPU scorers: the inner loops over one head's rows, vectorised, one table
// per (dtype, head_dim). Three builds of the same code (scoring_kernels.inc): AVX-512, AVX2+FMA+F16C
// and a portable one; RowKernelsFor picks the best the running CPU supports (the environment
// variable KVCOMP_CPU_ISA = avx2 or generic caps it, for comparisons).
#ifndef KVCOMP_KERNELS_SRC_CPU_SCORING_KERNELS_H_
#define KVCOMP_KERNELS_SRC_CPU_SCORING_KERNELS_H_

#include <cstdint>

#include "kvcomp/core/dtype.h"

namespace kvcomp {
namespace cpu {

// Most runs sq_norms_and_sums reads in turn.
inline constexpr uint64_t kMaxSumRuns = 4;

// Rows are `stride` elements apart; every output is per row; float accumulation in a fixed
// order. sum/mu/a/q have head_dim floats.
struct RowKernels {
  // sq[i] = ||k_i||^2.
  void (*sq_norms)(const void* rows, uint64_t stride, uint64_t n, float* sq);
  // sq[i] = ||k_i||^2 and sum += k_i * (normalize ? 1 / max(||k_i||, eps) : 1).
  void (*sq_norms_and_sum)(const void* rows, uint64_t stride, uint64_t n, bool normalize, float eps,
                           float* sq, float* sum);
  // sq_norms_and_sum over `runs` (1 to kMaxSumRuns) consecutive runs of n rows, run j into sums + j *
  // head_dim: the same bits as one call per run, the runs read in turn (as ForRows).
  void (*sq_norms_and_sums)(const void* rows, uint64_t stride, uint64_t n, uint64_t runs,
                            bool normalize, float eps, float* sq, float* sums);
  // sum += k_i (the same bits as sq_norms_and_sum's sum without normalisation).
  void (*sums)(const void* rows, uint64_t stride, uint64_t n, float* sum);
  // out[i] = ||k_i - mu||.
  void (*distances)(const void* rows, uint64_t stride, uint64_t n, const float* mu, float* out);
  // out[i] = k_i . v.
  void (*dots)(const void* rows, uint64_t stride, uint64_t n, const float* v, float* out);
  // One read of each row: out[i] as distances and sq[i] as sq_norms (the same bits as each).
  void (*distances_and_sq)(const void* rows, uint64_t stride, uint64_t n, const float* mu,
                           float* out, float* sq);
  // One read of each row: out[i] as dots and sq[i] as sq_norms (the same bits as each).
  void (*dots_and_sq)(const void* rows, uint64_t stride, uint64_t n, const float* v, float* out,
                      float* sq);
  // dst[0..head_dim) = row as float.
  void (*to_float)(const void* row, float* dst);
  // Row r of dst = row idx[r] of rows, byte for byte, for r < count (a compaction's gather). With
  // `stream` the stores are non-temporal (dst must be 16-byte aligned; the build's widest
  // vector when dst is aligned to it), so the output does not pass through the cache.
  void (*gather)(const void* rows, uint64_t stride, const uint32_t* idx, uint64_t count, void* dst,
                 bool stream);
  // One read of rows [t0, t0 + n): sq[i] = ||row t0+i||^2 (as sq_norms), and the rows listed in
  // kept[0..count) (ascending, all in [t0, t0 + n)) copied to dst in order, while in L1.
  void (*sq_norms_and_copy)(const void* rows, uint64_t stride, uint64_t t0, uint64_t n,
                            const uint32_t* kept, uint64_t count, void* dst, bool stream,
                            float* sq);
};

// The table for (dtype, head_dim); nullptr when unsupported.
const RowKernels* RowKernelsFor(DType dtype, uint32_t head_dim);
// "avx512", "avx2" or "generic": which build RowKernelsFor uses on this CPU.
const char* RowKernelsIsa();

namespace generic {
const RowKernels* Table(DType dtype, uint32_t head_dim);
}
namespace avx2 {
const RowKernels* Table(DType dtype, uint32_t head_dim);
}
namespace avx512 {
const RowKernels* Table(DType dtype, uint32_t head_dim);
}

}  // namespace cpu
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CPU_SCORING_KERNELS_H_
