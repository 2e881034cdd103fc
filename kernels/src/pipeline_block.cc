// Block-wise compression (KeyDiff's block prompt processing): a per-layer working set of at most
// budget + block_size tokens per head, evicted down to the budget after each block.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "cpu/moments_aware.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "pipeline_stages.h"

namespace kvcomp {
namespace {

size_t ElemBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

class BlockCompressorImpl final : public BlockCompressor {
 public:
  BlockCompressorImpl(Backend& backend, const KvLayout& layout, const CompressionPolicy& policy,
                      BlockCompressorOptions options, uint64_t budget)
      : backend_(backend),
        layout_(layout),
        policy_(policy),
        options_(std::move(options)),
        budget_(budget),
        block_(policy.block_size),
        capacity_(budget + policy.block_size),
        row_(layout.head_dim * ElemBytes(layout.dtype)),
        layers_(layout.num_layers) {}

  absl::Status Init() {
    for (Layer& l : layers_) {
      const uint64_t rows = uint64_t{layout_.num_kv_heads} * capacity_;
      KVCOMP_ASSIGN_OR_RETURN(l.keys, Buffer::Allocate(HostAllocator(), rows * row_));
      KVCOMP_ASSIGN_OR_RETURN(l.values, Buffer::Allocate(HostAllocator(), rows * row_));
      l.positions.assign(rows, 0);
    }
    moments_.has_moments = pipeline_internal::StoresMoments(backend_, policy_, 0, 0);
    moments_.Reset(layout_, 0);
    return absl::OkStatus();
  }

