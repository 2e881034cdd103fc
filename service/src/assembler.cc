#include "assembler.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace service {

bool PutAssembler::Coverage::Overlaps(uint64_t b, uint64_t e) const {
  auto next = ranges_.lower_bound(b);
  if (next != ranges_.end() && next->first < e) return true;
  return next != ranges_.begin() && std::prev(next)->second > b;
}

void PutAssembler::Coverage::Add(uint64_t b, uint64_t e) {
  ranges_.emplace(b, e);
  tokens_ += e - b;
}

PutAssembler::PutAssembler(const KvLayout& layout, uint64_t num_tokens, bool sum_keys)
    : layout_(layout),
      num_tokens_(num_tokens),
      sum_keys_(sum_keys),
      key_cov_(layout.num_layers),
      value_cov_(layout.num_layers),
      next_token_(layout.num_layers, 0) {}

absl::Status PutAssembler::Add(BlockData block) {
  KVCOMP_RETURN_IF_ERROR(Admit(block));
  blocks_.push_back(std::move(block));
  return absl::OkStatus();
}

absl::Status PutAssembler::Cover(const BlockData& block) { return Admit(block); }

absl::Status PutAssembler::Admit(const BlockData& block) {
  const uint32_t lb = block.layer_begin, le = block.layer_end;
  const uint64_t tb = block.token_begin, te = block.token_end;
  if (lb >= le || le > layout_.num_layers || tb >= te || te > num_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("block: layers [", lb, ", ", le, ") x tokens [",
                                                   tb, ", ", te, ") outside the put"));
  }
  if (!block.has_keys() && !block.has_values()) {
    return absl::InvalidArgumentError("block carries neither keys nor values");
  }
  for (const std::vector<HeadsView>* part : {&block.keys, &block.values}) {
    if (part->empty()) continue;
    if (part->size() != le - lb) {
      return absl::InvalidArgumentError("block: one view per layer of its range expected");
    }
    for (const HeadsView& v : *part) {
      if (v.space != part->front().space || v.space != block.space()) {
        return absl::InvalidArgumentError("block: its views are not all in one memory space");
      }
      if (v.data == nullptr || v.dtype != layout_.dtype || v.num_heads != layout_.num_kv_heads ||
          v.num_tokens != te - tb || v.head_dim != layout_.head_dim) {
        return absl::InvalidArgumentError("block: a layer's view does not match the layout");
      }
    }
  }
  // Check every layer before adding, so a refused block leaves no trace.
  for (uint32_t l = lb; l < le; ++l) {
    if ((block.has_keys() && key_cov_[l].Overlaps(tb, te)) ||
        (block.has_values() && value_cov_[l].Overlaps(tb, te))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block overlaps tokens already received (layer ", l, ", tokens ", tb, "..", te, ")"));
    }
  }
  for (uint32_t l = lb; l < le; ++l) {
    if (block.has_keys()) key_cov_[l].Add(tb, te);
    if (block.has_values()) value_cov_[l].Add(tb, te);
  }
  return absl::OkStatus();
}

absl::Status PutAssembler::CheckComplete() const {
  for (uint32_t l = 0; l < layout_.num_layers; ++l) {
    if (key_cov_[l].tokens() != num_tokens_ || value_cov_[l].tokens() != num_tokens_) {
      return absl::FailedPreconditionError(
          absl::StrCat("put incomplete: layer ", l, " has K for ", key_cov_[l].tokens(),
                       " and V for ", value_cov_[l].tokens(), " of ", num_tokens_, " tokens"));
    }
  }
  return absl::OkStatus();
}

bool PutAssembler::KeySumsHelp(const CompressionPolicy& policy) {
  return policy.scorer == Scorer::kManifold || policy.scorer == Scorer::kWindowedManifold;
}

