#include "put.h"

#include <utility>

#include "absl/status/status.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace service {

absl::StatusOr<ValidPolicy> ValidPolicy::Make(CompressionPolicy policy, uint32_t head_dim,
                                              bool block_wise) {
  KVCOMP_RETURN_IF_ERROR(policy.ValidateFor(head_dim));
  if (block_wise) {
    if (policy.scorer == Scorer::kSnapKV) {
      return absl::InvalidArgumentError("block-wise puts cannot use the snapkv scorer");
    }
    if (policy.block_size == 0) policy.block_size = kDefaultStreamBlockTokens;
  }
  return ValidPolicy(std::move(policy));
}

absl::StatusOr<PutRequest> PutRequest::Make(CacheKey key, const KvLayout& layout,
                                            uint64_t num_tokens, CompressionPolicy policy,
                                            bool block_wise) {
  KVCOMP_RETURN_IF_ERROR(key.Validate());
  KVCOMP_RETURN_IF_ERROR(layout.Validate());
  if (num_tokens == 0 || num_tokens > KvLayout::kMaxTokens) {
    return absl::InvalidArgumentError("num_tokens out of range");
  }
  KVCOMP_ASSIGN_OR_RETURN(ValidPolicy valid,
                          ValidPolicy::Make(std::move(policy), layout.head_dim, block_wise));
  return PutRequest{std::move(key), layout, num_tokens, std::move(valid), block_wise};
}

}  // namespace service
}  // namespace kvcomp
