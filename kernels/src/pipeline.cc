// Whole-sequence compression: per layer ScoreSelectCompact on the backend, then the eviction
// hook, the moment stage and (at the end) the codec stage. A device backend takes
// CompressOnDevice, which keeps every layer's results on the device until the end.
#include "kvcomp/kernels/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "absl/strings/str_format.h"
#include "cpu/moments_aware.h"
#include "kvcomp/core/format.h"
#if defined(KVCOMP_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"
#endif
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/device_crc32c.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "pipeline_device.h"
#include "pipeline_stages.h"

namespace kvcomp {
namespace {

using pipeline_internal::DownloadAsync;
using pipeline_internal::LayerEviction;
using pipeline_internal::ZeroDevice;

size_t ElemBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// Sizes a large host array that is about to be written from the device. Fresh memory of that
// size is mapped on first touch, page by page; asking for transparent huge pages first makes
// that 512 times fewer faults (where the kernel allows them; a no-op elsewhere).
template <typename T>
void ResizeForDownload(std::vector<T>* v, size_t n) {
  v->clear();
  v->reserve(n);
#if defined(__linux__)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(v->data());
  const uintptr_t a = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (begin + n * sizeof(T)) & ~(kHuge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#endif
  v->resize(n);
}

// Copies `bytes` between two device buffers of `backend` in its stream order (no host wait).
absl::Status CopyOnDevice(Backend& backend, void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
#if defined(KVCOMP_HAVE_CUDA)
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                              static_cast<cudaStream_t>(backend.native_stream())));
  return absl::OkStatus();
#else
  (void)backend;
  (void)dst;
  (void)src;
  return absl::FailedPreconditionError("this build has no CUDA");
#endif
}

bool IsDense(const HeadsView& v) {
  return v.token_stride == v.head_dim &&
         (v.num_heads == 1 || v.head_stride == v.num_tokens * v.head_dim);
}

// `view` in the backend's space: itself, or a dense copy made from host memory.
absl::StatusOr<HeadsView> Stage(Backend& backend, const HeadsView& view, Buffer* owner,
                                TransferBytes* transfers = nullptr) {
  if (view.space == backend.space()) return view;
  if (view.space != MemorySpace::kHost) {
    return absl::InvalidArgumentError("device memory given to a host backend");
  }
  const size_t row = view.head_dim * ElemBytes(view.dtype);
  const uint64_t bytes = uint64_t{view.num_heads} * view.num_tokens * row;
  KVCOMP_ASSIGN_OR_RETURN(*owner, Buffer::Allocate(backend.allocator(), bytes));
  if (IsDense(view)) {
    KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(owner->data(), view.data, bytes));
  } else {
    std::vector<char> packed(bytes);
    for (uint32_t h = 0; h < view.num_heads; ++h) {
      for (uint64_t t = 0; t < view.num_tokens; ++t) {
        std::memcpy(packed.data() + (uint64_t{h} * view.num_tokens + t) * row,
                    static_cast<const char*>(view.data) + view.offset(h, t) * ElemBytes(view.dtype),
                    row);
      }
    }
    KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(owner->data(), packed.data(), bytes));
  }
  if (transfers != nullptr) transfers->to_device += bytes;
  return HeadsView::Dense(owner->data(), view.dtype, view.num_heads, view.num_tokens, view.head_dim,
                          backend.space());
}

// Head h's evicted indices: the complement of its (ascending) kept indices in [0, n).
void Complement(const uint32_t* counts, const uint32_t* kept, uint32_t heads, uint64_t n,
                LayerEviction* e) {
  e->offsets.assign(heads + 1, 0);
  e->evicted.clear();
  uint64_t k_off = 0;
  for (uint32_t h = 0; h < heads; ++h) {
    const uint32_t* k = kept + k_off;
    uint64_t j = 0;
    for (uint64_t t = 0; t < n; ++t) {
      if (j < counts[h] && k[j] == t) {
        ++j;
      } else {
        e->evicted.push_back(static_cast<uint32_t>(t));
      }
    }
    k_off += counts[h];
    e->offsets[h + 1] = e->evicted.size();
  }
}

absl::Status CallHook(const EvictionHook& hook, const LayerEviction& e) {
  for (uint32_t h = 0; h < e.keys.num_heads; ++h) {
    absl::Span<const uint32_t> rows(e.evicted.data() + e.offsets[h],
                                    e.offsets[h + 1] - e.offsets[h]);
    EvictedTokens t{e.layer, h, e.keys, e.values, rows, rows};
    KVCOMP_RETURN_IF_ERROR(hook(t));
  }
  return absl::OkStatus();
}

// Layers compressed together on a device backend: their keys (and values) must lie at one stride
// one after another, so that `layers` layers of H heads are one view of layers x H heads (what
// DeviceKv holds: every layer's keys, then every layer's values), and the policy must select
// every head on its own with the same parameters (ScoreSelectCompactArgs: uniform budget, no
// random scorer, whose scores depend on the layer; no snapkv, moment-aware rules or eviction
// hook, which work layer by layer). Each kernel then runs once for the group instead of once per
// layer: short caches are launch- and occupancy-bound per layer (one selection block per head).
bool LayersAreOneView(const std::vector<HeadsView>& views, uint32_t l0, uint32_t layers) {
  const HeadsView& a = views[l0];
  if (a.space != MemorySpace::kDevice || a.data == nullptr) return false;
  const uint64_t layer_bytes = uint64_t{a.num_heads} * a.head_stride * ElemBytes(a.dtype);
  for (uint32_t i = 1; i < layers; ++i) {
    const HeadsView& b = views[l0 + i];
    if (b.space != a.space || b.dtype != a.dtype || b.num_heads != a.num_heads ||
        b.num_tokens != a.num_tokens || b.head_dim != a.head_dim ||
        b.head_stride != a.head_stride || b.token_stride != a.token_stride ||
        static_cast<const char*>(b.data) != static_cast<const char*>(a.data) + i * layer_bytes) {
      return false;
    }
  }
  return true;
}