  absl::Status Append(uint32_t layer, const HeadsView& keys, const HeadsView& values) override {
    if (finished_) return absl::FailedPreconditionError("BlockCompressor already finished");
    if (layer >= layout_.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %u of %u", layer, layout_.num_layers));
    }
    KVCOMP_RETURN_IF_ERROR(CheckCompactArgs(keys, values, MemorySpace::kHost));
    if (keys.dtype != layout_.dtype || keys.num_heads != layout_.num_kv_heads ||
        keys.head_dim != layout_.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "block [%u, %u, %u] %s does not match the layout %s", keys.num_heads, keys.num_tokens,
          keys.head_dim, DTypeName(keys.dtype), layout_.DebugString()));
    }
    if (keys.num_tokens > block_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("block of %u tokens exceeds block_size %u", keys.num_tokens, block_));
    }
    Layer& l = layers_[layer];
    if (l.seen + keys.num_tokens > KvLayout::kMaxTokens) {
      return absl::InvalidArgumentError("sequence longer than 2^31 tokens");
    }
    // NaN/Inf keys: rejected before they enter the working set.
    {
      std::vector<float> sq(uint64_t{keys.num_heads} * keys.num_tokens);
      ScoreParams knorm;
      knorm.scorer = Scorer::kKnorm;
      KVCOMP_RETURN_IF_ERROR(backend_.scoring().Score(keys, knorm, TokenPositions{}, sq.data()));
    }
    // Values are held to the same check.
    KVCOMP_RETURN_IF_ERROR(backend_.scoring().CheckFinite(values, "values"));
    const size_t eb = ElemBytes(keys.dtype);
    for (uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      for (uint64_t t = 0; t < keys.num_tokens; ++t) {
        const uint64_t dst = uint64_t{h} * capacity_ + l.count + t;
        std::memcpy(l.keys.as<char>() + dst * row_,
                    static_cast<const char*>(keys.data) + keys.offset(h, t) * eb, row_);
        std::memcpy(l.values.as<char>() + dst * row_,
                    static_cast<const char*>(values.data) + values.offset(h, t) * eb, row_);
        l.positions[dst] = static_cast<uint32_t>(l.seen + t);
      }
    }
    l.count += keys.num_tokens;
    l.seen += keys.num_tokens;
    peak_ = std::max(peak_, l.count);
    if (l.count > budget_) return Evict(layer);
    return absl::OkStatus();
  }

  absl::StatusOr<CompressedCache> Finish() override {
    if (finished_) return absl::FailedPreconditionError("BlockCompressor already finished");
    const uint64_t seen = layers_[0].seen;
    for (uint32_t i = 0; i < layout_.num_layers; ++i) {
      if (layers_[i].seen != seen) {
        return absl::FailedPreconditionError(
            absl::StrFormat("layer %u saw %u tokens, layer 0 saw %u", i, layers_[i].seen, seen));
      }
    }
    if (seen == 0) return absl::InvalidArgumentError("empty sequence (no block appended)");
    finished_ = true;
    CompressedCache out;
    out.policy = policy_;
    out.has_moments = moments_.has_moments;
    out.Reset(layout_, seen);
    if (out.has_moments) {
      out.moment_count = std::move(moments_.moment_count);
      out.moment_key_sum = std::move(moments_.moment_key_sum);
      out.moment_value_sum = std::move(moments_.moment_value_sum);
      out.moment_vk_sum = std::move(moments_.moment_vk_sum);
    }
    for (uint32_t i = 0; i < layout_.num_layers; ++i) {
      const Layer& l = layers_[i];
      for (uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
        const uint64_t base = uint64_t{h} * capacity_;
        out.kept[out.head_index(i, h)] = static_cast<uint32_t>(l.count);
        out.positions.insert(out.positions.end(), l.positions.begin() + base,
                             l.positions.begin() + base + l.count);
        out.keys.insert(out.keys.end(), l.keys.as<uint8_t>() + base * row_,
                        l.keys.as<uint8_t>() + (base + l.count) * row_);
        out.values.insert(out.values.end(), l.values.as<uint8_t>() + base * row_,
                          l.values.as<uint8_t>() + (base + l.count) * row_);
      }
    }
    KVCOMP_RETURN_IF_ERROR(
        pipeline_internal::CodecStage(backend_, policy_, options_.projection.get(), &out,
                                      options_.pq.get()));
    return out;
  }

  uint64_t budget() const override { return budget_; }
  uint64_t tokens_seen(uint32_t layer) const override {
    return layer < layers_.size() ? layers_[layer].seen : 0;
  }
  uint64_t peak_tokens_per_head() const override { return peak_; }

 private:
  struct Layer {
    Buffer keys;                      // [heads, capacity, head_dim]
    Buffer values;                    // [heads, capacity, head_dim]
    std::vector<uint32_t> positions;  // [heads, capacity]
    uint64_t count = 0;               // tokens held per head
    uint64_t seen = 0;                // tokens appended so far
  };

  // Scores the working set, keeps `budget_` per head, hands the rest to the hook and the moment
  // stage, then compacts the working set in place (kept rows ascending, so a forward copy).
  absl::Status Evict(uint32_t layer) {
    Layer& l = layers_[layer];
    const uint32_t heads = layout_.num_kv_heads;
    const uint64_t n = l.count;
    HeadsView kv = {l.keys.data(),
                    layout_.dtype,
                    heads,
                    n,
                    layout_.head_dim,
                    layout_.head_dim,
                    capacity_ * layout_.head_dim,
                    MemorySpace::kHost};
    HeadsView vv = kv;
    vv.data = l.values.data();
    std::vector<uint32_t> pos(uint64_t{heads} * n);
    for (uint32_t h = 0; h < heads; ++h) {
      std::copy_n(l.positions.begin() + uint64_t{h} * capacity_, n, pos.begin() + h * n);
    }
    TokenPositions tp{pos.data(), 0, l.seen};
    std::vector<float> scores(uint64_t{heads} * n);
    KVCOMP_RETURN_IF_ERROR(
        backend_.scoring().Score(kv, ScoreParamsFromPolicy(policy_, layer), tp, scores.data()));
    SelectParams sel;
    sel.kept_per_head = budget_;
    sel.head_budget = HeadBudget::kUniform;
    sel.protect = policy_.protect;
    sel.n_sink = policy_.n_sink;
    sel.n_recent = policy_.EffectiveRecent(budget_);
    if (policy_.moment_aware) {  // docs/moment_aware.md; the layer's summary so far is the prior
      const uint64_t h0 = uint64_t{layer} * heads;
      const bool m = moments_.has_moments;
      KVCOMP_RETURN_IF_ERROR(moments_internal::MomentAwareRescore(
          kv, sel, tp, m ? moments_.moment_count.data() + h0 : nullptr,
          m ? moments_.moment_key_sum.data() + h0 * layout_.head_dim : nullptr, scores.data()));
    }
    std::vector<uint32_t> counts(heads), kept(KeptCapacity(heads, n, budget_));
    KVCOMP_RETURN_IF_ERROR(backend_.scoring().Select(scores.data(), heads, n, sel, tp,
                                                     KeptIndices{counts.data(), kept.data()}));
    pipeline_internal::LayerEviction e;
    e.layer = layer;
    e.keys = kv;
    e.values = vv;
    e.offsets.assign(heads + 1, 0);
    std::vector<uint32_t> evicted_pos;
    uint64_t k_off = 0;
    for (uint32_t h = 0; h < heads; ++h) {
      uint64_t j = 0;
      for (uint64_t t = 0; t < n; ++t) {
        if (j < counts[h] && kept[k_off + j] == t) {
          ++j;
        } else {
          e.evicted.push_back(static_cast<uint32_t>(t));
          evicted_pos.push_back(pos[uint64_t{h} * n + t]);
        }
      }
      k_off += counts[h];
      e.offsets[h + 1] = e.evicted.size();
    }
    if (options_.on_evict) {
      for (uint32_t h = 0; h < heads; ++h) {
        const uint64_t b = e.offsets[h], len = e.offsets[h + 1] - e.offsets[h];
        EvictedTokens t{layer,
                        h,
                        kv,
                        vv,
                        absl::Span<const uint32_t>(e.evicted.data() + b, len),
                        absl::Span<const uint32_t>(evicted_pos.data() + b, len)};
        KVCOMP_RETURN_IF_ERROR(options_.on_evict(t));
      }
    }
    if (moments_.has_moments) {
      KVCOMP_RETURN_IF_ERROR(pipeline_internal::MomentStage(backend_, e, &moments_));
    }
    k_off = 0;
    for (uint32_t h = 0; h < heads; ++h) {
      const uint64_t base = uint64_t{h} * capacity_;
      for (uint32_t r = 0; r < counts[h]; ++r) {
        const uint64_t src = base + kept[k_off + r], dst = base + r;
        if (src == dst) continue;
        std::memcpy(l.keys.as<char>() + dst * row_, l.keys.as<char>() + src * row_, row_);
        std::memcpy(l.values.as<char>() + dst * row_, l.values.as<char>() + src * row_, row_);
        l.positions[dst] = l.positions[src];
      }
      k_off += counts[h];
    }
    l.count = counts[0];
    return absl::OkStatus();
  }

  Backend& backend_;
  const KvLayout layout_;
  const CompressionPolicy policy_;
  const BlockCompressorOptions options_;
  const uint64_t budget_;
  const uint64_t block_;
  const uint64_t capacity_;
  const size_t row_;
  std::vector<Layer> layers_;
  CompressedCache moments_;  // only the moment arrays are used (all layers)
  uint64_t peak_ = 0;
  bool finished_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BlockCompressor>> BlockCompressor::Create(
    Backend& backend, const KvLayout& layout, const CompressionPolicy& policy,
    BlockCompressorOptions options) {
  KVCOMP_RETURN_IF_ERROR(layout.Validate());
  KVCOMP_RETURN_IF_ERROR(policy.ValidateFor(layout.head_dim));
  if (backend.space() != MemorySpace::kHost) {
    return absl::UnimplementedError("block-wise compression runs on the CPU backend only");
  }
  if (policy.block_size == 0) {
    return absl::InvalidArgumentError("block-wise compression needs policy.block_size > 0");
  }
  if (policy.scorer == Scorer::kSnapKV) {
    return absl::InvalidArgumentError(
        "snapkv cannot run block-wise (its queries exist only once the sequence is complete)");
  }
  if (policy.head_budget == HeadBudget::kAdaKV) {
    return absl::InvalidArgumentError(
        "adakv head budgets are not supported block-wise (use uniform)");
  }
  KVCOMP_RETURN_IF_ERROR(pipeline_internal::CodecsAvailable(
      backend, policy, options.projection.get(), options.pq.get(), layout));
  uint64_t budget = options.budget;
  if (budget == 0) budget = policy.token_budget;
  if (budget == 0 && options.expected_tokens > 0) {
    budget = policy.KeptPerHead(options.expected_tokens);
    if (budget == 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("budget of zero: %u expected tokens at ratio %g keep none",
                          options.expected_tokens, policy.ratio));
    }
  }
  if (budget == 0) {
    return absl::InvalidArgumentError(
        "budget of zero: set options.budget, policy.token_budget or options.expected_tokens");
  }
  if (budget > KvLayout::kMaxTokens) return absl::InvalidArgumentError("budget beyond 2^31");
  auto impl =
      std::make_unique<BlockCompressorImpl>(backend, layout, policy, std::move(options), budget);
  KVCOMP_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<BlockCompressor>(std::move(impl));
}

}  // namespace kvcomp
