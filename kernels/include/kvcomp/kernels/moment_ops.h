// MomentOps: the operations of Engine II behind kvcomp::Backend: MomentKV summaries of
// evicted tokens and the decode-side attention that uses them (docs/moments.md).
//
// Moments of an evicted set E of one (layer, kv head), in fp32:
//   n = |E|,  s_k = sum k_j,  s_v = sum v_j,  S = sum v_j k_j^T  (head_dim x head_dim, S[i][j] =
//   sum v_i k_j, row-major). They add: the moments of E1 u E2 (disjoint) are the sums.
// Decode attention for a query q over kept tokens K, V plus the evicted set's virtual token, with
// t = scale (default 1/sqrt(head_dim)), mu_k = s_k/n, mu_v = s_v/n, C = S/n - mu_v mu_k^T:
//   logits  l_i = t q.k_i (kept),  l_E = t q.mu_k + ln n (virtual, only when n > 0)
//   values  v_i (kept),            v_E = mu_v + t C q
//   out = softmax([l_i, l_E]) . [v_i, v_E]   (max-subtracted, accumulated in fp32)
//
// Every op reads and writes memory in the backend's space (MemorySpace of each view); a view in
// the other space is InvalidArgument. Ops are not thread-safe per backend (see backend.h). CUDA
// ops are asynchronous on the backend's stream unless stated otherwise.
#ifndef KVCOMP_KERNELS_MOMENT_OPS_H_
#define KVCOMP_KERNELS_MOMENT_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

// Mutable fp32 moments of `num_heads` heads (the layout of CompressedCache's moment_* arrays for
// a run of heads). Not owned.
struct MomentsView {
  uint64_t* count = nullptr;   // [num_heads]
  float* key_sum = nullptr;    // [num_heads, head_dim]
  float* value_sum = nullptr;  // [num_heads, head_dim]
  float* vk_sum = nullptr;     // [num_heads, head_dim, head_dim], [h][i][j] = sum v_i k_j
  uint32_t num_heads = 0;
  uint32_t head_dim = 0;
  MemorySpace space = MemorySpace::kHost;
};

// Read-only moments; a null `count` means "no summary" (attention then has no virtual token).
struct ConstMomentsView {
  const uint64_t* count = nullptr;
  const float* key_sum = nullptr;
  const float* value_sum = nullptr;
  const float* vk_sum = nullptr;
  uint32_t num_heads = 0;
  uint32_t head_dim = 0;
  MemorySpace space = MemorySpace::kHost;

  ConstMomentsView() = default;
  ConstMomentsView(const MomentsView& m)  // NOLINT(google-explicit-constructor)
      : count(m.count),
        key_sum(m.key_sum),
        value_sum(m.value_sum),
        vk_sum(m.vk_sum),
        num_heads(m.num_heads),
        head_dim(m.head_dim),
        space(m.space) {}
};

// Ragged per-head token indices: head h's tokens are indices[offsets[h] .. offsets[h+1]), each
// < the tokens of the HeadsView they index. `offsets` has num_heads + 1 entries. Not owned.
struct TokenLists {
  const uint32_t* indices = nullptr;
  const uint64_t* offsets = nullptr;
  uint32_t num_heads = 0;
  MemorySpace space = MemorySpace::kHost;
};

// Kept tokens of one layer, ragged per kv head in the CompressedCache layout: head h's tokens
// are rows [offsets[h], offsets[h+1]) of `keys` and `values`, each row head_dim elements of
// `dtype` (f32, f16 or bf16). Not owned.
struct RaggedKv {
  const void* keys = nullptr;
  const void* values = nullptr;
  DType dtype = DType::kBF16;
  const uint64_t* offsets = nullptr;  // [num_kv_heads + 1], in `space`
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  MemorySpace space = MemorySpace::kHost;
  // Optional, device backends: a host copy of `offsets` that the caller keeps (a decoder's
  // resident cache does). Attention then sizes its grid from it instead of reading the offsets
  // back and waiting for the device first; they must be the same numbers.
  const uint64_t* host_offsets = nullptr;
};

