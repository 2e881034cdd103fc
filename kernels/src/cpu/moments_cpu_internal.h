// Internal helpers of the CPU MomentOps (moments_cpu.cc, attention_cpu.cc): argument checks
// shared with the CUDA backend, row conversion to fp32 and the small dense products, through
// Eigen when the build has it.
#ifndef KVCOMP_KERNELS_SRC_CPU_MOMENTS_CPU_INTERNAL_H_
#define KVCOMP_KERNELS_SRC_CPU_MOMENTS_CPU_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "kvcomp/kernels/moment_ops.h"

namespace kvcomp {
namespace moments_internal {

// Runs fn(i) for i in [0, n), possibly in parallel; returns when all are done.
using ParallelFor = std::function<void(size_t n, const std::function<void(size_t)>& fn)>;

// Space-independent argument checks (every op of every backend runs them first). `space` is the
// backend's memory space.
absl::Status CheckMomentsView(const MomentsView& m, uint32_t heads, uint32_t head_dim,
                              MemorySpace space, const char* what);
absl::Status CheckConstMomentsView(const ConstMomentsView& m, uint32_t heads, uint32_t head_dim,
                                   MemorySpace space, const char* what);
absl::Status CheckKvPair(const HeadsView& k, const HeadsView& v, MemorySpace space);
absl::Status CheckTokenLists(const TokenLists& l, uint32_t heads, MemorySpace space,
                             const char* what);
absl::Status CheckAttention(const AttentionParams& p, MemorySpace space);
// A compaction's k/v pair, kept lists and (when out.count is set) moments.
absl::Status CheckCompactArgs(const HeadsView& k, const HeadsView& v, const TokenLists& kept,
                              const MomentsView& out, MemorySpace space);

// Host-only checks that read the index arrays: every index < tokens; `ascending` also requires
// strictly ascending lists.
absl::Status CheckTokenIndices(const TokenLists& l, uint64_t tokens, bool ascending,
                               const char* what);
absl::Status CheckRaggedOffsets(const RaggedKv& kv);

// dst[0..n) = src row of `dtype` as float.
void RowToFloat(const void* src, DType dtype, size_t n, float* dst);

// Row-major dense products in fp32:
//   AddAtB:  C[p x q] += A[m x p]^T B[m x q]
//   ABt:     C[m x q]  = A[m x p] B[q x p]^T
//   AddAB:   C[m x q] += A[m x p] B[p x q]
void AddAtB(const float* a, const float* b, float* c, size_t m, size_t p, size_t q);
void ABt(const float* a, const float* b, float* c, size_t m, size_t p, size_t q);
void AddAB(const float* a, const float* b, float* c, size_t m, size_t p, size_t q);

// The CPU implementation. `parallel` is the owning backend's loop, `workers` its thread count
// (used to split long heads into parts).
class CpuMomentOps final : public MomentOps {
 public:
  CpuMomentOps(ParallelFor parallel, size_t workers);

  absl::Status Accumulate(const HeadsView& k, const HeadsView& v, const TokenLists& evicted,
                          const MomentsView& out) override;
  absl::Status CompactAndAccumulate(const HeadsView& k, const HeadsView& v, const TokenLists& kept,
                                    void* kept_k, void* kept_v, const MomentsView& out) override;
  absl::Status CompactAndAccumulateDeferred(const HeadsView& k, const HeadsView& v,
                                            const TokenLists& kept, void* kept_k, void* kept_v,
                                            uint32_t* error, uint64_t* bad_value,
                                            const MomentsView& out) override;
  absl::Status Merge(const MomentsView& dst, const ConstMomentsView& src) override;
  absl::Status Attention(const AttentionParams& params) override;

 private:
  // CompactAndAccumulate after its checks (lists well formed, outputs non-null).
  void CompactRows(const HeadsView& k, const HeadsView& v, const TokenLists& kept, void* kept_k,
                   void* kept_v, const MomentsView& out);

  ParallelFor parallel_;
  size_t workers_;
};

}  // namespace moments_internal
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CPU_MOMENTS_CPU_INTERNAL_H_