absl::StatusOr<KvCacheView> PutAssembler::View() {
  const uint64_t T = num_tokens_;
  const uint64_t D = layout_.head_dim;
  const uint32_t H = layout_.num_kv_heads;
  const size_t es = DTypeBytes(layout_.dtype, 1);
  const uint64_t chunks = (T + kKeySumChunkTokens - 1) / kKeySumChunkTokens;
  KvCacheView view;
  view.layout = layout_;
  view.num_tokens = T;
  view.keys.resize(layout_.num_layers);
  view.values.resize(layout_.num_layers);
  view.key_sums.resize(layout_.num_layers);
  for (int part = 0; part < 2; ++part) {
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      std::vector<const HeadsView*> covering;
      std::vector<uint64_t> begins;
      for (const BlockData& b : blocks_) {
        const std::vector<HeadsView>& views = part == 0 ? b.keys : b.values;
        if (views.empty() || l < b.layer_begin || l >= b.layer_end) continue;
        covering.push_back(&views[l - b.layer_begin]);
        begins.push_back(b.token_begin);
      }
      HeadsView& dst = part == 0 ? view.keys[l] : view.values[l];
      if (covering.size() == 1) {
        dst = *covering[0];  // one block holds the whole layer: read it in place
        continue;
      }
      // Blocks in token order (they tile the layer: CheckComplete), so each head's chunks of
      // keys are summed right after the copy that completes them, while their rows are in cache.
      // The plain sums only (manifold, windowed_manifold): about a fifth of the copy's time,
      // against keydiff's unit sums at twice the copy's (a norm per row), which would cost
      // every other scorer as much as they save keydiff.
      std::vector<size_t> order(covering.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](size_t a, size_t b) { return begins[a] < begins[b]; });
      auto buf = std::unique_ptr<uint8_t[]>(new uint8_t[layout_.LayerBytes(T)]);
      float* sums = nullptr;
      if (part == 0 && sum_keys_) {
        auto s = std::unique_ptr<float[]>(new float[H * chunks * D]);
        sums = s.get();
        key_sums_.push_back(std::move(s));
        view.key_sums[l] = KeySums{sums, nullptr, T};
      }
      for (uint32_t h = 0; h < H; ++h) {
        uint8_t* head = buf.get() + uint64_t{h} * T * D * es;
        uint64_t summed = 0;  // chunks of this head summed so far
        for (size_t i : order) {
          const HeadsView& src = *covering[i];
          const auto* base = static_cast<const uint8_t*>(src.data);
          uint8_t* out = head + begins[i] * D * es;
          if (src.token_stride == D) {  // the head's tokens are contiguous
            std::memcpy(out, base + src.offset(h, 0) * es, src.num_tokens * D * es);
          } else {
            for (uint64_t t = 0; t < src.num_tokens; ++t) {
              std::memcpy(out + t * D * es, base + src.offset(h, t) * es, D * es);
            }
          }
          if (sums == nullptr) continue;
          const uint64_t end = begins[i] + src.num_tokens;
          const uint64_t complete = end == T ? chunks : end / kKeySumChunkTokens;
          if (complete <= summed) continue;
          const uint64_t at = uint64_t{h} * chunks * D;
          KVCOMP_RETURN_IF_ERROR(
              SumKeysOnHost(HeadsView::Dense(head, layout_.dtype, 1, T, layout_.head_dim), summed,
                            complete, sums + at, nullptr));
          summed = complete;
        }
      }
      dst = HeadsView::Dense(buf.get(), layout_.dtype, layout_.num_kv_heads, T, layout_.head_dim);
      assembled_.push_back(std::move(buf));
    }
  }
  return view;
}

bool PutAssembler::TakeNext(BlockData* out) {
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const BlockData& b = blocks_[i];
    if (!b.has_keys() || !b.has_values()) continue;
    bool ready = true;
    for (uint32_t l = b.layer_begin; l < b.layer_end; ++l) {
      ready = ready && next_token_[l] == b.token_begin;
    }
    if (!ready) continue;
    *out = std::move(blocks_[i]);
    blocks_.erase(blocks_.begin() + static_cast<long>(i));
    for (uint32_t l = out->layer_begin; l < out->layer_end; ++l) next_token_[l] = out->token_end;
    return true;
  }
  return false;
}

void PutAssembler::Clear() {
  blocks_.clear();
  assembled_.clear();
  key_sums_.clear();
}

}  // namespace service
}  // namespace kvcomp