struct AttentionParams {
  // Queries [num_q_heads, num_queries, head_dim] (any input dtype); num_q_heads a multiple of
  // kv.num_kv_heads, q head g reads kv head g / (num_q_heads / num_kv_heads) (GQA).
  HeadsView queries;
  RaggedKv kv;
  // The evicted sets' summaries, one per kv head (num_heads == kv.num_kv_heads); count == null
  // or correct == false: plain attention over the kept tokens.
  ConstMomentsView moments;
  bool correct = true;  // add the virtual token of heads whose evicted count is > 0
  float scale = 0.0f;   // logit scale t; 0 = 1/sqrt(head_dim)
  // Output [num_q_heads, num_queries, head_dim], fp32, dense, in the backend's space.
  float* out = nullptr;
};

// The status of AccumulateDeferred's error word (0: OK).
inline absl::Status AccumulateErrorStatus(uint32_t error) {
  return error == 0 ? absl::OkStatus()
                    : absl::InvalidArgumentError(
                          "moments: evicted lists malformed (offsets, lengths or a token index "
                          "out of range)");
}

class MomentOps {
 public:
  virtual ~MomentOps() = default;

  // Adds the moments of the listed tokens of each head of k and v to `out` (same head count and
  // head_dim everywhere). Tokens listed twice count twice. InvalidArgument on mismatched shapes,
  // dtypes outside f32/f16/bf16, an index out of range (CPU) or memory in the wrong space.
  virtual absl::Status Accumulate(const HeadsView& k, const HeadsView& v, const TokenLists& evicted,
                                  const MomentsView& out) = 0;

  // Accumulate without holding the host (device backends): the lists' offsets stay in device
  // memory and every head's list is taken to hold at most `max_list` entries (this sizes the
  // grid). Bad lists (offsets not from 0 or decreasing, a list longer than max_list, an index out
  // of range) set *error (a u32 in the backend's memory that the caller zeroed before) instead of
  // returning InvalidArgument, and then nothing is added. Read *error after the stream
  // synchronises; AccumulateErrorStatus gives the status Accumulate would have returned. Shape,
  // dtype and space errors are returned at once. The default (host backends) is Accumulate.
  virtual absl::Status AccumulateDeferred(const HeadsView& k, const HeadsView& v,
                                          const TokenLists& evicted, uint64_t max_list,
                                          uint32_t* error, const MomentsView& out) {
    (void)max_list;
    (void)error;
    return Accumulate(k, v, evicted, out);
  }

  // One pass of compaction and summary: for each head h, copies the kept tokens (kept lists,
  // strictly ascending) of k and v, in order, to rows [kept.offsets[h], kept.offsets[h+1]) of
  // kept_k and kept_v (head_dim elements of k's dtype per row), and adds the moments of every
  // token NOT kept to `out` (when out.count is non-null). InvalidArgument as Accumulate, and for
  // kept lists that are not strictly ascending (CPU).
  virtual absl::Status CompactAndAccumulate(const HeadsView& k, const HeadsView& v,
                                            const TokenLists& kept, void* kept_k, void* kept_v,
                                            const MomentsView& out) = 0;

  // CompactAndAccumulate for a compression that does not hold the host, over kept lists its own
  // selection made: the lists' offsets stay in the backend's memory and every list is taken to
  // hold at most k.num_tokens entries. Malformed lists (offsets not from 0 or decreasing, an
  // index out of range, not strictly ascending) set *error (a u32 the caller zeroed before) as
  // AccumulateDeferred does, and then nothing is copied, added or checked. Otherwise every value
  // row, kept or not, is held to the data check on the way (NaN/Inf, or a squared norm beyond
  // float32): the lowest bad head * k.num_tokens + token is written to *bad_value unless it
  // holds a lower one (the caller sets it to ~0 before), so the selection that made the lists
  // need not read V. kept_k and kept_v must be non-null; shape, dtype and space errors are
  // returned at once. Device backends: read *error and *bad_value after the stream synchronises.
  virtual absl::Status CompactAndAccumulateDeferred(const HeadsView& k, const HeadsView& v,
                                                    const TokenLists& kept, void* kept_k,
                                                    void* kept_v, uint32_t* error,
                                                    uint64_t* bad_value,
                                                    const MomentsView& out) = 0;

  // dst += src, head by head (same num_heads and head_dim). Exact for the count; fp32 adds.
  virtual absl::Status Merge(const MomentsView& dst, const ConstMomentsView& src) = 0;

  // Decode-side attention (see the top of this file). Rows of the output for q heads whose kv
  // head has no kept token and no summary are zero. InvalidArgument on shape/space mismatches.
  virtual absl::Status Attention(const AttentionParams& params) = 0;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_MOMENT_OPS_H_
