// The CUDA ScoringOps: thin launchers over scoring_kernels.cuh. Each op validates its arguments
// with the shared Check* functions, lays out one workspace allocation, enqueues the kernels on
// the backend's stream and, where the op can find bad data on the device, reads the error slots
// back before returning (the one synchronisation per call).
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <type_traits>

#include "absl/strings/str_format.h"
#include "../env_switch.h"
#include "cuda_status.h"
#include "kvcomp/core/status.h"
#include "scoring_cuda.h"
#include "scoring_kernels.cuh"
#include "scoring_snapkv.cuh"

namespace kvcomp {
namespace cuda {
namespace {

template <typename T>
struct Tag {
  using type = T;
};
template <int D>
struct Dim {
  static constexpr int value = D;
};

// Calls f(Tag<T>{}, Dim<D>{}) for the runtime (dtype, head_dim); the launcher has validated both.
template <typename F>
cudaError_t DispatchTypeDim(DType dtype, uint32_t d, F&& f) {
  auto by_dim = [&](auto tag) -> cudaError_t {
    switch (d) {
      case 64:
        return f(tag, Dim<64>{});
      case 128:
        return f(tag, Dim<128>{});
      case 256:
        return f(tag, Dim<256>{});
      default:
        return cudaErrorInvalidValue;
    }
  };
  switch (dtype) {
    case DType::kF32:
      return by_dim(Tag<float>{});
    case DType::kF16:
      return by_dim(Tag<__half>{});
    case DType::kBF16:
      return by_dim(Tag<__nv_bfloat16>{});
    default:
      return cudaErrorInvalidValue;
  }
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
size_t ElemBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

bool IsCentred(Scorer s) {
  return s == Scorer::kManifold || s == Scorer::kWindowedManifold || s == Scorer::kKeyDiff;
}

// The chunk sums of the keys a centred scorer can take from the data path (KeySums), or null
// (it then computes them: the Stats pass). Windows must start on chunk boundaries.
const float* GivenSums(const ScoreParams& p, uint64_t n) {
  if (p.scorer != Scorer::kManifold && p.scorer != Scorer::kWindowedManifold &&
      p.scorer != Scorer::kKeyDiff) {
    return nullptr;
  }
  if (p.scorer == Scorer::kWindowedManifold && p.window < n && p.window % kStatsRows != 0) {
    return nullptr;
  }
  return p.scorer == Scorer::kKeyDiff ? p.key_sums.unit_sums : p.key_sums.sums;
}

// Rows must start on 16-byte boundaries for the vector loads.
bool RowsAligned(const HeadsView& v) {
  const size_t e = ElemBytes(v.dtype);
  return reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && (v.token_stride * e) % 16 == 0 &&
         (v.num_heads == 1 || (v.head_stride * e) % 16 == 0);
}

// One workspace allocation carved into 256-byte aligned pieces.
class Carver {
 public:
  uint64_t Take(uint64_t bytes) {
    const uint64_t at = size_;
    size_ += (bytes + 255) / 256 * 256;
    return at;
  }
  uint64_t size() const { return size_; }

 private:
  uint64_t size_ = 0;
};

// The workspace of one op call. Offsets are into one Buffer; kNone = not needed.
struct Layout {
  static constexpr uint64_t kNone = ~uint64_t{0};
  uint64_t errors = kNone;
  uint64_t keys = kNone, values = kNone, queries = kNone;  // dense repacks of unaligned views
  uint64_t scores = kNone;
  uint64_t partial = kNone, centres = kNone;
  uint64_t snap_stats = kNone, snap_acc = kNone, snap_max = kNone;
  uint64_t state = kNone, hist = kNone, tile_counts = kNone, plan = kNone, total = kNone;
  uint64_t stage_counts = kNone, flags = kNone;
  uint64_t evicted = kNone;  // the short path's evicted tokens, for the values' check
  uint64_t offsets = kNone;
  uint64_t bytes = 0;

  // Score geometry.
  uint64_t segment = 0;
  uint32_t segments = 0, chunks = 0;
  uint32_t tiles = 0;
};

void LayoutScore(const HeadsView& keys, const ScoreParams& params, bool scores_given,
                 Carver* c, Layout* l) {
  const uint32_t h = keys.num_heads;
  const uint64_t n = keys.num_tokens;
  if (!RowsAligned(keys)) l->keys = c->Take(uint64_t{h} * n * keys.head_dim * ElemBytes(keys.dtype));
  if (!scores_given) l->scores = c->Take(uint64_t{h} * n * sizeof(float));
  if (IsCentred(params.scorer)) {
    l->segment = params.scorer == Scorer::kWindowedManifold ? std::min<uint64_t>(params.window, n)
                                                             : n;
    l->segments = static_cast<uint32_t>(CeilDiv(n, l->segment));
    l->chunks = static_cast<uint32_t>(CeilDiv(l->segment, kStatsRows));
    if (GivenSums(params, n) == nullptr) {
      l->partial =
          c->Take(uint64_t{h} * l->segments * l->chunks * keys.head_dim * sizeof(float));
    }
    l->centres = c->Take(uint64_t{h} * l->segments * keys.head_dim * sizeof(float));
  }
  if (params.scorer == Scorer::kSnapKV) {
    const HeadsView& q = params.queries;
    if (!RowsAligned(q)) {
      l->queries =
          c->Take(uint64_t{q.num_heads} * q.num_tokens * q.head_dim * ElemBytes(q.dtype));
    }
    l->snap_stats = c->Take(uint64_t{q.num_heads} * q.num_tokens * sizeof(float2));
    l->snap_acc = c->Take(uint64_t{q.num_heads} * n * sizeof(float));
    l->snap_max = c->Take(sizeof(uint32_t));
  }
}

void LayoutSelect(uint32_t heads, uint64_t n, const SelectParams& sel, Carver* c, Layout* l) {
  l->tiles = static_cast<uint32_t>(CeilDiv(n, kTile));
  l->state = c->Take((uint64_t{heads} + 1) * sizeof(SegmentState));
  l->hist = c->Take(uint64_t{heads} * kRadixBins * sizeof(uint32_t));
  l->tile_counts = c->Take(uint64_t{heads} * l->tiles * sizeof(TileCounts));
  l->plan = c->Take(uint64_t{heads} * l->tiles * sizeof(TilePlan));
  l->total = c->Take(sizeof(unsigned long long));
  if (sel.head_budget == HeadBudget::kAdaKV && heads > 1) {
    l->stage_counts = c->Take(uint64_t{heads} * sizeof(uint32_t));
    l->flags = c->Take(uint64_t{heads} * n);
  }
}

// Sets every segment's state and zeroes its histogram. grid (segments), kThreads threads.
__global__ void InitSegmentsKernel(SegmentState* state, uint32_t* hist, uint32_t need) {
  const uint32_t s = blockIdx.x;
  if (threadIdx.x == 0) state[s] = SegmentState{0, need, need > 0 ? 1u : 0u, 0};
  for (int b = threadIdx.x; b < kRadixBins; b += kThreads) hist[uint64_t{s} * kRadixBins + b] = 0;
}

// offsets[h] = sum counts[0..h), offsets[H] = total. One block of kThreads threads.
__global__ void OffsetsKernel(const uint32_t* counts, uint32_t heads,
                              unsigned long long* offsets) {
  __shared__ uint32_t scratch[33];
  unsigned long long base = 0;
  for (uint32_t h0 = 0; h0 < heads; h0 += kThreads) {
    const uint32_t h = h0 + threadIdx.x;
    const uint32_t c = h < heads ? counts[h] : 0;
    uint32_t total;
    const uint32_t before = BlockExclusiveScan(c, scratch, &total);
    if (h < heads) offsets[h] = base + before;
    base += total;
  }
  if (threadIdx.x == 0) offsets[heads] = base;
}

PositionInfo MakePositions(const TokenPositions& p, uint64_t n) {
  return PositionInfo{p.data, p.offset, p.sequence_length, n};
}

// Longest head the one-block selection takes: kShortSelectMaxTokens, or
// KVCOMP_CUDA_SHORT_SELECT_MAX_TOKENS (0 = always the tiled path; at most kShortSelectCapacity),
// for timing either path on the same input.
uint64_t ShortSelectMaxTokens() {
  static const uint64_t max_tokens = [] {
    const char* env = std::getenv("KVCOMP_CUDA_SHORT_SELECT_MAX_TOKENS");
    if (env == nullptr || *env == '\0') return kShortSelectMaxTokens;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (end == env || *end != '\0') return kShortSelectMaxTokens;
    return std::min<uint64_t>(v, kShortSelectCapacity);
  }();
  return max_tokens;
}

// The launch of `grid` BlockSelectKernel<true> blocks in clusters of `blocks` (`attr` holds the
// cluster dimension the configuration points to).
cudaLaunchConfig_t ClusterLaunch(uint32_t grid, uint32_t blocks, size_t smem, cudaStream_t stream,
                                 cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = blocks;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kSelectThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

// Whether `device` can hold a cluster of kClusterMaxBlocks BlockSelectKernel blocks with the
// largest slice (so every smaller launch fits too): sm_90 or later, and the occupancy calculator
// places at least one such cluster (a partitioned or shared device may not). Asked once per
// device; a device that cannot keeps the tiled path.
bool ClusterSelectFits(int device, const cudaDeviceProp& properties) {
  if (properties.major < 9) return false;
  static std::mutex mu;
  static std::map<int, bool>* fits = new std::map<int, bool>();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = fits->find(device); it != fits->end()) return it->second;
  int current = device;
  cudaGetDevice(&current);
  if (current != device) cudaSetDevice(device);  // the attribute and the query are per device
  bool ok = cudaFuncSetAttribute(BlockSelectKernel<true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(BlockSelectSmem(kClusterSliceCapacity))) ==
            cudaSuccess;
  if (ok) {
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t config =
        ClusterLaunch(kClusterMaxBlocks, kClusterMaxBlocks,
                      BlockSelectSmem(kClusterSliceCapacity), nullptr, &cluster);
    int clusters = 0;
    ok = cudaOccupancyMaxActiveClusters(&clusters, BlockSelectKernel<true>, &config) ==
             cudaSuccess &&
         clusters > 0;
  }
  cudaGetLastError();  // a refusal above is an answer, not a pending error
  if (current != device) cudaSetDevice(current);
  (*fits)[device] = ok;
  return ok;
}

// BlockSelectKernel<false> over `heads` heads (one block each) of at most `longest` tokens.
cudaError_t LaunchShortSelect(const BlockSelectParams& p, uint32_t heads, uint64_t longest,
                              cudaStream_t stream) {
  const cudaError_t e =
      cudaFuncSetAttribute(BlockSelectKernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(BlockSelectSmem(kShortSelectCapacity)));
  if (e != cudaSuccess) return e;
  BlockSelectKernel<false><<<heads, kSelectThreads, BlockSelectSmem(longest), stream>>>(p, 0);
  return cudaGetLastError();
}

// How a uniform budget over heads is selected.
enum class SelectPath {
  kTiled,    // Radix* to Gather over (head, tile) grids; every budget
  kShort,    // BlockSelect, one block per head, then GatherRows
  kCluster,  // BlockSelect, one cluster per head (sm_90), then GatherRows
};

static_assert(kKeySumChunkTokens == kStatsRows, "KeySums chunks are the Stats pass's chunks");

// A deferred check record is the device's error slots, copied as they are.
static_assert(sizeof(ErrorSlots) == sizeof(DeferredCheck) &&
                  offsetof(ErrorSlots, bad_key) == offsetof(DeferredCheck, bad_key) &&
                  offsetof(ErrorSlots, bad_query) == offsetof(DeferredCheck, bad_query) &&
                  offsetof(ErrorSlots, bad_score) == offsetof(DeferredCheck, bad_score) &&
                  offsetof(ErrorSlots, bad_value) == offsetof(DeferredCheck, bad_value),
              "ErrorSlots and DeferredCheck share one layout");

class CudaScoringOps final : public ScoringOps {
 public:
  explicit CudaScoringOps(CudaContext* ctx) : ctx_(ctx) {}
  ~CudaScoringOps() override {
    if (host_errors_ != nullptr) cudaFreeHost(host_errors_);
  }

  absl::Status Score(const HeadsView& keys, const ScoreParams& params,
                     const TokenPositions& positions, float* scores) override {
    KVCOMP_RETURN_IF_ERROR(CheckScoreArgs(keys, params, positions, MemorySpace::kDevice));
    if (scores == nullptr) return absl::InvalidArgumentError("null scores output");
    Carver c;
    Layout l;
    l.errors = c.Take(sizeof(ErrorSlots));
    LayoutScore(keys, params, /*scores_given=*/true, &c, &l);
    KVCOMP_ASSIGN_OR_RETURN(Buffer ws, Allocate(c.size()));
    KVCOMP_RETURN_IF_ERROR(ResetErrors(ws, l));
    KVCOMP_RETURN_IF_ERROR(EnqueueScore(keys, params, positions, scores, ws, l));
    return ReadErrors(ws, l, keys.num_tokens, params.queries.num_tokens);
  }

  absl::Status Select(const float* scores, uint32_t num_heads, uint64_t num_tokens,
                      const SelectParams& params, const TokenPositions& positions,
                      KeptIndices out) override {
    KVCOMP_RETURN_IF_ERROR(CheckSelectArgs(num_heads, num_tokens, params));
    if (scores == nullptr) return absl::InvalidArgumentError("null scores");
    if (out.counts == nullptr || out.indices == nullptr) {
      return absl::InvalidArgumentError("null kept outputs");
    }
    Carver c;
    Layout l;
    l.errors = c.Take(sizeof(ErrorSlots));
    LayoutSelect(num_heads, num_tokens, params, &c, &l);
    KVCOMP_ASSIGN_OR_RETURN(Buffer ws, Allocate(c.size()));
    KVCOMP_RETURN_IF_ERROR(ResetErrors(ws, l));
    KVCOMP_RETURN_IF_ERROR(EnqueueSelect(scores, num_heads, num_tokens, params, positions, out,
                                         nullptr, nullptr, nullptr, nullptr, ws, l));
    return ReadErrors(ws, l, num_tokens, 0);
  }

  absl::Status Compact(const HeadsView& keys, const HeadsView& values, const uint32_t* counts,
                       const uint32_t* indices, void* keys_out, void* values_out) override {
    KVCOMP_RETURN_IF_ERROR(CheckCompactArgs(keys, values, MemorySpace::kDevice));
    if (counts == nullptr || indices == nullptr || keys_out == nullptr ||
        values_out == nullptr) {
      return absl::InvalidArgumentError("null compact argument");
    }
    Carver c;
    Layout l;
    if (!RowsAligned(keys)) l.keys = c.Take(Dense(keys));
    if (!RowsAligned(values)) l.values = c.Take(Dense(values));
    l.offsets = c.Take((uint64_t{keys.num_heads} + 1) * sizeof(unsigned long long));
    KVCOMP_ASSIGN_OR_RETURN(Buffer ws, Allocate(c.size()));
    KVCOMP_RETURN_IF_ERROR(Bind());
    KVCOMP_ASSIGN_OR_RETURN(HeadsView k, Repack(keys, ws, l.keys));
    KVCOMP_ASSIGN_OR_RETURN(HeadsView v, Repack(values, ws, l.values));
    auto* offsets = At<unsigned long long>(ws, l.offsets);
    OffsetsKernel<<<1, kThreads, 0, ctx_->stream>>>(counts, keys.num_heads, offsets);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    const dim3 grid(static_cast<uint32_t>(CeilDiv(keys.num_tokens, kTile)), keys.num_heads);
    KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(k.dtype, k.head_dim, [&](auto t, auto d) {
      using T = typename decltype(t)::type;
      constexpr int D = decltype(d)::value;
      CompactKernel<T, D><<<grid, kThreads, 0, ctx_->stream>>>(
          static_cast<const T*>(k.data), static_cast<const T*>(v.data), k.token_stride,
          k.head_stride, v.token_stride, v.head_stride, offsets, indices,
          static_cast<T*>(keys_out), static_cast<T*>(values_out));
      return cudaGetLastError();
    }));
    return absl::OkStatus();
  }

  absl::Status ScoreSelectCompact(const ScoreSelectCompactArgs& a) override {
    KVCOMP_RETURN_IF_ERROR(CheckScoreSelectCompactArgs(a, MemorySpace::kDevice));
    Carver c;
    Layout l;
    l.errors = c.Take(sizeof(ErrorSlots));
    KVCOMP_ASSIGN_OR_RETURN(Buffer ws, EnqueueAll(a, &c, &l));
    if (a.deferred_check != nullptr) {
      // The findings go to the caller's record in stream order; the host does not wait here.
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.deferred_check, At<char>(ws, l.errors),
                                                  sizeof(ErrorSlots), cudaMemcpyDeviceToDevice,
                                                  ctx_->stream));
      return absl::OkStatus();
    }
    return ReadErrors(ws, l, a.keys.num_tokens, a.score.queries.num_tokens);
  }

