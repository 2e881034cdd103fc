#include "kvcomp/core/layout.h"

#include "absl/strings/str_format.h"

namespace kvcomp {

bool IsSupportedHeadDim(uint32_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

absl::Status KvLayout::Validate() const {
  if (num_layers == 0 || num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layout: num_layers %u out of range [1, %u]", num_layers, kMaxLayers));
  }
  if (num_kv_heads == 0 || num_kv_heads > kMaxKvHeads) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layout: num_kv_heads %u out of range [1, %u]", num_kv_heads, kMaxKvHeads));
  }
  if (num_q_heads == 0 || num_q_heads > kMaxQHeads || num_q_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layout: num_q_heads %u must be a multiple of num_kv_heads %u and at most %u",
        num_q_heads, num_kv_heads, kMaxQHeads));
  }
  if (!IsSupportedHeadDim(head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layout: head_dim %u unsupported (64, 128 or 256)", head_dim));
  }
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layout: dtype %s is not an input type (f32, f16 or bf16)", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

std::string KvLayout::DebugString() const {
  return absl::StrFormat("KvLayout{layers=%u kv_heads=%u q_heads=%u head_dim=%u dtype=%s}",
                         num_layers, num_kv_heads, num_q_heads, head_dim, DTypeName(dtype));
}

}  // namespace kvcomp
