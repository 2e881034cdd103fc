// CUDA MomentOps: launchers of moments_kernels.cuh and attention_kernels.cuh. Argument checks
// are the CPU backend's (moments_cpu_internal.h) with the device space; the per-head sizes the
// grids need (list offsets, kept offsets) are copied to the host first, and index lists are
// checked on the device, so bad input is InvalidArgument, never a fault. Each op synchronizes
// its stream once at the end to report data errors found on the device, except
// AccumulateDeferred, which leaves its verdict in device memory for the caller.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../cpu/moments_cpu_internal.h"
#include "absl/strings/str_format.h"
#include "attention_kernels.cuh"
#include "cuda_ops.h"
#include "cuda_status.h"
#include "kvcomp/core/status.h"
#include "moments_kernels.cuh"

namespace kvcomp {
namespace {

using moments_internal::CheckAttention;
using moments_internal::CheckCompactArgs;
using moments_internal::CheckConstMomentsView;
using moments_internal::CheckKvPair;
using moments_internal::CheckMomentsView;
using moments_internal::CheckTokenLists;

absl::Status UnsupportedHeadDim(uint32_t d) {
  return absl::InvalidArgumentError(
      absl::StrFormat("moments (CUDA): head_dim %u (64, 128 or 256)", d));
}

template <typename T>
cudaError_t MomentsByDim(uint32_t d, bool compact, const moments_cuda::MomentKernelParams& p,
                         uint64_t chunks, cudaStream_t s) {
  using moments_cuda::LaunchMomentKernel;
  switch (d) {
    case 64:
      return compact ? LaunchMomentKernel<T, 64, true>(p, chunks, s)
                     : LaunchMomentKernel<T, 64, false>(p, chunks, s);
    case 128:
      return compact ? LaunchMomentKernel<T, 128, true>(p, chunks, s)
                     : LaunchMomentKernel<T, 128, false>(p, chunks, s);
    default:
      return compact ? LaunchMomentKernel<T, 256, true>(p, chunks, s)
                     : LaunchMomentKernel<T, 256, false>(p, chunks, s);
  }
}

cudaError_t LaunchMoments(DType dtype, uint32_t d, bool compact,
                          const moments_cuda::MomentKernelParams& p, uint64_t chunks,
                          cudaStream_t s) {
  switch (dtype) {
    case DType::kF32:
      return MomentsByDim<float>(d, compact, p, chunks, s);
    case DType::kF16:
      return MomentsByDim<__half>(d, compact, p, chunks, s);
    default:
      return MomentsByDim<__nv_bfloat16>(d, compact, p, chunks, s);
  }
}

template <typename Q, typename T>
cudaError_t AttentionByDim(uint32_t d, const attention_cuda::AttentionKernelParams& p, uint32_t hk,
                           cudaStream_t s) {
  using attention_cuda::LaunchAttention;
  switch (d) {
    case 64:
      return LaunchAttention<Q, T, 64>(p, hk, s);
    case 128:
      return LaunchAttention<Q, T, 128>(p, hk, s);
    default:
      return LaunchAttention<Q, T, 256>(p, hk, s);
  }
}

template <typename T>
cudaError_t AttentionByQuery(bool f32_queries, uint32_t d,
                             const attention_cuda::AttentionKernelParams& p, uint32_t hk,
                             cudaStream_t s) {
  return f32_queries ? AttentionByDim<float, T>(d, p, hk, s) : AttentionByDim<T, T>(d, p, hk, s);
}

// Queries are f32 or the kept K/V's dtype.
cudaError_t LaunchAttention(DType kv, DType q, uint32_t d,
                            const attention_cuda::AttentionKernelParams& p, uint32_t hk,
                            cudaStream_t s) {
  const bool f32q = q == DType::kF32;
  switch (kv) {
    case DType::kF32:
      return AttentionByDim<float, float>(d, p, hk, s);
    case DType::kF16:
      return AttentionByQuery<__half>(f32q, d, p, hk, s);
    default:
      return AttentionByQuery<__nv_bfloat16>(f32q, d, p, hk, s);
  }
}

class CudaMomentOps final : public MomentOps {
 public:
  explicit CudaMomentOps(CudaContext* ctx) : ctx_(ctx) {}

  absl::Status Accumulate(const HeadsView& k, const HeadsView& v, const TokenLists& evicted,
                          const MomentsView& out) override {
    KVCOMP_RETURN_IF_ERROR(CheckKvPair(k, v, MemorySpace::kDevice));
    KVCOMP_RETURN_IF_ERROR(
        CheckTokenLists(evicted, k.num_heads, MemorySpace::kDevice, "moments: evicted"));
    KVCOMP_RETURN_IF_ERROR(
        CheckMomentsView(out, k.num_heads, k.head_dim, MemorySpace::kDevice, "moments: out"));
    return Run(k, v, evicted, nullptr, nullptr, out, /*compact=*/false);
  }