  absl::Status CheckFinite(const HeadsView& view, const char* what) override {
    KVCOMP_RETURN_IF_ERROR(CheckHeadsView(view, MemorySpace::kDevice, what));
    Carver c;
    Layout l;
    l.errors = c.Take(sizeof(ErrorSlots));
    if (!RowsAligned(view)) l.values = c.Take(Dense(view));
    l.scores = c.Take(uint64_t{view.num_heads} * view.num_tokens * sizeof(float));
    KVCOMP_ASSIGN_OR_RETURN(Buffer ws, Allocate(c.size()));
    KVCOMP_RETURN_IF_ERROR(ResetErrors(ws, l));
    KVCOMP_ASSIGN_OR_RETURN(HeadsView v, Repack(view, ws, l.values));
    KVCOMP_RETURN_IF_ERROR(
        EnqueueRowCheck(v, At<float>(ws, l.scores), &At<ErrorSlots>(ws, l.errors)->bad_value));
    if (host_errors_ == nullptr) {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_errors_, sizeof(ErrorSlots)));
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_errors_, At<char>(ws, l.errors),
                                                sizeof(ErrorSlots), cudaMemcpyDeviceToHost,
                                                ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    const unsigned long long bad = host_errors_->bad_value;
    if (bad != ~0ull) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: NaN or Inf (or a squared norm beyond float32) at head %u, token %u", what,
          bad / view.num_tokens, bad % view.num_tokens));
    }
    return absl::OkStatus();
  }

  // A varlen batch of short requests: every kernel of the short path once for all (request,
  // head) pairs, described by a table of VarHead; anything else request by request.
  absl::Status ScoreSelectCompactVarlen(const ScoreSelectCompactVarlenArgs& a) override {
    KVCOMP_RETURN_IF_ERROR(CheckScoreSelectCompactVarlenArgs(a, MemorySpace::kDevice));
    const uint32_t heads = a.keys.num_heads;
    const uint64_t pairs = uint64_t{a.requests} * heads;
    uint64_t max_n = 0;
    for (uint32_t r = 0; r < a.requests; ++r) {
      max_n = std::max(max_n, a.cu_seqlens[r + 1] - a.cu_seqlens[r]);
    }
    const bool windows = a.score.scorer == Scorer::kWindowedManifold && a.score.window < max_n;
    if (max_n > ShortSelectMaxTokens() || windows || pairs > 65535 ||
        !RowsAligned(a.keys) || !RowsAligned(a.values)) {
      return ScoringOps::ScoreSelectCompactVarlen(a);
    }
    std::vector<VarHead> table(pairs);
    uint64_t rows = 0, max_blocks = 0;
    for (uint32_t r = 0; r < a.requests; ++r) {
      const uint64_t t0 = a.cu_seqlens[r], n = a.cu_seqlens[r + 1] - t0;
      const uint64_t kept = std::min<uint64_t>(a.kept_per_head[r], n);
      max_blocks = std::max(max_blocks, CeilDiv(kept, kGatherRowsPerBlock) +
                                            CeilDiv(n - kept, kGatherRowsPerBlock));
      for (uint32_t h = 0; h < heads; ++h) {
        VarHead& v = table[uint64_t{r} * heads + h];
        v.key_offset = uint64_t{h} * a.keys.head_stride + t0 * a.keys.token_stride;
        v.v_offset = uint64_t{h} * a.values.head_stride + t0 * a.values.token_stride;
        v.flat = uint64_t{heads} * t0 + uint64_t{h} * n;
        v.out_row = rows;
        v.n = static_cast<uint32_t>(n);
        v.kept = static_cast<uint32_t>(kept);
        v.head = h;
        rows += kept;
      }
    }
    const uint64_t total = a.keys.num_tokens;
    const uint32_t d = a.keys.head_dim;
    const bool centred = IsCentred(a.score.scorer);
    const uint64_t chunks = CeilDiv(max_n, kStatsRows);
    Carver c;
    Layout l;
    l.errors = c.Take(sizeof(ErrorSlots));
    const uint64_t table_at = c.Take(pairs * sizeof(VarHead));
    if (a.scores == nullptr) l.scores = c.Take(uint64_t{heads} * total * sizeof(float));
    if (centred) {
      l.partial = c.Take(pairs * chunks * d * sizeof(float));
      l.centres = c.Take(pairs * d * sizeof(float));
    }
    l.evicted = c.Take(uint64_t{heads} * total * sizeof(uint32_t));
    KVCOMP_ASSIGN_OR_RETURN(Buffer ws, Allocate(c.size()));
    KVCOMP_RETURN_IF_ERROR(ResetErrors(ws, l));
    cudaStream_t stream = ctx_->stream;
    auto* var = At<VarHead>(ws, table_at);
    // From pageable memory: the call returns once `table` is no longer needed.
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(var, table.data(), pairs * sizeof(VarHead),
                                                cudaMemcpyHostToDevice, stream));
    auto* errors = At<ErrorSlots>(ws, l.errors);
    float* scores = a.scores != nullptr ? a.scores : At<float>(ws, l.scores);
    const auto rh = static_cast<uint32_t>(pairs);
    if (centred) {
      StatsParams st{};
      st.keys = a.keys.data;
      st.token_stride = a.keys.token_stride;
      st.head_stride = a.keys.head_stride;
      st.n = max_n;
      st.segment = max_n;
      st.segments = 1;
      st.chunks = static_cast<uint32_t>(chunks);
      st.normalize = a.score.scorer == Scorer::kKeyDiff;
      st.partial = At<float>(ws, l.partial);
      st.errors = errors;
      st.var = var;
      KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(a.keys.dtype, d, [&](auto t, auto dd) {
        using T = typename decltype(t)::type;
        constexpr int D = decltype(dd)::value;
        StatsKernel<T, D><<<dim3(st.chunks, 1, rh), kThreads, 0, stream>>>(st);
        return cudaGetLastError();
      }));
      CentreParams cp{};
      cp.partial = st.partial;
      cp.n = max_n;
      cp.segment = max_n;
      cp.segments = 1;
      cp.chunks = st.chunks;
      cp.d = d;
      cp.heads = rh;
      cp.centres = At<float>(ws, l.centres);
      cp.var = var;
      const auto cblocks = static_cast<uint32_t>(CeilDiv(pairs * d, kCentreThreads / 32));
      CentreKernel<<<cblocks, kCentreThreads, 0, stream>>>(cp);
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    ScoreKernelParams sp{};
    sp.keys = a.keys.data;
    sp.token_stride = a.keys.token_stride;
    sp.head_stride = a.keys.head_stride;
    sp.n = max_n;
    sp.scorer = a.score.scorer;
    sp.segment = max_n;
    sp.segments = 1;
    sp.centres = At<float>(ws, l.centres);
    sp.n_sink = a.score.n_sink;
    sp.seed = a.score.seed;
    sp.stream = a.score.stream;
    sp.positions = PositionInfo{nullptr, 0, 0, max_n};
    sp.scores = scores;
    sp.errors = errors;
    sp.heads = rh;
    sp.var = var;  // the values are checked by GatherRows (V read once)
    const dim3 grid(static_cast<uint32_t>(CeilDiv(max_n, kScoreRows)), rh);
    KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(a.keys.dtype, d, [&](auto t, auto dd) {
      using T = typename decltype(t)::type;
      constexpr int D = decltype(dd)::value;
      switch (RowKindOf(a.score.scorer)) {
        case RowKind::kDistance:
          ScoreKernel<T, D, RowKind::kDistance><<<grid, kThreads, 0, stream>>>(sp);
          break;
        case RowKind::kDot:
          ScoreKernel<T, D, RowKind::kDot><<<grid, kThreads, 0, stream>>>(sp);
          break;
        case RowKind::kNorm:
          ScoreKernel<T, D, RowKind::kNorm><<<grid, kThreads, 0, stream>>>(sp);
          break;
      }
      return cudaGetLastError();
    }));
    BlockSelectParams ss{};
    ss.scores = scores;
    ss.heads = rh;
    ss.n = max_n;
    ss.select = a.select;
    ss.counts = a.kept.counts;
    ss.indices = a.kept.indices;
    ss.errors = errors;
    ss.var = var;
    ss.evicted = At<uint32_t>(ws, l.evicted);
    KVCOMP_CUDA_RETURN_IF_ERROR(LaunchShortSelect(ss, rh, max_n, stream));
    GatherRowsParams g{};
    g.keys = a.keys.data;
    g.values = a.values.data;
    g.token_stride = a.keys.token_stride;
    g.v_token_stride = a.values.token_stride;
    g.indices = a.kept.indices;
    g.keys_out = a.keys_out;
    g.values_out = a.values_out;
    g.var = var;
    g.bad_value = &errors->bad_value;
    g.evicted = ss.evicted;
    const dim3 ggrid(static_cast<uint32_t>(max_blocks), rh);
    KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(a.keys.dtype, d, [&](auto t, auto dd) {
      using T = typename decltype(t)::type;
      constexpr int D = decltype(dd)::value;
      GatherRowsKernel<T, D><<<ggrid, kThreads, 0, stream>>>(g);
      return cudaGetLastError();
    }));
    if (sync_varlen_) return ReadVarlenErrors(ws, l, a);
    return absl::OkStatus();
  }

  // Enqueue-only form for the benchmark's graph capture (no error readback).
  void set_sync_varlen(bool sync) { sync_varlen_ = sync; }

  uint64_t WorkspaceBytes(const ScoreSelectCompactArgs& a) const override {
    Carver c;
    Layout l;
    l.errors = c.Take(sizeof(ErrorSlots));
    LayoutAll(a, &c, &l);
    return c.size();
  }

  // The whole fused op without the closing error readback (scoring_cuda.h).
  absl::Status EnqueueOnly(const ScoreSelectCompactArgs& a) {
    KVCOMP_RETURN_IF_ERROR(CheckScoreSelectCompactArgs(a, MemorySpace::kDevice));
    Carver c;
    Layout l;
    l.errors = c.Take(sizeof(ErrorSlots));
    return EnqueueAll(a, &c, &l).status();
  }

 private:
  template <typename P>
  static P* At(const Buffer& ws, uint64_t offset) {
    return offset == Layout::kNone
               ? nullptr
               : reinterpret_cast<P*>(static_cast<char*>(ws.data()) + offset);
  }
  static uint64_t Dense(const HeadsView& v) {
    return uint64_t{v.num_heads} * v.num_tokens * v.head_dim * ElemBytes(v.dtype);
  }

  absl::Status Bind() { return CudaStatus(cudaSetDevice(ctx_->device), "cudaSetDevice"); }

  absl::StatusOr<Buffer> Allocate(uint64_t bytes) {
    KVCOMP_RETURN_IF_ERROR(Bind());
    return Buffer::Allocate(*ctx_->allocator, bytes);
  }

  void LayoutAll(const ScoreSelectCompactArgs& a, Carver* c, Layout* l) const {
    LayoutScore(a.keys, a.score, a.scores != nullptr, c, l);
    if (a.compact && !RowsAligned(a.values)) l->values = c->Take(Dense(a.values));
    LayoutSelect(a.keys.num_heads, a.keys.num_tokens, a.select, c, l);
    if (a.compact && PathOf(a.keys.num_heads, a.keys.num_tokens, a.select) != SelectPath::kTiled) {
      l->evicted = c->Take(uint64_t{a.keys.num_heads} * a.keys.num_tokens * sizeof(uint32_t));
    }
  }

  // A uniform budget over heads goes to the one-block selection up to ShortSelectMaxTokens, then
  // to the cluster selection on devices that hold its clusters (ClusterSelectFits) up to
  // kClusterMaxBlocks * kClusterSliceCapacity tokens per head (KVCOMP_CUDA_CLUSTER_SELECT=0
  // turns it off for comparisons), else to the tiled path, which also takes every AdaKV budget.
  // On an H100 the cluster form was measured even with the one-block form at 8192 tokens and
  // slower for 64 requests of 2048 (as 512 heads), hence the one-block form first.
  SelectPath PathOf(uint32_t heads, uint64_t n, const SelectParams& sel) const {
    if (sel.head_budget != HeadBudget::kUniform && heads != 1) return SelectPath::kTiled;
    if (n <= ShortSelectMaxTokens()) return SelectPath::kShort;
    static const bool cluster_on = internal::SwitchOn("KVCOMP_CUDA_CLUSTER_SELECT");
    if (cluster_on && ClusterBlocks(n, heads, ctx_->properties.multiProcessorCount) != 0 &&
        ClusterSelectFits(ctx_->device, ctx_->properties)) {
      return SelectPath::kCluster;
    }
    return SelectPath::kTiled;
  }

  absl::StatusOr<Buffer> EnqueueAll(const ScoreSelectCompactArgs& a, Carver* c, Layout* l) {
    LayoutAll(a, c, l);
    KVCOMP_ASSIGN_OR_RETURN(Buffer ws, Allocate(c->size()));
    KVCOMP_RETURN_IF_ERROR(ResetErrors(ws, *l));
    KVCOMP_ASSIGN_OR_RETURN(HeadsView keys, Repack(a.keys, ws, l->keys));
    HeadsView values = a.values;  // select only: V is not read
    if (a.compact) {
      KVCOMP_ASSIGN_OR_RETURN(values, Repack(a.values, ws, l->values));
    }
    if (const std::optional<StreamingEnds> ends = StreamingEndsOf(a)) {
      KVCOMP_RETURN_IF_ERROR(EnqueueStreamingEnds(a, *ends, keys, values, ws, *l));
      return ws;
    }
    float* scores = a.scores != nullptr ? a.scores : At<float>(ws, l->scores);
    // Values are held to the keys' data check by the compaction: it reads the kept rows of V to
    // copy them and checks them there, then reads the evicted rows once for the check alone, so
    // V is read once (the score pass reads K only).
    KVCOMP_RETURN_IF_ERROR(EnqueueScore(keys, a.score, a.positions, scores, ws, *l,
                                        /*repacked=*/true, nullptr));
    if (a.rescore) KVCOMP_RETURN_IF_ERROR(a.rescore(scores));
    KVCOMP_RETURN_IF_ERROR(EnqueueSelect(
        scores, a.keys.num_heads, a.keys.num_tokens, a.select, a.positions, a.kept, &keys,
        &values, a.compact ? a.keys_out : nullptr, a.compact ? a.values_out : nullptr, ws, *l,
        /*check_values=*/a.compact));
    return ws;
  }

  // The streaming scorer's kept set without a selection (StreamingEndsKernel): tokens
  // [0, sinks) and the most recent kept - sinks, per head.
  struct StreamingEnds {
    uint32_t kept, sinks;
  };

  // StreamingEnds where the selection would keep exactly them, as the CPU's does: default
  // positions (0 .. n - 1 of a sequence of n tokens), a uniform budget or one head, positions
  // exact in float (n <= 2^24), and a budget that covers every token the selection ranks above
  // the positions (the scorer's sinks and, with protection, the protected sinks and recent
  // tokens); then one pass reads K and V once and writes the kept rows. Else nullopt.
  // KVCOMP_CUDA_STREAMING_ENDS=0 sends streaming through the score pass and the selection, for
  // comparisons.
  static std::optional<StreamingEnds> StreamingEndsOf(const ScoreSelectCompactArgs& a) {
    static const bool on = internal::SwitchOn("KVCOMP_CUDA_STREAMING_ENDS");
    const uint64_t n = a.keys.num_tokens;
    const TokenPositions& pos = a.positions;
    const SelectParams& sel = a.select;
    if (!on || a.score.scorer != Scorer::kStreaming || !a.compact || a.rescore || n == 0 ||
        n > (uint64_t{1} << 24) || pos.data != nullptr || pos.offset != 0 ||
        (pos.sequence_length != 0 && pos.sequence_length != n) ||
        (sel.head_budget != HeadBudget::kUniform && a.keys.num_heads != 1)) {
      return std::nullopt;
    }
    const uint64_t kept = std::min<uint64_t>(sel.kept_per_head, n);
    const uint64_t sinks =
        std::min<uint64_t>(n, std::max<uint64_t>(a.score.n_sink, sel.protect ? sel.n_sink : 0));
    const uint64_t recent = sel.protect ? std::min<uint64_t>(sel.n_recent, n) : 0;
    if (kept < sinks + recent) return std::nullopt;
    return StreamingEnds{static_cast<uint32_t>(kept), static_cast<uint32_t>(sinks)};
  }

  absl::Status EnqueueStreamingEnds(const ScoreSelectCompactArgs& a, const StreamingEnds& ends,
                                    const HeadsView& keys, const HeadsView& values,
                                    const Buffer& ws, const Layout& l) {
    StreamingEndsParams p{};
    p.keys = keys.data;
    p.values = values.data;
    p.token_stride = keys.token_stride;
    p.head_stride = keys.head_stride;
    p.v_token_stride = values.token_stride;
    p.v_head_stride = values.head_stride;
    p.n = keys.num_tokens;
    p.kept = ends.kept;
    p.sinks = ends.sinks;
    p.n_sink = a.score.n_sink;
    p.scores = a.scores;
    p.counts = a.kept.counts;
    p.indices = a.kept.indices;
    p.keys_out = a.keys_out;
    p.values_out = a.values_out;
    p.errors = At<ErrorSlots>(ws, l.errors);
    const dim3 grid(static_cast<uint32_t>(CeilDiv(p.n, kEndsRowsPerBlock)), keys.num_heads);
    KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(keys.dtype, keys.head_dim, [&](auto t, auto d) {
      using T = typename decltype(t)::type;
      constexpr int D = decltype(d)::value;
      StreamingEndsKernel<T, D><<<grid, kThreads, 0, ctx_->stream>>>(p);
      return cudaGetLastError();
    }));
    return absl::OkStatus();
  }

  absl::Status ResetErrors(const Buffer& ws, const Layout& l) {
    KVCOMP_RETURN_IF_ERROR(Bind());
    KVCOMP_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(At<char>(ws, l.errors), 0xFF, sizeof(ErrorSlots), ctx_->stream));
    return absl::OkStatus();
  }

  // Waits for the stream and turns the error slots into a status.
  absl::Status ReadErrors(const Buffer& ws, const Layout& l, uint64_t n, uint64_t q_tokens) {
    if (host_errors_ == nullptr) {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_errors_, sizeof(ErrorSlots)));
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_errors_, At<char>(ws, l.errors),
                                                sizeof(ErrorSlots), cudaMemcpyDeviceToHost,
                                                ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    DeferredCheck e;
    std::memcpy(&e, host_errors_, sizeof(e));
    return DeferredCheckStatus(e, n, q_tokens);
  }

  // A dense copy of a view whose rows are not 16-byte aligned (into ws at `offset`), or the view.
  absl::StatusOr<HeadsView> Repack(const HeadsView& v, const Buffer& ws, uint64_t offset) {
    if (RowsAligned(v)) return v;
    const size_t e = ElemBytes(v.dtype);
    char* dst = At<char>(ws, offset);
    for (uint32_t h = 0; h < v.num_heads; ++h) {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
          dst + uint64_t{h} * v.num_tokens * v.head_dim * e, v.head_dim * e,
          static_cast<const char*>(v.data) + uint64_t{h} * v.head_stride * e, v.token_stride * e,
          v.head_dim * e, v.num_tokens, cudaMemcpyDeviceToDevice, ctx_->stream));
    }
    return HeadsView::Dense(dst, v.dtype, v.num_heads, v.num_tokens, v.head_dim,
                            MemorySpace::kDevice);
  }

  // `values` (optional, not snapkv): checked for NaN/Inf by the same launch as the scores.
  absl::Status EnqueueScore(const HeadsView& keys_in, const ScoreParams& params,
                            const TokenPositions& positions, float* scores, const Buffer& ws,
                            const Layout& l, bool repacked = false,
                            const HeadsView* values = nullptr) {
    KVCOMP_RETURN_IF_ERROR(Bind());
    HeadsView keys = keys_in;
    if (!repacked) {
      KVCOMP_ASSIGN_OR_RETURN(keys, Repack(keys_in, ws, l.keys));
    }
    auto* errors = At<ErrorSlots>(ws, l.errors);
    const uint32_t heads = keys.num_heads;
    const uint64_t n = keys.num_tokens;
    if (params.scorer == Scorer::kSnapKV) {
      KVCOMP_ASSIGN_OR_RETURN(HeadsView q, Repack(params.queries, ws, l.queries));
      SnapKVParams sp;
      sp.keys = keys;
      sp.queries = q;
      sp.pool = params.snapkv_pool;
      sp.stats = At<float2>(ws, l.snap_stats);
      sp.acc = At<float>(ws, l.snap_acc);
      sp.max_key = At<uint32_t>(ws, l.snap_max);
      sp.scores = scores;
      sp.errors = errors;
      return EnqueueSnapKV(sp);
    }
    ScoreKernelParams sp{};
    sp.keys = keys.data;
    sp.token_stride = keys.token_stride;
    sp.head_stride = keys.head_stride;
    sp.n = n;
    sp.scorer = params.scorer;
    sp.segment = l.segment == 0 ? n : l.segment;
    sp.segments = l.segments == 0 ? 1 : l.segments;
    sp.centres = At<float>(ws, l.centres);
    sp.n_sink = params.n_sink;
    sp.seed = params.seed;
    sp.stream = params.stream;
    sp.positions = MakePositions(positions, n);
    sp.scores = scores;
    sp.errors = errors;
    sp.heads = heads;
    if (values != nullptr) {
      sp.values = values->data;
      sp.v_token_stride = values->token_stride;
      sp.v_head_stride = values->head_stride;
    }

    const bool centred = IsCentred(params.scorer);
    // All heads in one launch of each kernel: measured on an H200 (bench/results), launching
    // per L2-sized head group (so the second read of the keys hits L2) lost more to small
    // launches than it saved in device-memory traffic, also with the centre parallel and the
    // score pass of one group overlapping the next group's stats pass on a second stream
    // (gpu-scoring-20261126.md, commit cb50884).
    {
      const uint32_t h0 = 0, g = heads;
      const float* given = centred ? GivenSums(params, n) : nullptr;
      if (centred && given == nullptr) {
        StatsParams st{};
        st.keys = keys.data;
        st.token_stride = keys.token_stride;
        st.head_stride = keys.head_stride;
        st.n = n;
        st.segment = l.segment;
        st.segments = l.segments;
        st.chunks = l.chunks;
        st.normalize = params.scorer == Scorer::kKeyDiff;
        st.head0 = h0;
        st.partial = At<float>(ws, l.partial);
        st.errors = errors;
        const dim3 sgrid(l.chunks, l.segments, g);
        KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(keys.dtype, keys.head_dim, [&](auto t, auto d) {
          using T = typename decltype(t)::type;
          constexpr int D = decltype(d)::value;
          StatsKernel<T, D><<<sgrid, kThreads, 0, ctx_->stream>>>(st);
          return cudaGetLastError();
        }));
      }
      if (centred) {
        CentreParams cp{};
        cp.partial = given != nullptr ? given : At<float>(ws, l.partial);
        if (given != nullptr) {  // the KeySums layout
          cp.head_chunks = CeilDiv(n, kStatsRows);
          cp.segment_chunks = l.segments == 1 ? cp.head_chunks : l.segment / kStatsRows;
        }
        cp.n = n;
        cp.segment = l.segment;
        cp.segments = l.segments;
        cp.chunks = l.chunks;
        cp.d = keys.head_dim;
        cp.head0 = h0;
        cp.heads = g;
        cp.centres = At<float>(ws, l.centres);
        const uint64_t warps = uint64_t{g} * l.segments * keys.head_dim;
        const auto cblocks = static_cast<uint32_t>(CeilDiv(warps, kCentreThreads / 32));
        CentreKernel<<<cblocks, kCentreThreads, 0, ctx_->stream>>>(cp);
        KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      }
      sp.head0 = h0;
      const dim3 grid(static_cast<uint32_t>(CeilDiv(n, kScoreRows)), values != nullptr ? 2 * g : g);
      KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(keys.dtype, keys.head_dim, [&](auto t, auto d) {
        using T = typename decltype(t)::type;
        constexpr int D = decltype(d)::value;
        switch (RowKindOf(params.scorer)) {
          case RowKind::kDistance:
            ScoreKernel<T, D, RowKind::kDistance><<<grid, kThreads, 0, ctx_->stream>>>(sp);
            break;
          case RowKind::kDot:
            ScoreKernel<T, D, RowKind::kDot><<<grid, kThreads, 0, ctx_->stream>>>(sp);
            break;
          case RowKind::kNorm:
            ScoreKernel<T, D, RowKind::kNorm><<<grid, kThreads, 0, ctx_->stream>>>(sp);
            break;
        }
        return cudaGetLastError();
      }));
    }
    return absl::OkStatus();
  }

  // The NaN/Inf check of a view's rows (the knorm pass; its scores land in `scratch`). Bad rows
  // are reported to `slot`.
  absl::Status EnqueueRowCheck(const HeadsView& v, float* scratch, unsigned long long* slot) {
    ScoreKernelParams sp{};
    sp.keys = v.data;
    sp.token_stride = v.token_stride;
    sp.head_stride = v.head_stride;
    sp.n = v.num_tokens;
    sp.scorer = Scorer::kKnorm;
    sp.segment = v.num_tokens;
    sp.segments = 1;
    sp.heads = v.num_heads;
    sp.positions = PositionInfo{nullptr, 0, 0, v.num_tokens};
    sp.scores = scratch;
    // The kernel reports to errors->bad_key: point that field at `slot`.
    sp.errors = reinterpret_cast<ErrorSlots*>(slot);
    const dim3 grid(static_cast<uint32_t>(CeilDiv(v.num_tokens, kScoreRows)), v.num_heads);
    KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(v.dtype, v.head_dim, [&](auto t, auto d) {
      using T = typename decltype(t)::type;
      constexpr int D = decltype(d)::value;
      ScoreKernel<T, D, RowKind::kNorm><<<grid, kThreads, 0, ctx_->stream>>>(sp);
      return cudaGetLastError();
    }));
    return absl::OkStatus();
  }

  absl::Status EnqueueSnapKV(const SnapKVParams& p) {
    cudaStream_t s = ctx_->stream;
    const uint32_t heads = p.keys.num_heads;
    const uint32_t q_heads = p.queries.num_heads;
    const uint64_t n = p.keys.num_tokens;
    const uint64_t w = p.queries.num_tokens;
    const uint64_t prefix = n - w;
    KVCOMP_RETURN_IF_ERROR(EnqueueRowCheck(p.keys, p.scores, &p.errors->bad_key));
    KVCOMP_RETURN_IF_ERROR(EnqueueRowCheck(p.queries, p.acc, &p.errors->bad_query));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.max_key, 0, sizeof(uint32_t), s));
    KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(p.keys.dtype, 64, [&](auto t, auto) {
      using T = typename decltype(t)::type;
      SnapStatsKernel<T><<<dim3(static_cast<uint32_t>(w), q_heads), kThreads, 0, s>>>(p);
      if (prefix > 0) {
        const uint32_t blocks = static_cast<uint32_t>(CeilDiv(prefix, kThreads));
        SnapAccumulateKernel<T><<<dim3(blocks, q_heads), kThreads, 0, s>>>(p);
        SnapPoolKernel<<<dim3(blocks, heads), kThreads, 0, s>>>(p);
      }
      SnapFillKernel<<<dim3(static_cast<uint32_t>(CeilDiv(w, kThreads)), heads), kThreads, 0,
                       s>>>(p);
      return cudaGetLastError();
    }));
    return absl::OkStatus();
  }

  // One selection stage: radix select per segment, counts, plan, then Gather (marks, indices
  // and/or rows).
  absl::Status RunStage(SelectKernelParams sp, uint32_t need, uint32_t* kept_counts,
                        uint8_t* mark, uint32_t* indices, const HeadsView* keys,
                        const HeadsView* values, void* keys_out, void* values_out,
                        const Buffer& ws, const Layout& l, bool check_values = false) {
    const uint32_t heads = sp.heads;
    const uint32_t segments = sp.per_head ? heads : 1;
    cudaStream_t s = ctx_->stream;
    InitSegmentsKernel<<<segments, kThreads, 0, s>>>(sp.state, sp.hist, need);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    const dim3 grid(l.tiles, heads);
    if (need > 0) {
      for (int pass = 0; pass < kRadixPasses; ++pass) {
        const dim3 hist_grid(static_cast<uint32_t>(CeilDiv(l.tiles, kHistTiles)), heads);
        RadixHistKernel<<<hist_grid, kThreads, 0, s>>>(sp, pass);
        KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
        RadixFindKernel<<<segments, kThreads, 0, s>>>(sp.state, sp.hist, pass);
        KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      }
    }
    CountParams cp{sp, l.tiles, At<TileCounts>(ws, l.tile_counts)};
    CountKernel<<<grid, kThreads, 0, s>>>(cp);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    const bool parallel = sp.per_head && sp.pre == nullptr;
    PlanParams pp{cp.counts,   sp.state,
                  sp.per_head, parallel ? need : 0,
                  heads,       l.tiles,
                  At<TilePlan>(ws, l.plan), kept_counts,
                  At<unsigned long long>(ws, l.total)};
    PlanKernel<<<parallel ? heads : 1, kThreads, 0, s>>>(pp);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    GatherParams gp{};
    gp.count = cp;
    gp.plan = pp.plan;
    gp.mark = mark;
    gp.indices = indices;
    gp.capacity = KeptCapacity(heads, sp.n, sp.select.kept_per_head);
    DType dtype = DType::kBF16;
    uint32_t d = 128;
    if (keys_out != nullptr) {
      gp.keys = keys->data;
      gp.values = values->data;
      gp.token_stride = keys->token_stride;
      gp.head_stride = keys->head_stride;
      gp.v_token_stride = values->token_stride;
      gp.v_head_stride = values->head_stride;
      gp.keys_out = keys_out;
      gp.values_out = values_out;
      if (check_values) gp.bad_value = &sp.errors->bad_value;
      dtype = keys->dtype;
      d = keys->head_dim;
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(dtype, d, [&](auto t, auto dd) {
      using T = typename decltype(t)::type;
      constexpr int D = decltype(dd)::value;
      GatherKernel<T, D><<<grid, kThreads, 0, s>>>(gp);
      return cudaGetLastError();
    }));
    return absl::OkStatus();
  }

  // A uniform selection in one launch: one block per head or one cluster per head
  // (BlockSelectKernel), then the kept rows by the whole grid (GatherRowsKernel).
  absl::Status RunBlockSelect(SelectPath path, const SelectKernelParams& sp, uint32_t kept,
                              KeptIndices out, const HeadsView* keys, const HeadsView* values,
                              void* keys_out, void* values_out, uint32_t* evicted) {
    cudaStream_t s = ctx_->stream;
    BlockSelectParams p{};
    p.scores = sp.scores;
    p.heads = sp.heads;
    p.n = sp.n;
    p.kept = kept;
    p.positions = sp.positions;
    p.select = sp.select;
    p.counts = out.counts;
    p.indices = out.indices;
    p.errors = sp.errors;
    p.evicted = keys_out != nullptr ? evicted : nullptr;
    if (path == SelectPath::kCluster) {
      KVCOMP_RETURN_IF_ERROR(LaunchClusterSelect(p));
    } else {
      KVCOMP_CUDA_RETURN_IF_ERROR(LaunchShortSelect(p, sp.heads, sp.n, s));
    }
    if (keys_out == nullptr) return absl::OkStatus();
    GatherRowsParams g{};
    g.keys = keys->data;
    g.values = values->data;
    g.token_stride = keys->token_stride;
    g.head_stride = keys->head_stride;
    g.v_token_stride = values->token_stride;
    g.v_head_stride = values->head_stride;
    g.kept = kept;
    g.indices = out.indices;
    g.keys_out = keys_out;
    g.values_out = values_out;
    uint64_t blocks = CeilDiv(kept, kGatherRowsPerBlock);
    if (evicted != nullptr) {  // then the evicted rows' values check, in the same launch
      g.bad_value = &sp.errors->bad_value;
      g.evicted = evicted;
      g.n = sp.n;
      blocks += CeilDiv(sp.n - kept, kGatherRowsPerBlock);
    }
    const dim3 grid(static_cast<uint32_t>(blocks), sp.heads);
    KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(keys->dtype, keys->head_dim, [&](auto t, auto d) {
      using T = typename decltype(t)::type;
      constexpr int D = decltype(d)::value;
      GatherRowsKernel<T, D><<<grid, kThreads, 0, s>>>(g);
      return cudaGetLastError();
    }));
    return absl::OkStatus();
  }

  // BlockSelectKernel<true> over p.heads heads of p.n tokens (PathOf chose it).
  absl::Status LaunchClusterSelect(const BlockSelectParams& p) {
    const uint32_t blocks = ClusterBlocks(p.n, p.heads, ctx_->properties.multiProcessorCount);
    const uint64_t slice = ClusterSlice(p.n, blocks);
    // The shared-memory limit was raised on this device by ClusterSelectFits (PathOf asks it).
    if (uint64_t{p.heads} * blocks > 0x7FFFFFFFull) {
      return absl::InvalidArgumentError("cluster selection: too many heads");
    }
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t config = ClusterLaunch(p.heads * blocks, blocks,
                                                    BlockSelectSmem(slice), ctx_->stream, &cluster);
    KVCOMP_CUDA_RETURN_IF_ERROR(
        cudaLaunchKernelEx(&config, BlockSelectKernel<true>, p, static_cast<uint32_t>(slice)));
    return absl::OkStatus();
  }

  // check_values: the compaction also holds the values to the data check (V read once).
  absl::Status EnqueueSelect(const float* scores, uint32_t heads, uint64_t n,
                             const SelectParams& sel, const TokenPositions& positions,
                             KeptIndices out, const HeadsView* keys, const HeadsView* values,
                             void* keys_out, void* values_out, const Buffer& ws,
                             const Layout& l, bool check_values = false) {
    KVCOMP_RETURN_IF_ERROR(Bind());
    const uint64_t kept = std::min<uint64_t>(sel.kept_per_head, n);
    SelectKernelParams sp{};
    sp.scores = scores;
    sp.heads = heads;
    sp.n = n;
    sp.positions = MakePositions(positions, n);
    sp.select = sel;
    sp.pre = nullptr;
    sp.per_head = true;
    sp.state = At<SegmentState>(ws, l.state);
    sp.hist = At<uint32_t>(ws, l.hist);
    sp.errors = At<ErrorSlots>(ws, l.errors);
    const SelectPath path = PathOf(heads, n, sel);
    if (path != SelectPath::kTiled) {
      return RunBlockSelect(path, sp, static_cast<uint32_t>(kept), out, keys, values, keys_out,
                            values_out,
                            check_values && keys_out != nullptr ? At<uint32_t>(ws, l.evicted)
                                                                : nullptr);
    }
    if (sel.head_budget == HeadBudget::kUniform || heads == 1) {
      return RunStage(sp, static_cast<uint32_t>(kept), out.counts, nullptr, out.indices, keys,
                      values, keys_out, values_out, ws, l, check_values);
    }
    // AdaKV: each head's safeguard first (marked in flags), then the layer's remaining budget
    // over every unmarked token, ties by lower head then lower token.
    const uint64_t safe = std::min<uint64_t>(
        kept, static_cast<uint64_t>(static_cast<double>(kept) * sel.alpha_safeguard));
    uint8_t* flags = At<uint8_t>(ws, l.flags);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flags, 0, uint64_t{heads} * n, ctx_->stream));
    if (safe > 0) {
      KVCOMP_RETURN_IF_ERROR(RunStage(sp, static_cast<uint32_t>(safe),
                                      At<uint32_t>(ws, l.stage_counts), flags, nullptr, nullptr,
                                      nullptr, nullptr, nullptr, ws, l));
    }
    const uint64_t remaining = heads * kept - heads * safe;
    if (remaining > 0xFFFFFFFFull) {
      return absl::InvalidArgumentError("adakv: layer budget beyond 2^32 tokens");
    }
    sp.pre = flags;
    sp.per_head = false;
    return RunStage(sp, static_cast<uint32_t>(remaining), out.counts, nullptr, out.indices, keys,
                    values, keys_out, values_out, ws, l, check_values);
  }

  // The varlen batch's error slots as the per-request calls would report them: the first
  // request with a finding, its key rows before its value rows.
  absl::Status ReadVarlenErrors(const Buffer& ws, const Layout& l,
                                const ScoreSelectCompactVarlenArgs& a) {
    if (host_errors_ == nullptr) {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_errors_, sizeof(ErrorSlots)));
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_errors_, At<char>(ws, l.errors),
                                                sizeof(ErrorSlots), cudaMemcpyDeviceToHost,
                                                ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    DeferredCheck e;
    std::memcpy(&e, host_errors_, sizeof(e));
    const uint64_t heads = a.keys.num_heads;
    auto request_of = [&](uint64_t flat) {
      return static_cast<uint32_t>(
          std::upper_bound(a.cu_seqlens, a.cu_seqlens + a.requests + 1, flat / heads,
                           [&](uint64_t x, uint64_t cu) { return x < cu; }) -
          a.cu_seqlens - 1);
    };
    uint32_t first = a.requests;
    for (uint64_t f : {e.bad_key, e.bad_value, e.bad_score}) {
      if (f != DeferredCheck::kNone) first = std::min(first, request_of(f));
    }
    if (first == a.requests) return absl::OkStatus();
    const uint64_t base = heads * a.cu_seqlens[first];
    const uint64_t n = a.cu_seqlens[first + 1] - a.cu_seqlens[first];
    DeferredCheck in_request;
    for (auto [from, to] : {std::pair{e.bad_key, &in_request.bad_key},
                            std::pair{e.bad_value, &in_request.bad_value},
                            std::pair{e.bad_score, &in_request.bad_score}}) {
      if (from != DeferredCheck::kNone && request_of(from) == first) *to = from - base;
    }
    const absl::Status st = DeferredCheckStatus(in_request, n, 0);
    return absl::Status(st.code(), absl::StrFormat("request %u: %s", first, st.message()));
  }

  CudaContext* ctx_;
  ErrorSlots* host_errors_ = nullptr;
  bool sync_varlen_ = true;
};

}  // namespace