// The keys' sums of layers [l0, l0 + layers) as one KeySums of their heads, when every layer
// has them and they lie one after another (DeviceKv's layout); else none (the scorer then sums
// the keys itself, with the same result).
KeySums GroupKeySums(const KvCacheView& cache, uint32_t l0, uint32_t layers) {
  if (layers == 1) {
    return l0 < cache.key_sums.size() && cache.keys[l0].space == MemorySpace::kDevice
               ? cache.key_sums[l0]
               : KeySums{};
  }
  if (cache.key_sums.size() < uint64_t{l0} + layers) return {};
  const KeySums& a = cache.key_sums[l0];
  const uint64_t n = cache.num_tokens;
  const uint64_t per_layer = uint64_t{cache.layout.num_kv_heads} *
                             ((n + kKeySumChunkTokens - 1) / kKeySumChunkTokens) *
                             cache.layout.head_dim;
  if (a.num_tokens != n || (a.sums == nullptr && a.unit_sums == nullptr)) return {};
  for (uint32_t i = 1; i < layers; ++i) {
    const KeySums& b = cache.key_sums[l0 + i];
    if (b.num_tokens != n || (a.sums == nullptr) != (b.sums == nullptr) ||
        (a.unit_sums == nullptr) != (b.unit_sums == nullptr) ||
        (a.sums != nullptr && b.sums != a.sums + i * per_layer) ||
        (a.unit_sums != nullptr && b.unit_sums != a.unit_sums + i * per_layer)) {
      return {};
    }
  }
  return a;
}

// A device compression that keeps moments compacts and sums in one pass over K and V
// (MomentOps::CompactAndAccumulateDeferred) after a select-only scoring call, instead of the
// scoring call's compaction followed by a gather of the evicted rows. KVCOMP_FUSED_MOMENTS=0
// keeps the two passes (for comparisons).
bool FusedMomentsEnabled() {
  static const bool enabled = pipeline_internal::SwitchOn("KVCOMP_FUSED_MOMENTS");
  return enabled;
}

// KVCOMP_LAYER_GROUPS=0 turns the layer groups off (the layer-by-layer loop, for comparison).
bool LayerGroupsEnabled() {
  static const bool enabled = pipeline_internal::SwitchOn("KVCOMP_LAYER_GROUPS");
  return enabled;
}

// KVCOMP_FORMAT_IN_PLACE=0: a device compression writes its arrays into buffers of their own
// and the format copies them (for comparison); else eviction with raw codecs writes them at the
// format's section offsets (DeviceCompressedCache::encoding).
bool InPlaceFormatEnabled() {
  static const bool enabled = pipeline_internal::SwitchOn("KVCOMP_FORMAT_IN_PLACE");
  return enabled;
}

// The cache format's buffer for a device compression whose sections can be written in place:
// with raw codecs every section a kernel writes (positions, keys, values, moments) holds the
// arrays' bytes as they are, and with every layer full (`cap` tokens each, always the case in
// practice) the plan is known before the first kernel (it depends on the total kept, not on
// how the heads share it). Null when the codecs re-encode the kept rows, when switched off, or
// when a section's size is not the array's.
absl::StatusOr<std::shared_ptr<const Buffer>> InPlaceEncoding(Allocator& a,
                                                              const CompressedCache& out,
                                                              uint64_t cap,
                                                              format::EncodingPlan* plan) {
  const CompressionPolicy& policy = out.policy;
  if (!InPlaceFormatEnabled() || policy.key_codec != KeyCodec::kRaw ||
      policy.value_codec != ValueCodec::kRaw || out.key_codec != KeyCodec::kRaw ||
      out.value_codec != ValueCodec::kRaw || cap > 0xffffffffu) {
    return nullptr;
  }
  CompressedCache shape = out;  // the counts of every layer full (each layer's total at head 0)
  const uint32_t heads = out.layout.num_kv_heads;
  for (uint32_t l = 0; l < out.layout.num_layers; ++l) {
    shape.kept[uint64_t{l} * heads] = static_cast<uint32_t>(cap);
  }
  absl::StatusOr<format::EncodingPlan> p = format::PlanEncoding(shape, 0);
  if (!p.ok()) return nullptr;  // the format refuses the shape: the copying path reports it
  const uint64_t total = uint64_t{out.layout.num_layers} * cap;
  const uint64_t h = out.num_heads(), d = out.layout.head_dim;
  const uint64_t row = d * ElemBytes(out.layout.dtype);
  for (const format::SectionSpan& sec : p->sections) {
    uint64_t want = sec.size;
    switch (sec.id) {
      case format::kPositions: want = total * 4; break;
      case format::kKeys: case format::kValues: want = total * row; break;
      case format::kMomentCount: want = h * 8; break;
      case format::kMomentKeySum: case format::kMomentValueSum: want = h * d * 4; break;
      case format::kMomentVkSum: want = h * d * d * 4; break;
      default: break;
    }
    if (want != sec.size) return nullptr;
  }
  KVCOMP_ASSIGN_OR_RETURN(Buffer whole, Buffer::Allocate(a, p->total_bytes));
  *plan = std::move(*p);
  return std::make_shared<const Buffer>(std::move(whole));
}

// A section of `plan` as a part of `encoding`.
Buffer SectionPart(const std::shared_ptr<const Buffer>& encoding,
                   const format::EncodingPlan& plan, uint32_t id) {
  for (const format::SectionSpan& sec : plan.sections) {
    if (sec.id == id) return Buffer::Part(encoding, sec.offset, sec.size);
  }
  return Buffer();
}

// KVCOMP_FORMAT_CRC_BESIDE=1: each layer group's parts of the sections written in place get
// their CRCs as the compression goes on (CrcBeside), else the format reads the sections once
// for them. Off by default: on an H200 the CRC kernel (shared-memory table lookups, 1.5 TB/s)
// did not overlap the next group's kernels, so the put took as long either way.
bool CrcBesideEnabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KVCOMP_FORMAT_CRC_BESIDE");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }();
  return enabled;
}

// The CRC32C of each layer group's part of every section written in place, enqueued on a
// stream of its own once the group's kernels are (an event orders it after them), so it reads
// the group's rows while the device works on the next group; the backend's stream waits for it
// at the end. The parts' words and sizes go to DeviceCompressedCache::crc_parts and crc_words,
// which EncodeOnDevice combines instead of reading the sections again.
class CrcBeside {
 public:
  CrcBeside() = default;
  CrcBeside(const CrcBeside&) = delete;
  CrcBeside& operator=(const CrcBeside&) = delete;
  ~CrcBeside() {
#if defined(KVCOMP_HAVE_CUDA)
    if (side_ != nullptr && event_ != nullptr && !finished_) {
      // A compression that failed half-way: its buffers are freed in the backend's stream
      // order, after the parts' reads and words.
      Guard guard(device_);
      if (cudaEventRecord(event_, side_) == cudaSuccess) cudaStreamWaitEvent(main_, event_, 0);
      cudaGetLastError();
    }
    if (side_ != nullptr) cudaStreamDestroy(side_);
    if (event_ != nullptr) cudaEventDestroy(event_);
#endif
  }