  absl::Status AccumulateDeferred(const HeadsView& k, const HeadsView& v,
                                  const TokenLists& evicted, uint64_t max_list, uint32_t* error,
                                  const MomentsView& out) override {
    KVCOMP_RETURN_IF_ERROR(CheckKvPair(k, v, MemorySpace::kDevice));
    KVCOMP_RETURN_IF_ERROR(
        CheckTokenLists(evicted, k.num_heads, MemorySpace::kDevice, "moments: evicted"));
    KVCOMP_RETURN_IF_ERROR(
        CheckMomentsView(out, k.num_heads, k.head_dim, MemorySpace::kDevice, "moments: out"));
    if (error == nullptr) return absl::InvalidArgumentError("moments: null error word");
    KVCOMP_RETURN_IF_ERROR(CheckAligned(k, v, nullptr, nullptr, /*compact=*/false));
    const uint32_t heads = k.num_heads;
    if (heads == 0) return absl::OkStatus();
    // The lists are checked on the device; the moment kernel reads the verdict and does nothing
    // over bad lists, so they can never be read out of range.
    moments_cuda::CheckLists<<<dim3(16, heads), 256, 0, ctx_->stream>>>(
        evicted.indices, evicted.offsets, k.num_tokens, /*ascending=*/false, error, max_list);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    moments_cuda::MomentKernelParams p = Params(k, v, evicted, nullptr, nullptr, out);
    p.abort = error;
    return LaunchSized(k, p, max_list, /*compact=*/false);
  }

  absl::Status CompactAndAccumulate(const HeadsView& k, const HeadsView& v, const TokenLists& kept,
                                    void* kept_k, void* kept_v, const MomentsView& out) override {
    KVCOMP_RETURN_IF_ERROR(CheckCompactArgs(k, v, kept, out, MemorySpace::kDevice));
    return Run(k, v, kept, kept_k, kept_v, out, /*compact=*/true);
  }

  absl::Status CompactAndAccumulateDeferred(const HeadsView& k, const HeadsView& v,
                                            const TokenLists& kept, void* kept_k, void* kept_v,
                                            uint32_t* error, uint64_t* bad_value,
                                            const MomentsView& out) override {
    KVCOMP_RETURN_IF_ERROR(CheckCompactArgs(k, v, kept, out, MemorySpace::kDevice));
    if (error == nullptr || bad_value == nullptr || kept_k == nullptr || kept_v == nullptr) {
      return absl::InvalidArgumentError("moments: null error word, value check or kept outputs");
    }
    KVCOMP_RETURN_IF_ERROR(CheckAligned(k, v, kept_k, kept_v, /*compact=*/true));
    const uint32_t heads = k.num_heads;
    if (heads == 0 || k.num_tokens == 0) return absl::OkStatus();
    // The lists are checked on the device (strictly ascending, in range, at most num_tokens
    // long); the moment kernel reads the verdict and does nothing over bad lists.
    moments_cuda::CheckLists<<<dim3(16, heads), 256, 0, ctx_->stream>>>(
        kept.indices, kept.offsets, k.num_tokens, /*ascending=*/true, error, k.num_tokens);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    moments_cuda::MomentKernelParams p = Params(k, v, kept, kept_k, kept_v, out);
    p.abort = error;
    p.bad_value = reinterpret_cast<unsigned long long*>(bad_value);
    return LaunchSized(k, p, k.num_tokens, /*compact=*/true);
  }

  absl::Status Merge(const MomentsView& dst, const ConstMomentsView& src) override {
    KVCOMP_RETURN_IF_ERROR(
        CheckMomentsView(dst, dst.num_heads, dst.head_dim, MemorySpace::kDevice, "merge: dst"));
    KVCOMP_RETURN_IF_ERROR(CheckConstMomentsView(src, dst.num_heads, dst.head_dim,
                                                 MemorySpace::kDevice, "merge: src"));
    const uint64_t d = dst.head_dim, h = dst.num_heads;
    moments_cuda::AddCounts<<<(h + 255) / 256, 256, 0, ctx_->stream>>>(
        reinterpret_cast<unsigned long long*>(dst.count),
        reinterpret_cast<const unsigned long long*>(src.count), dst.num_heads);
    moments_cuda::AddFloats<<<64, 256, 0, ctx_->stream>>>(dst.key_sum, src.key_sum, h * d);
    moments_cuda::AddFloats<<<64, 256, 0, ctx_->stream>>>(dst.value_sum, src.value_sum, h * d);
    moments_cuda::AddFloats<<<512, 256, 0, ctx_->stream>>>(dst.vk_sum, src.vk_sum, h * d * d);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }

  absl::Status Attention(const AttentionParams& p) override {
    KVCOMP_RETURN_IF_ERROR(CheckAttention(p, MemorySpace::kDevice));
    const RaggedKv& kv = p.kv;
    const uint32_t hk = kv.num_kv_heads, d = kv.head_dim;
    if (p.queries.num_tokens == 0) return absl::OkStatus();
    if (d != 64 && d != 128 && d != 256) return UnsupportedHeadDim(d);
    std::vector<uint64_t> off(hk + 1);
    if (kv.host_offsets != nullptr) {  // the caller's host copy: no read-back, no wait
      std::copy(kv.host_offsets, kv.host_offsets + hk + 1, off.begin());
    } else {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(off.data(), kv.offsets, off.size() * 8,
                                                  cudaMemcpyDeviceToHost, ctx_->stream));
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    }
    KVCOMP_RETURN_IF_ERROR(moments_internal::CheckRaggedOffsets(
        RaggedKv{kv.keys, kv.values, kv.dtype, off.data(), hk, d, MemorySpace::kHost}));
    uint64_t max_kept = 0;
    for (uint32_t h = 0; h < hk; ++h) max_kept = std::max(max_kept, off[h + 1] - off[h]);

    attention_cuda::AttentionKernelParams k;
    k.q = p.queries.data;
    k.q_token_stride = p.queries.token_stride;
    k.q_head_stride = p.queries.head_stride;
    k.nq = static_cast<uint32_t>(p.queries.num_tokens);
    k.group = p.queries.num_heads / hk;
    k.keys = kv.keys;
    k.values = kv.values;
    k.offsets = kv.offsets;
    k.scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(d));
    const uint64_t rows = uint64_t{k.group} * k.nq;
    const bool virtual_token = p.correct && p.moments.count != nullptr;
    const attention_cuda::Chunking ch = attention_cuda::PartialChunking(
        static_cast<uint32_t>(rows), kv.dtype != DType::kF32, d,
        static_cast<uint32_t>(ctx_->properties.multiProcessorCount), hk, max_kept, virtual_token);
    k.chunk = ch.chunk;
    k.chunks = ch.chunks;
    k.slots = k.chunks + (virtual_token ? 1 : 0);
    const uint64_t slots = uint64_t{hk} * rows * k.slots;
    KVCOMP_ASSIGN_OR_RETURN(Buffer ws,
                            Buffer::Allocate(*ctx_->allocator, slots * (2 + d) * sizeof(float)));
    k.part_max = ws.as<float>();
    k.part_sum = k.part_max + slots;
    k.part_acc = k.part_sum + slots;
    if (virtual_token) {
      k.count = reinterpret_cast<const unsigned long long*>(p.moments.count);
      k.key_sum = p.moments.key_sum;
      k.value_sum = p.moments.value_sum;
      k.vk_sum = p.moments.vk_sum;
    }
    k.out = p.out;
    if (p.queries.dtype != DType::kF32 && p.queries.dtype != kv.dtype) {
      return absl::InvalidArgumentError(
          "attention (CUDA): queries must be f32 or the kept keys' dtype");
    }
    KVCOMP_RETURN_IF_ERROR(CudaStatus(
        LaunchAttention(kv.dtype, p.queries.dtype, d, k, hk, ctx_->stream), "attention kernels"));
    // The workspace is released when `ws` goes out of scope: in stream order with the
    // backend's own allocator (nothing waited for, the caller's next work queues behind), after
    // the kernels with an injected one.
    if (!ctx_->stream_ordered_free) {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status CheckAligned(const HeadsView& k, const HeadsView& v, void* kept_k,
                                   void* kept_v, bool compact) {
    const uint32_t d = k.head_dim;
    if (d != 64 && d != 128 && d != 256) return UnsupportedHeadDim(d);
    const size_t eb = DTypeBytes(k.dtype, 1);
    auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
    if (!aligned(k.data) || !aligned(v.data) || (k.token_stride * eb) % 16 != 0 ||
        (v.token_stride * eb) % 16 != 0 || (k.head_stride * eb) % 16 != 0 ||
        (v.head_stride * eb) % 16 != 0 || (compact && (!aligned(kept_k) || !aligned(kept_v)))) {
      return absl::InvalidArgumentError(
          "moments (CUDA): K/V rows, strides and outputs must be 16-byte aligned");
    }
    return absl::OkStatus();
  }

  static moments_cuda::MomentKernelParams Params(const HeadsView& k, const HeadsView& v,
                                                 const TokenLists& lists, void* kept_k,
                                                 void* kept_v, const MomentsView& out) {
    moments_cuda::MomentKernelParams p;
    p.k = k.data;
    p.v = v.data;
    p.k_token_stride = k.token_stride;
    p.k_head_stride = k.head_stride;
    p.v_token_stride = v.token_stride;
    p.v_head_stride = v.head_stride;
    p.num_tokens = k.num_tokens;
    p.heads = k.num_heads;
    p.list = lists.indices;
    p.list_off = lists.offsets;
    p.kept_k = kept_k;
    p.kept_v = kept_v;
    if (out.count != nullptr) {
      p.count = reinterpret_cast<unsigned long long*>(out.count);
      p.key_sum = out.key_sum;
      p.value_sum = out.value_sum;
      p.vk_sum = out.vk_sum;
    }
    return p;
  }

  // Enqueues the moment kernel over `span` list entries (or tokens) per head; no host wait.
  absl::Status LaunchSized(const HeadsView& k, moments_cuda::MomentKernelParams& p, uint64_t span,
                           bool compact) {
    if (span == 0) return absl::OkStatus();
    const uint32_t heads = k.num_heads, d = k.head_dim;
    const uint32_t sblocks = d == 256 ? 4 : 1;
    const uint64_t chunk = moments_cuda::MomentChunk(span, heads, sblocks,
                                                     ctx_->properties.multiProcessorCount);
    p.chunk = chunk;
    const uint64_t chunks = (span + chunk - 1) / chunk;
    return CudaStatus(LaunchMoments(k.dtype, d, compact, p, chunks, ctx_->stream),
                      "moment kernel");
  }

  absl::Status Run(const HeadsView& k, const HeadsView& v, const TokenLists& lists, void* kept_k,
                   void* kept_v, const MomentsView& out, bool compact) {
    const uint32_t heads = k.num_heads;
    KVCOMP_RETURN_IF_ERROR(CheckAligned(k, v, kept_k, kept_v, compact));
    std::vector<uint64_t> off(heads + 1);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(off.data(), lists.offsets, off.size() * 8,
                                                cudaMemcpyDeviceToHost, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    if (off[0] != 0) return absl::InvalidArgumentError("moments: offsets[0] must be 0");
    uint64_t longest = 0;
    for (uint32_t h = 0; h < heads; ++h) {
      if (off[h + 1] < off[h]) {
        return absl::InvalidArgumentError(
            absl::StrFormat("moments: offsets decrease at head %u", h));
      }
      longest = std::max(longest, off[h + 1] - off[h]);
    }
    if (compact && off[heads] > 0 && (kept_k == nullptr || kept_v == nullptr)) {
      return absl::InvalidArgumentError("moments: null kept_k or kept_v");
    }
    if (compact && longest > k.num_tokens) {
      return absl::InvalidArgumentError("moments: a kept list is longer than the tokens");
    }
    KVCOMP_ASSIGN_OR_RETURN(Buffer err, Buffer::Allocate(*ctx_->allocator, sizeof(unsigned)));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(err.data(), 0, sizeof(unsigned), ctx_->stream));
    if (off[heads] > 0) {
      moments_cuda::CheckLists<<<dim3(16, heads), 256, 0, ctx_->stream>>>(
          lists.indices, lists.offsets, k.num_tokens, compact, err.as<unsigned>(), ~uint64_t{0});
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    unsigned bad = 0;
    KVCOMP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&bad, err.data(), sizeof(bad), cudaMemcpyDeviceToHost, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    if (bad != 0) {
      return absl::InvalidArgumentError(compact
                                            ? "moments: kept tokens out of range or not ascending"
                                            : "moments: evicted token index out of range");
    }

    moments_cuda::MomentKernelParams p = Params(k, v, lists, kept_k, kept_v, out);
    const uint64_t span = compact ? k.num_tokens : longest;
    if (span == 0) return absl::OkStatus();
    KVCOMP_RETURN_IF_ERROR(LaunchSized(k, p, span, compact));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    return absl::OkStatus();
  }

  CudaContext* ctx_;
};

}  // namespace

std::unique_ptr<MomentOps> NewCudaMomentOps(CudaContext* context) {
  return std::make_unique<CudaMomentOps>(context);
}

}  // namespace kvcomp