absl::Status EnqueueScoreSelectCompact(CudaContext* ctx, const ScoreSelectCompactArgs& args) {
  CudaScoringOps ops(ctx);
  return ops.EnqueueOnly(args);
}

absl::Status EnqueueScoreSelectCompactVarlen(CudaContext* ctx,
                                             const ScoreSelectCompactVarlenArgs& args) {
  CudaScoringOps ops(ctx);
  ops.set_sync_varlen(false);
  return ops.ScoreSelectCompactVarlen(args);
}

absl::Status EnqueueKeySums(cudaStream_t stream, const HeadsView& keys, uint64_t chunk_begin,
                            uint64_t chunk_end, float* sums, float* unit_sums,
                            unsigned long long* bad_key) {
  KVCOMP_RETURN_IF_ERROR(CheckHeadsView(keys, MemorySpace::kDevice, "keys"));
  const uint64_t chunks = CeilDiv(keys.num_tokens, kStatsRows);
  if (chunk_begin >= chunk_end) return absl::OkStatus();
  if (chunk_end > chunks || bad_key == nullptr || (sums == nullptr && unit_sums == nullptr)) {
    return absl::InvalidArgumentError("key sums: bad chunk range or null output");
  }
  if (!RowsAligned(keys) || keys.num_heads > 65535) {
    return absl::InvalidArgumentError("key sums: rows not 16-byte aligned or too many heads");
  }
  StatsParams st{};
  st.keys = keys.data;
  st.token_stride = keys.token_stride;
  st.head_stride = keys.head_stride;
  st.n = keys.num_tokens;
  st.segment = keys.num_tokens;
  st.segments = 1;
  st.chunks = static_cast<uint32_t>(chunks);
  st.chunk0 = static_cast<uint32_t>(chunk_begin);
  st.head0 = 0;
  // The kernel reports to errors->bad_key, the first field: point it at `bad_key`.
  st.errors = reinterpret_cast<ErrorSlots*>(bad_key);
  const dim3 grid(static_cast<uint32_t>(chunk_end - chunk_begin), 1, keys.num_heads);
  KVCOMP_CUDA_RETURN_IF_ERROR(DispatchTypeDim(keys.dtype, keys.head_dim, [&](auto t, auto d) {
    using T = typename decltype(t)::type;
    constexpr int D = decltype(d)::value;
    for (float* out : {sums, unit_sums}) {
      if (out == nullptr) continue;
      st.partial = out;
      st.normalize = out == unit_sums;
      StatsKernel<T, D><<<grid, kThreads, 0, stream>>>(st);
    }
    return cudaGetLastError();
  }));
  return absl::OkStatus();
}

}  // namespace cuda

std::unique_ptr<ScoringOps> NewCudaScoringOps(CudaContext* context) {
  return std::make_unique<cuda::CudaScoringOps>(context);
}

}  // namespace kvcomp