  // `sections`: the plan's sections written in place, each L equal layer parts.
  absl::Status Init(Backend& backend, const std::shared_ptr<const Buffer>& encoding,
                    const format::EncodingPlan& plan, uint32_t layers, uint32_t groups) {
#if defined(KVCOMP_HAVE_CUDA)
    main_ = static_cast<cudaStream_t>(backend.native_stream());
    cudaPointerAttributes attr;
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, encoding->data()));
    device_ = attr.device;
    Guard g(device_);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    for (const format::SectionSpan& sec : plan.sections) {
      switch (sec.id) {
        case format::kPositions: case format::kKeys: case format::kValues:
        case format::kMomentCount: case format::kMomentKeySum: case format::kMomentValueSum:
        case format::kMomentVkSum:
          if (sec.size % layers == 0) {
            sections_.push_back({sec.id, encoding->as<uint8_t>() + sec.offset,
                                 sec.size / layers});
          }
          break;
        default:
          break;
      }
    }
    KVCOMP_ASSIGN_OR_RETURN(
        words_, Buffer::Allocate(backend.allocator(),
                                 std::max<uint64_t>(1, uint64_t{groups} * sections_.size()) * 4));
    return absl::OkStatus();
#else
    (void)backend, (void)encoding, (void)plan, (void)layers, (void)groups;
    return absl::FailedPreconditionError("this build has no CUDA");
#endif
  }

  // Layers [l, l + g) are enqueued on the backend's stream: their parts' CRCs go on the side.
  absl::Status Group(uint32_t l, uint32_t g) {
#if defined(KVCOMP_HAVE_CUDA)
    Guard guard(device_);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, main_));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, event_, 0));
    std::vector<DeviceCrcRange> ranges;
    for (const Section& s : sections_) {
      const uint64_t size = uint64_t{g} * s.layer_bytes;
      ranges.push_back({s.data + uint64_t{l} * s.layer_bytes, size,
                        words_.as<uint32_t>() + parts_.size()});
      parts_.push_back({s.id, size});
    }
    return DeviceCrc32c(ranges, side_);
#else
    (void)l, (void)g;
    return absl::OkStatus();
#endif
  }

  // The backend's stream waits for every part; the parts go to `dc`.
  absl::Status Finish(DeviceCompressedCache* dc) {
#if defined(KVCOMP_HAVE_CUDA)
    Guard guard(device_);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, side_));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, event_, 0));
#endif
    finished_ = true;
    dc->crc_parts = std::move(parts_);
    dc->crc_words = std::move(words_);
    return absl::OkStatus();
  }

 private:
  struct Section {
    uint32_t id;
    uint8_t* data;
    uint64_t layer_bytes;
  };
#if defined(KVCOMP_HAVE_CUDA)
  // Sets the calling thread's current device, restores it when it goes.
  class Guard {
   public:
    explicit Guard(int device) {
      cudaGetDevice(&previous_);
      if (device != previous_) set_ = cudaSetDevice(device) == cudaSuccess;
    }
    ~Guard() {
      if (set_) cudaSetDevice(previous_);
    }

   private:
    int previous_ = 0;
    bool set_ = false;
  };
  cudaStream_t main_ = nullptr, side_ = nullptr;
  cudaEvent_t event_ = nullptr;
  int device_ = 0;
#endif
  std::vector<Section> sections_;
  Buffer words_;
  std::vector<DeviceCompressedCache::CrcPart> parts_;
  bool finished_ = false;
};

// How many layers CompressOnDevice does at once (1: layer by layer). The group's selection
// workspace stays within a sixteenth of the cache's bytes (at least one layer's).
uint32_t LayerGroup(Backend& backend, const KvCacheView& cache, const CompressionPolicy& policy,
                    const CompressOptions& options, const SelectParams& select) {
  const uint32_t L = cache.layout.num_layers;
  if (L < 2 || !LayerGroupsEnabled() || options.on_evict || policy.scorer == Scorer::kSnapKV ||
      policy.scorer == Scorer::kRandom || select.head_budget != HeadBudget::kUniform ||
      !LayersAreOneView(cache.keys, 0, L) || !LayersAreOneView(cache.values, 0, L)) {
    return 1;
  }
  auto workspace = [&](uint32_t layers) {
    ScoreSelectCompactArgs args;
    args.keys = cache.keys[0];
    args.keys.num_heads *= layers;
    args.values = cache.values[0];
    args.values.num_heads *= layers;
    args.score = ScoreParamsFromPolicy(policy, 0);
    args.select = select;
    // The moment-aware rescoring's ranks, eviction bytes, distance or sort keys and payloads and
    // the mean's chunk sums (moments_aware.cu: 13 bytes a token of each head ranked in one
    // block, 21 (and a part tile) ranked in tiles, 57 through the device sort, and 8 a channel
    // of each 256-token chunk; 64 counted)
    // besides the selection's own.
    const uint64_t rescoring =
        policy.moment_aware ? uint64_t{args.keys.num_heads} * cache.num_tokens * 64 : 0;
    return backend.scoring().WorkspaceBytes(args) + rescoring;
  };
  const uint64_t bound =
      std::max<uint64_t>(workspace(1), cache.layout.CacheBytes(cache.num_tokens) / 16);
  uint32_t g = L;
  while (g > 1 && workspace(g) > bound) g = (g + 1) / 2;
  return g;
}

