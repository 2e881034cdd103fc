// The values kvcompd's service layers hand each other for a put, a get and a lookup. None of
// them is a transport type: the data-plane facade (data_plane.cc) builds them from the wire, and
// tests build them directly.
//
// - PutRequest: a put as it enters the service, checked once (key, layout, token count, and
//   the policy as a ValidPolicy); the layers inward trust it.
// - BlockData: one received block as per-layer views of its keys and values over memory it
//   keeps alive; no byte offsets.
// - CacheSummary: what a stored cache is (a put's result, a lookup's answer).
#ifndef KVCOMP_SERVICE_SRC_PUT_H_
#define KVCOMP_SERVICE_SRC_PUT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/tensor.h"
#include "kvcomp/storage/types.h"

namespace kvcomp {
namespace service {

// A compression policy checked for the layout it compresses and the way its put arrives. Only
// Make builds one, so holding a ValidPolicy means the check was done.
class ValidPolicy {
 public:
  // `policy` checked for `head_dim` (CompressionPolicy::ValidateFor). For a block-wise put the
  // snapkv scorer is refused and block_size 0 becomes kDefaultStreamBlockTokens.
  static absl::StatusOr<ValidPolicy> Make(CompressionPolicy policy, uint32_t head_dim,
                                          bool block_wise);
  const CompressionPolicy& get() const { return policy_; }

  // Block-wise puts whose policy gives no block size are fed in blocks of this many tokens.
  static constexpr uint32_t kDefaultStreamBlockTokens = 1024;

 private:
  explicit ValidPolicy(CompressionPolicy policy) : policy_(std::move(policy)) {}
  CompressionPolicy policy_;
};

// A put as it enters the service.
struct PutRequest {
  CacheKey key;
  KvLayout layout;
  uint64_t num_tokens = 0;
  ValidPolicy policy;
  bool block_wise = false;  // compressed block by block as blocks arrive

  // Checks the key, the layout, the token count (1..KvLayout::kMaxTokens) and the policy;
  // InvalidArgument naming the first problem.
  static absl::StatusOr<PutRequest> Make(CacheKey key, const KvLayout& layout, uint64_t num_tokens,
                                         CompressionPolicy policy, bool block_wise);
};

// One block of a put: layers [layer_begin, layer_end) x tokens [token_begin, token_end).
//
// Where its memory may be: host memory (views with MemorySpace::kHost; what UCX receives), or,
// on a daemon whose engine runs on a GPU, device memory of that GPU (every view
// MemorySpace::kDevice, e.g. a block a GPU-to-GPU channel delivered). OpenPut::AddBlock is the
// one entry point for both: on a GPU engine each block is copied into the put's device buffer
// as it arrives (host blocks through the engine's page-locked staging, one upload; device
// blocks by one copy on the device, nothing through the host) and its memory is released at
// once. A CPU engine refuses device blocks (InvalidArgument).
struct BlockData {
  uint32_t layer_begin = 0;
  uint32_t layer_end = 0;
  uint64_t token_begin = 0;
  uint64_t token_end = 0;
  // One view per layer of the range, [num_kv_heads][tokens][head_dim] in the layout's dtype;
  // empty when the block does not carry that part.
  std::vector<HeadsView> keys;
  std::vector<HeadsView> values;
  uint64_t bytes = 0;  // bytes the block holds (K plus V)
  // Keeps the views' memory alive; dropped once the block is consumed, which returns its
  // bytes to the data plane's budget.
  std::shared_ptr<void> memory;

  bool has_keys() const { return !keys.empty(); }
  bool has_values() const { return !values.empty(); }
  // The memory space of its views (the first view's; the assembler checks they agree).
  MemorySpace space() const {
    return has_keys() ? keys[0].space : has_values() ? values[0].space : MemorySpace::kHost;
  }
};

// What a stored cache is.
struct CacheSummary {
  KvLayout layout;
  KeyCodec key_codec = KeyCodec::kRaw;
  ValueCodec value_codec = ValueCodec::kRaw;
  storage::TierKind tier = storage::TierKind::kHost;
  uint64_t original_tokens = 0;
  uint64_t total_kept = 0;
  uint64_t original_bytes = 0;  // uncompressed K and V
  uint64_t stored_bytes = 0;    // encoded cache
  // A put's result only: bytes its data path copied host -> GPU and GPU -> host (0 on the CPU).
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
};

// Which bytes a get returns.
enum class Representation : uint8_t {
  kStored,   // the cache as stored (format v1)
  kDecoded,  // kept tokens decoded to the input dtype: format v1 with raw codecs
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_PUT_H_