// The data check of a group of layers (its view's heads are layer-major) as the layer-by-layer
// loop reports it: the first layer with a bad row, and in it the first bad key, value, query or
// score row, named by that layer's head.
absl::Status GroupCheckStatus(const DeferredCheck& check, uint32_t l0, uint32_t heads,
                              uint64_t n, uint64_t q_tokens) {
  constexpr uint64_t kNone = DeferredCheck::kNone;
  const uint64_t rows = n == 0 ? 1 : n, q_rows = q_tokens == 0 ? 1 : q_tokens;
  auto layer_of = [&](uint64_t row, uint64_t per_head) {
    return row == kNone ? ~uint64_t{0} : row / per_head / heads;
  };
  const uint64_t first = std::min({layer_of(check.bad_key, rows), layer_of(check.bad_value, rows),
                                   layer_of(check.bad_query, q_rows),
                                   layer_of(check.bad_score, rows)});
  if (first == ~uint64_t{0}) return absl::OkStatus();
  auto local = [&](uint64_t row, uint64_t per_head) {
    return layer_of(row, per_head) == first ? row - first * heads * per_head : kNone;
  };
  DeferredCheck in_layer;
  in_layer.bad_key = local(check.bad_key, rows);
  in_layer.bad_value = local(check.bad_value, rows);
  in_layer.bad_query = local(check.bad_query, q_rows);
  in_layer.bad_score = local(check.bad_score, rows);
  return Annotate(DeferredCheckStatus(in_layer, n, q_tokens),
                  absl::StrFormat("layer %u", l0 + first));
}

// Compress on a device backend: every layer's results go into whole-cache arrays in device
// memory at fixed offsets (a layer keeps exactly KeptCapacity rows: the budget is a hard cap
// and every backend fills it), moments are summed there, and the cache comes to the host once.
// The host does not wait for the device between layers: each layer's data check (NaN/Inf in K
// or V) and moment-list check land in a per-layer record in device memory, read once with the
// kept counts at the end; the first failing layer fails the compression.
absl::StatusOr<DeviceCompressedCache> CompressOnDevice(Backend& backend,
                                                       const KvCacheView& cache,
                                                       const CompressionPolicy& policy,
                                                       const CompressOptions& options,
                                                       const SelectParams& select) {
  const KvLayout& layout = cache.layout;
  const uint32_t heads = layout.num_kv_heads;
  const uint32_t d = layout.head_dim;
  const uint64_t L = layout.num_layers;
  const uint64_t n = cache.num_tokens;
  const size_t row = d * ElemBytes(layout.dtype);
  const uint64_t cap = KeptCapacity(heads, n, select.kept_per_head);
  TransferBytes local;
  TransferBytes* xfer = options.transfers != nullptr ? options.transfers : &local;

  CompressedCache out;
  out.policy = policy;
  out.has_moments = false;  // the moments live on the device: Reset shapes no host arrays
  out.Reset(layout, n);
  out.has_moments = pipeline_internal::StoresMoments(backend, policy, select.kept_per_head, n);

  Allocator& a = backend.allocator();
  KVCOMP_ASSIGN_OR_RETURN(Buffer d_counts, Buffer::Allocate(a, L * heads * sizeof(uint32_t)));
  // The kept rows, their positions and the moments go straight to their places in the cache's
  // format when they can (InPlaceEncoding), else into buffers of their own.
  format::EncodingPlan plan;
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Buffer> encoding,
                          InPlaceEncoding(a, out, cap, &plan));
  Buffer d_idx, d_k, d_v;
  if (encoding != nullptr) {
    d_idx = SectionPart(encoding, plan, format::kPositions);
    d_k = SectionPart(encoding, plan, format::kKeys);
    d_v = SectionPart(encoding, plan, format::kValues);
  } else {
    KVCOMP_ASSIGN_OR_RETURN(d_idx, Buffer::Allocate(a, L * cap * sizeof(uint32_t)));
    KVCOMP_ASSIGN_OR_RETURN(d_k, Buffer::Allocate(a, L * cap * row));
    KVCOMP_ASSIGN_OR_RETURN(d_v, Buffer::Allocate(a, L * cap * row));
  }
  // Moments of every head, laid out as CompressedCache's moment_* arrays (zeroed, then summed).
  const uint64_t H = L * heads;
  const uint64_t m_cnt = H * sizeof(uint64_t), m_vec = H * d * sizeof(float);
  const uint64_t m_mat = m_vec * d;
  DeviceCompressedCache dc;
  Buffer d_evicted, d_offsets;
  const bool evicted_lists = out.has_moments && !options.on_evict;
  // Moments summed in the compaction pass.
  const bool fused_moments = evicted_lists && FusedMomentsEnabled();
  const uint32_t group = LayerGroup(backend, cache, policy, options, select);
  const uint32_t groups = static_cast<uint32_t>((L + group - 1) / group);
  const uint32_t group_heads = group * heads;
  if (out.has_moments) {
    if (encoding != nullptr) {
      dc.moment_count = SectionPart(encoding, plan, format::kMomentCount);
      dc.moment_key_sum = SectionPart(encoding, plan, format::kMomentKeySum);
      dc.moment_value_sum = SectionPart(encoding, plan, format::kMomentValueSum);
      dc.moment_vk_sum = SectionPart(encoding, plan, format::kMomentVkSum);
    } else {
      KVCOMP_ASSIGN_OR_RETURN(dc.moment_count, Buffer::Allocate(a, m_cnt));
      KVCOMP_ASSIGN_OR_RETURN(dc.moment_key_sum, Buffer::Allocate(a, m_vec));
      KVCOMP_ASSIGN_OR_RETURN(dc.moment_value_sum, Buffer::Allocate(a, m_vec));
      KVCOMP_ASSIGN_OR_RETURN(dc.moment_vk_sum, Buffer::Allocate(a, m_mat));
    }
    for (const Buffer* b :
         {&dc.moment_count, &dc.moment_key_sum, &dc.moment_value_sum, &dc.moment_vk_sum}) {
      KVCOMP_RETURN_IF_ERROR(ZeroDevice(backend, b->data(), b->size()));
    }
  }
  if (evicted_lists && !fused_moments) {
    KVCOMP_ASSIGN_OR_RETURN(d_evicted, Buffer::Allocate(a, uint64_t{group_heads} * n * 4));
  }
  if (evicted_lists) {
    KVCOMP_ASSIGN_OR_RETURN(d_offsets, Buffer::Allocate(a, 2 * (uint64_t{group_heads} + 1) * 8));
  }
  // The per-group check records (none found: all ones) and moment-list error words (zero). An
  // eviction hook reads each layer's selection on the host, so that path checks at once.
  const bool deferred = !options.on_evict;
  const uint64_t checks_bytes = groups * sizeof(DeferredCheck);
  Buffer d_checks;
  if (deferred) {
    KVCOMP_ASSIGN_OR_RETURN(d_checks,
                            Buffer::Allocate(a, checks_bytes + groups * sizeof(uint32_t)));
    KVCOMP_RETURN_IF_ERROR(pipeline_internal::FillDevice(backend, d_checks.data(), 0xFF,
                                                         checks_bytes));
    KVCOMP_RETURN_IF_ERROR(
        ZeroDevice(backend, d_checks.as<char>() + checks_bytes, groups * sizeof(uint32_t)));
  }
  auto* checks = deferred ? d_checks.as<DeferredCheck>() : nullptr;
  auto* list_errors =
      deferred ? reinterpret_cast<uint32_t*>(d_checks.as<char>() + checks_bytes) : nullptr;
  // Every head's evicted list is at most this long (sizes the moment kernels' grid; a longer one
  // is reported as a malformed list, never summed in part): under a uniform budget every head
  // keeps exactly min(kept_per_head, n) tokens.
  const uint64_t max_evicted =
      select.head_budget == HeadBudget::kUniform
          ? n - std::min<uint64_t>(select.kept_per_head, n)
          : n;
  LayerEviction eviction;
  std::vector<uint32_t> layer_kept;  // host copies for an eviction hook only
  // The CRCs of the parts written in place, beside the compression.
  CrcBeside crc;
  const bool crc_beside = encoding != nullptr && CrcBesideEnabled();
  if (crc_beside) {
    KVCOMP_RETURN_IF_ERROR(crc.Init(backend, encoding, plan, layout.num_layers, groups));
  }
  auto run_group = [&](uint32_t gi) -> absl::Status {
    // Layers [l, l + g) as one view of g x heads heads (g = 1: one layer, staged if need be).
    const uint32_t l = gi * group;
    const uint32_t g = std::min<uint32_t>(group, layout.num_layers - l);
    const uint32_t gh = g * heads;
    const std::string where =
        g == 1 ? absl::StrFormat("layer %u", l) : absl::StrFormat("layers %u-%u", l, l + g - 1);
    Buffer kb, vb, qb;
    ScoreSelectCompactArgs args;
    KVCOMP_ASSIGN_OR_RETURN(args.keys, Stage(backend, cache.keys[l], &kb, xfer));
    KVCOMP_ASSIGN_OR_RETURN(args.values, Stage(backend, cache.values[l], &vb, xfer));
    args.keys.num_heads = args.values.num_heads = gh;
    HeadsView queries;
    if (policy.scorer == Scorer::kSnapKV) {
      KVCOMP_ASSIGN_OR_RETURN(queries, Stage(backend, cache.queries[l], &qb, xfer));
    }
    args.score = ScoreParamsFromPolicy(policy, l, queries);
    args.score.key_sums = GroupKeySums(cache, l, g);
    args.select = select;
    uint32_t* counts = d_counts.as<uint32_t>() + uint64_t{l} * heads;
    uint32_t* kept = d_idx.as<uint32_t>() + uint64_t{l} * cap;
    args.kept = {counts, kept};
    args.keys_out = d_k.as<char>() + uint64_t{l} * cap * row;
    args.values_out = d_v.as<char>() + uint64_t{l} * cap * row;
    if (deferred) args.deferred_check = checks + gi;
    args.compact = !fused_moments;  // else the moment pass compacts and checks the values
    if (policy.moment_aware) {
      // The moment-aware rescoring between the scoring pass and the selection, on the op's
      // stream: the group's data check stays deferred (no host wait) and the moment pass
      // compacts and sums as for any other scorer.
      const HeadsView keys = args.keys;
      const SelectParams sel = args.select;
      const TokenPositions positions = args.positions;
      args.rescore = [&backend, keys, sel, positions](float* scores) {
        return moments_internal::MomentAwareRescoreOnDevice(
            backend.native_stream(), backend.allocator(), keys, sel, positions, scores);
      };
    }
    KVCOMP_RETURN_IF_ERROR(Annotate(backend.scoring().ScoreSelectCompact(args), where));
    if (!out.has_moments && !options.on_evict) return absl::OkStatus();
    const uint64_t h0 = uint64_t{l} * heads;
    MomentsView m{dc.moment_count.as<uint64_t>() + h0,
                  dc.moment_key_sum.as<float>() + h0 * d,
                  dc.moment_value_sum.as<float>() + h0 * d,
                  dc.moment_vk_sum.as<float>() + h0 * d * d,
                  gh,
                  d,
                  MemorySpace::kDevice};
    if (fused_moments) {
      // The kept rows copied, the evicted ones summed and every value checked in one pass.
      auto* kept_offsets = d_offsets.as<uint64_t>();
      KVCOMP_RETURN_IF_ERROR(pipeline_internal::LaunchEvictedLists(
          backend.native_stream(), counts, kept, gh, n, kept_offsets, nullptr, nullptr));
      TokenLists lists{kept, kept_offsets, gh, MemorySpace::kDevice};
      KVCOMP_RETURN_IF_ERROR(Annotate(
          backend.moments().CompactAndAccumulateDeferred(args.keys, args.values, lists,
                                                         args.keys_out, args.values_out,
                                                         list_errors + gi,
                                                         &checks[gi].bad_value, m),
          "moments of " + where));
      return absl::OkStatus();
    }
    if (evicted_lists) {
      // The evicted set, found and summed on the device.
      auto* offsets = d_offsets.as<uint64_t>();
      KVCOMP_RETURN_IF_ERROR(pipeline_internal::LaunchEvictedLists(
          backend.native_stream(), counts, kept, gh, n, offsets + gh + 1, offsets,
          d_evicted.as<uint32_t>()));
      TokenLists lists{d_evicted.as<uint32_t>(), offsets, gh, MemorySpace::kDevice};
      KVCOMP_RETURN_IF_ERROR(
          Annotate(backend.moments().AccumulateDeferred(args.keys, args.values, lists,
                                                        max_evicted, list_errors + gi, m),
                   "moments of " + where));
      return absl::OkStatus();
    }
    // An eviction hook reads host lists: this layer's selection comes back to the host.
    std::vector<uint32_t> host_counts(heads);
    KVCOMP_RETURN_IF_ERROR(backend.CopyToHost(host_counts.data(), counts, heads * 4));
    uint64_t total = 0;
    for (uint32_t h = 0; h < heads; ++h) total += host_counts[h];
    layer_kept.resize(total);
    KVCOMP_RETURN_IF_ERROR(backend.CopyToHost(layer_kept.data(), kept, total * 4));
    xfer->to_host += heads * 4 + total * 4;
    eviction.layer = l;
    eviction.keys = args.keys;
    eviction.values = args.values;
    Complement(host_counts.data(), layer_kept.data(), heads, n, &eviction);
    KVCOMP_RETURN_IF_ERROR(CallHook(options.on_evict, eviction));
    if (out.has_moments) {
      Buffer idx_buf, off_buf;
      KVCOMP_ASSIGN_OR_RETURN(idx_buf, Buffer::Allocate(a, eviction.evicted.size() * 4));
      KVCOMP_ASSIGN_OR_RETURN(off_buf, Buffer::Allocate(a, eviction.offsets.size() * 8));
      KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(idx_buf.data(), eviction.evicted.data(),
                                                  eviction.evicted.size() * 4));
      KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(off_buf.data(), eviction.offsets.data(),
                                                  eviction.offsets.size() * 8));
      xfer->to_device += eviction.evicted.size() * 4 + eviction.offsets.size() * 8;
      TokenLists lists{idx_buf.as<uint32_t>(), off_buf.as<uint64_t>(), heads,
                       MemorySpace::kDevice};
      KVCOMP_RETURN_IF_ERROR(Annotate(backend.moments().Accumulate(args.keys, args.values, lists, m),
                                      absl::StrFormat("moments of layer %u", l)));
    }
    return absl::OkStatus();
  };
  for (uint32_t gi = 0; gi < groups; ++gi) {
    KVCOMP_RETURN_IF_ERROR(run_group(gi));
    if (crc_beside) {
      const uint32_t l = gi * group;
      KVCOMP_RETURN_IF_ERROR(crc.Group(l, std::min<uint32_t>(group, layout.num_layers - l)));
    }
  }
  if (crc_beside) KVCOMP_RETURN_IF_ERROR(crc.Finish(&dc));

  // The one wait for the device: the layers' check records and the kept counts (control data,
  // like the ops' own readbacks, and not counted as transfer bytes), which waits for the
  // layers' work. The kept counts are the cache's own, so they are counted.
  std::vector<DeferredCheck> group_checks(deferred ? groups : 0);
  std::vector<uint32_t> group_list_errors(deferred ? groups : 0);
  if (deferred) {
    KVCOMP_RETURN_IF_ERROR(
        DownloadAsync(backend.native_stream(), group_checks.data(), checks, checks_bytes));
    KVCOMP_RETURN_IF_ERROR(DownloadAsync(backend.native_stream(), group_list_errors.data(),
                                         list_errors, groups * sizeof(uint32_t)));
  }
  KVCOMP_RETURN_IF_ERROR(backend.CopyToHost(out.kept.data(), d_counts.data(), H * 4));
  xfer->to_host += H * 4;
  for (uint32_t gi = 0; gi < group_checks.size(); ++gi) {
    const uint32_t l = gi * group;
    const uint32_t g = std::min<uint32_t>(group, layout.num_layers - l);
    const uint64_t q_tokens =
        policy.scorer == Scorer::kSnapKV ? cache.queries[l].num_tokens : 0;
    KVCOMP_RETURN_IF_ERROR(GroupCheckStatus(group_checks[gi], l, heads, n, q_tokens));
    KVCOMP_RETURN_IF_ERROR(Annotate(
        AccumulateErrorStatus(group_list_errors[gi]),
        g == 1 ? absl::StrFormat("moments of layer %u", l)
               : absl::StrFormat("moments of layers %u-%u", l, l + g - 1)));
  }
  std::vector<uint64_t> layer_total(L, 0);
  uint64_t total = 0;
  for (uint64_t l = 0; l < L; ++l) {
    for (uint32_t h = 0; h < heads; ++h) layer_total[l] += out.kept[l * heads + h];
    if (layer_total[l] > cap) {
      return absl::InternalError(absl::StrFormat("layer %u kept %u tokens, more than its budget %u",
                                                 l, layer_total[l], cap));
    }
    total += layer_total[l];
  }
  if (total == L * cap) {  // every layer full (always, in practice): the arrays are the cache's
    dc.positions = std::move(d_idx);
    dc.keys = std::move(d_k);
    dc.values = std::move(d_v);
    dc.encoding = std::move(encoding);  // the sections sit at the format's offsets
  } else {  // layers that kept fewer than their cap: compacted on the device, in layer order
    dc.crc_parts.clear();  // of the places the format would have had with every layer full
    KVCOMP_ASSIGN_OR_RETURN(dc.positions, Buffer::Allocate(a, total * 4));
    KVCOMP_ASSIGN_OR_RETURN(dc.keys, Buffer::Allocate(a, total * row));
    KVCOMP_ASSIGN_OR_RETURN(dc.values, Buffer::Allocate(a, total * row));
    uint64_t at = 0;
    for (uint64_t l = 0; l < L; ++l) {
      const uint64_t t = layer_total[l];
      KVCOMP_RETURN_IF_ERROR(CopyOnDevice(backend, dc.positions.as<uint32_t>() + at,
                                          d_idx.as<uint32_t>() + l * cap, t * 4));
      KVCOMP_RETURN_IF_ERROR(CopyOnDevice(backend, dc.keys.as<char>() + at * row,
                                          d_k.as<char>() + l * cap * row, t * row));
      KVCOMP_RETURN_IF_ERROR(CopyOnDevice(backend, dc.values.as<char>() + at * row,
                                          d_v.as<char>() + l * cap * row, t * row));
      at += t;
    }
  }
  dc.host = std::move(out);
  return dc;
}

}  // namespace

absl::Status KvCacheView::Validate() const {
  KVCOMP_RETURN_IF_ERROR(layout.Validate());
  if (num_tokens == 0) return absl::InvalidArgumentError("empty sequence (zero tokens)");
  if (keys.size() != layout.num_layers || values.size() != layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%u key and %u value layers for a layout of %u layers", keys.size(),
                        values.size(), layout.num_layers));
  }
  if (!queries.empty() && queries.size() != layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%u query layers for %u layers", queries.size(), layout.num_layers));
  }
  const MemorySpace space = keys[0].space;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (const HeadsView* v : {&keys[l], &values[l]}) {
      const char* what = v == &keys[l] ? "keys" : "values";
      KVCOMP_RETURN_IF_ERROR(
          Annotate(CheckHeadsView(*v, space, what), absl::StrFormat("layer %u", l)));
      if (v->dtype != layout.dtype || v->num_heads != layout.num_kv_heads ||
          v->num_tokens != num_tokens || v->head_dim != layout.head_dim) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "layer %u %s: [%u, %u, %u] %s, expected [%u, %u, %u] %s", l, what, v->num_heads,
            v->num_tokens, v->head_dim, DTypeName(v->dtype), layout.num_kv_heads, num_tokens,
            layout.head_dim, DTypeName(layout.dtype)));
      }
    }
    if (!queries.empty()) {
      KVCOMP_RETURN_IF_ERROR(Annotate(CheckHeadsView(queries[l], space, "snapkv queries"),
                                      absl::StrFormat("layer %u", l)));
      if (queries[l].num_heads != layout.num_q_heads) {
        return absl::InvalidArgumentError(
            absl::StrFormat("layer %u: %u query heads, layout says %u", l, queries[l].num_heads,
                            layout.num_q_heads));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CompressedCache> DeviceCompressedCache::Download(Backend& backend,
                                                                TransferBytes* transfers) const {
  CompressedCache out = host;
  const uint64_t total = host.total_kept();
  const uint64_t heads = host.num_heads(), d = host.layout.head_dim;
  const auto start = std::chrono::steady_clock::now();
  uint64_t copied = 0;
  void* stream = backend.native_stream();
  auto fetch = [&](auto* v, const Buffer& src, uint64_t count, const char* what) -> absl::Status {
    using T = typename std::remove_pointer_t<decltype(v)>::value_type;
    const uint64_t bytes = count * sizeof(T);
    if (src.size() < bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "device cache: %s holds %u bytes, the cache needs %u", what, src.size(), bytes));
    }
    ResizeForDownload(v, count);
    copied += bytes;
    if (bytes == 0) return absl::OkStatus();
    if (stream == nullptr) return backend.CopyToHost(v->data(), src.data(), bytes);
    return DownloadAsync(stream, v->data(), src.data(), bytes);
  };
  KVCOMP_RETURN_IF_ERROR(fetch(&out.positions, positions, total, "positions"));
  KVCOMP_RETURN_IF_ERROR(fetch(&out.keys, keys, total * host.KeyTokenBytes(), "keys"));
  KVCOMP_RETURN_IF_ERROR(fetch(&out.key_scales, key_scales, host.KeyScaleCount(), "key_scales"));
  KVCOMP_RETURN_IF_ERROR(fetch(&out.values, values, host.ValueBytes(), "values"));
  KVCOMP_RETURN_IF_ERROR(
      fetch(&out.value_scales, value_scales, host.ValueScaleCount(), "value_scales"));
  KVCOMP_RETURN_IF_ERROR(
      fetch(&out.raw_value_rows, raw_value_rows, raw_value_row_count, "raw_value_rows"));
  KVCOMP_RETURN_IF_ERROR(fetch(&out.raw_values, raw_values,
                               raw_value_row_count * DTypeBytes(host.layout.dtype, d),
                               "raw_values"));
  if (host.has_moments) {
    KVCOMP_RETURN_IF_ERROR(fetch(&out.moment_count, moment_count, heads, "moment_count"));
    KVCOMP_RETURN_IF_ERROR(fetch(&out.moment_key_sum, moment_key_sum, heads * d, "moment_key_sum"));
    KVCOMP_RETURN_IF_ERROR(
        fetch(&out.moment_value_sum, moment_value_sum, heads * d, "moment_value_sum"));
    KVCOMP_RETURN_IF_ERROR(fetch(&out.moment_vk_sum, moment_vk_sum, heads * d * d, "moment_vk_sum"));
  }
  KVCOMP_RETURN_IF_ERROR(backend.Synchronize());
  if (transfers != nullptr) {
    transfers->to_host += copied;
    transfers->to_host_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return out;
}

namespace {

// The checks every compression makes before any work; the selection it implies.
absl::StatusOr<SelectParams> CheckCompressArgs(Backend& backend, const KvCacheView& cache,
                                               const CompressionPolicy& policy,
                                               const CompressOptions& options) {
  KVCOMP_RETURN_IF_ERROR(policy.Validate());
  KVCOMP_RETURN_IF_ERROR(cache.Validate());
  KVCOMP_RETURN_IF_ERROR(policy.ValidateFor(cache.layout.head_dim));
  if (policy.scorer == Scorer::kSnapKV && cache.queries.empty()) {
    return absl::InvalidArgumentError("snapkv needs the observation window's queries");
  }
  KVCOMP_RETURN_IF_ERROR(pipeline_internal::CodecsAvailable(
      backend, policy, options.projection.get(), options.pq.get(), cache.layout));
  return SelectParamsFromPolicy(policy, cache.num_tokens);
}

}  // namespace

absl::StatusOr<DeviceCompressedCache> CompressToDevice(Backend& backend, const KvCacheView& cache,
                                                       const CompressionPolicy& policy,
                                                       const CompressOptions& options) {
  if (backend.space() == MemorySpace::kHost) {
    return absl::FailedPreconditionError(
        "CompressToDevice needs a device backend (use Compress on a host backend)");
  }
  KVCOMP_ASSIGN_OR_RETURN(SelectParams select, CheckCompressArgs(backend, cache, policy, options));
  KVCOMP_ASSIGN_OR_RETURN(DeviceCompressedCache dc,
                          CompressOnDevice(backend, cache, policy, options, select));
  if (policy.key_codec == KeyCodec::kRaw && policy.value_codec == ValueCodec::kRaw) return dc;
  const auto t0 = std::chrono::steady_clock::now();
  KVCOMP_RETURN_IF_ERROR(
      pipeline_internal::DeviceCodecStage(backend, policy, options.projection.get(), &dc,
                                          options.transfers, options.pq.get()));
  if (options.transfers != nullptr) {
    // The encoded arrays are read next (the cache's format on the device): waiting here costs
    // nothing and times the codecs' kernels.
    KVCOMP_RETURN_IF_ERROR(backend.Synchronize());
    options.transfers->encode_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return dc;
}

bool DeviceEncodes(const CompressionPolicy& policy) {
  if (HqBits(policy.key_codec) == 0 && HqBits(policy.value_codec) == 0) return true;
  const char* env = std::getenv("KVCOMP_HQ_DEVICE_ENCODE");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

absl::StatusOr<CompressedCache> Compress(Backend& backend, const KvCacheView& cache,
                                         const CompressionPolicy& policy,
                                         const CompressOptions& options) {
  if (backend.space() != MemorySpace::kHost) {
    KVCOMP_RETURN_IF_ERROR(CheckPqCodecs(backend, policy, options.pq.get(), cache.layout));
    if (!DeviceEncodes(policy)) {
      // The hq codecs' device encoder is switched off (KVCOMP_HQ_DEVICE_ENCODE=0): the device
      // selects the kept tokens, the host encodes them (the projection codecs still on the
      // backend, through EncodeKept).
      KVCOMP_RETURN_IF_ERROR(policy.ValidateFor(cache.layout.head_dim));
      CompressionPolicy select_only = policy;
      select_only.key_codec = KeyCodec::kRaw;
      select_only.value_codec = ValueCodec::kRaw;
      select_only.rank = 0;
      KVCOMP_ASSIGN_OR_RETURN(DeviceCompressedCache dc,
                              CompressToDevice(backend, cache, select_only, options));
      KVCOMP_ASSIGN_OR_RETURN(CompressedCache host, dc.Download(backend, options.transfers));
      KVCOMP_RETURN_IF_ERROR(
          pipeline_internal::CodecStage(backend, policy, options.projection.get(), &host,
                                        options.pq.get()));
      host.policy = policy;
      return host;
    }
    KVCOMP_ASSIGN_OR_RETURN(DeviceCompressedCache dc,
                            CompressToDevice(backend, cache, policy, options));
    return dc.Download(backend, options.transfers);
  }
  KVCOMP_ASSIGN_OR_RETURN(SelectParams select, CheckCompressArgs(backend, cache, policy, options));

  const KvLayout& layout = cache.layout;
  const uint32_t heads = layout.num_kv_heads;
  const uint64_t n = cache.num_tokens;
  const size_t row = layout.head_dim * ElemBytes(layout.dtype);
  const uint64_t cap = KeptCapacity(heads, n, select.kept_per_head);

  CompressedCache out;
  out.policy = policy;
  out.has_moments = pipeline_internal::StoresMoments(backend, policy, select.kept_per_head, n);
  out.Reset(layout, n);
  out.positions.resize(layout.num_layers * cap);
  out.keys.resize(layout.num_layers * cap * row);
  out.values.resize(layout.num_layers * cap * row);

  uint64_t offset = 0;  // kept tokens written so far
  LayerEviction eviction;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    Buffer kb, vb, qb;  // unused on the host: Stage refuses device views here
    ScoreSelectCompactArgs args;
    KVCOMP_ASSIGN_OR_RETURN(args.keys, Stage(backend, cache.keys[l], &kb));
    KVCOMP_ASSIGN_OR_RETURN(args.values, Stage(backend, cache.values[l], &vb));
    HeadsView queries;
    if (policy.scorer == Scorer::kSnapKV) {
      KVCOMP_ASSIGN_OR_RETURN(queries, Stage(backend, cache.queries[l], &qb));
    }
    args.score = ScoreParamsFromPolicy(policy, l, queries);
    if (l < cache.key_sums.size() && cache.keys[l].space == MemorySpace::kHost) {
      args.score.key_sums = cache.key_sums[l];
    }
    args.select = select;
    uint32_t* counts = out.kept.data() + uint64_t{l} * heads;
    uint32_t* positions = out.positions.data() + offset;
    args.kept = {counts, positions};
    args.keys_out = out.keys.data() + offset * row;
    args.values_out = out.values.data() + offset * row;
    KVCOMP_RETURN_IF_ERROR(Annotate(
        policy.moment_aware ? moments_internal::MomentAwareScoreSelectCompact(backend, args)
                            : backend.scoring().ScoreSelectCompact(args),
        absl::StrFormat("layer %u", l)));
    uint64_t total = 0;
    for (uint32_t h = 0; h < heads; ++h) total += counts[h];
    if (options.on_evict || out.has_moments) {
      eviction.layer = l;
      eviction.keys = args.keys;
      eviction.values = args.values;
      Complement(counts, positions, heads, n, &eviction);
      if (options.on_evict) KVCOMP_RETURN_IF_ERROR(CallHook(options.on_evict, eviction));
      if (out.has_moments) {
        KVCOMP_RETURN_IF_ERROR(Annotate(pipeline_internal::MomentStage(backend, eviction, &out),
                                        absl::StrFormat("moments of layer %u", l)));
      }
    }
    offset += total;
  }
  out.positions.resize(offset);
  out.keys.resize(offset * row);
  out.values.resize(offset * row);
  const auto t0 = std::chrono::steady_clock::now();
  KVCOMP_RETURN_IF_ERROR(
      pipeline_internal::CodecStage(backend, policy, options.projection.get(), &out,
                                    options.pq.get()));
  if (options.transfers != nullptr) {
    options.transfers->encode_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return out;
}

absl::StatusOr<std::vector<float>> ScoreLayer(Backend& backend, const HeadsView& keys,
                                              const CompressionPolicy& policy, uint32_t layer,
                                              const HeadsView& queries) {
  KVCOMP_RETURN_IF_ERROR(policy.Validate());
  KVCOMP_RETURN_IF_ERROR(CheckHeadsView(keys, keys.space, "keys"));
  Buffer kb, qb, sb;
  KVCOMP_ASSIGN_OR_RETURN(HeadsView k, Stage(backend, keys, &kb));
  HeadsView q;
  if (policy.scorer == Scorer::kSnapKV) {
    if (queries.data == nullptr) {
      return absl::InvalidArgumentError("snapkv needs the observation window's queries");
    }
    KVCOMP_ASSIGN_OR_RETURN(q, Stage(backend, queries, &qb));
  }
  const uint64_t count = uint64_t{keys.num_heads} * keys.num_tokens;
  std::vector<float> scores(count);
  float* dst = scores.data();
  if (backend.space() != MemorySpace::kHost) {
    KVCOMP_ASSIGN_OR_RETURN(sb, Buffer::Allocate(backend.allocator(), count * sizeof(float)));
    dst = sb.as<float>();
  }
  KVCOMP_RETURN_IF_ERROR(
      backend.scoring().Score(k, ScoreParamsFromPolicy(policy, layer, q), TokenPositions{}, dst));
  if (dst != scores.data()) {
    KVCOMP_RETURN_IF_ERROR(backend.CopyToHost(scores.data(), dst, count * sizeof(float)));
  }
  return scores;
}

}  // namespace kvcomp
