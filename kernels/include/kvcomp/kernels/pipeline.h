// The compression pipeline: the engine's entry points for the daemon, the SDKs and Python. Given
// one sequence's KV cache and a CompressionPolicy it runs, per layer, score -> budget -> select
// -> compact (ScoringOps; with policy.moment_aware the MomentKV rescoring between score and
// select), then the extension stages:
//   moments: when policy.moments, the MomentKV summary of each head's evicted tokens,
//     through backend.moments();
//   codecs : when policy.key_codec/value_codec are not raw, the kept tokens are encoded
//     through backend.codec() (KVSplice: kvsplice.h).
// The stages live in kernels/src/pipeline_stages.cc (one function each). On a device backend
// every stage runs on the device (CompressToDevice below).
//
// Thread-safety: the functions are reentrant; a Backend is used by one thread at a time, so give
// each concurrent caller its own Backend. Views may be in host memory or the backend's space
// (the pipeline copies host inputs to a device backend itself).
#ifndef KVCOMP_KERNELS_PIPELINE_H_
#define KVCOMP_KERNELS_PIPELINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

// One sequence's KV cache as the engine reads it. Not owning.
struct KvCacheView {
  KvLayout layout;          // layers, kv heads, q heads, head_dim, dtype
  uint64_t num_tokens = 0;  // tokens of the sequence, >= 1
  // Per layer: [num_kv_heads, num_tokens, head_dim] views of layout.dtype, all in one space.
  std::vector<HeadsView> keys;
  std::vector<HeadsView> values;
  // snapkv only: per layer the last window's queries [num_q_heads, w, head_dim]; else empty.
  std::vector<HeadsView> queries;
  // Optional: per layer the keys' sums accumulated as they arrived (DeviceKv on the device,
  // kvcompd's put assembler on the host), in the memory space of that layer's keys, so the
  // mean-based scorers read the keys once; empty (or a layer's sums with no pointers, or held in
  // another space than its keys) = the scorer sums them itself.
  std::vector<KeySums> key_sums;

  // OK, or InvalidArgument naming the first inconsistency (layer count, shapes, dtypes, K/V
  // mismatch, spaces, empty sequence, unsupported head_dim/dtype).
  absl::Status Validate() const;
};

// The tokens a (layer, kv head) evicts, handed to an EvictionHook. Not owning; valid during the
// call only. Rows index `keys`/`values`, which are host memory for the block-wise compressor and
// the backend's space for Compress.
struct EvictedTokens {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  HeadsView keys;    // the source the rows index (one layer, all heads; use row kv_head)
  HeadsView values;  // same shape as keys
  absl::Span<const uint32_t> rows;       // host, ascending token indices into keys/values
  absl::Span<const uint32_t> positions;  // host, their absolute positions in the sequence
};
// Receives evicted tokens (moment accumulation, tests, custom consumers). A non-OK status stops
// the compression and is returned by it.
using EvictionHook = std::function<absl::Status(const EvictedTokens&)>;

// Bytes copied between host memory and a device by the pipeline itself: to_device (host to
// device) and to_host (device to host). The ops' argument checks read back a few bytes per call
// (offsets, an error flag) that are not counted here; docs/engine.md lists them.
struct TransferBytes {
  uint64_t to_device = 0;
  uint64_t to_host = 0;
  // Wall seconds of the final copy of a device compression's result to the host (after its
  // kernels are done), so callers can tell the device work from the download.
  double to_host_seconds = 0;
  // Wall seconds of the key and value codecs (int8 keys, KVSplice values) once the kept tokens
  // are selected, their device work included, so callers can time the encoding apart.
  double encode_seconds = 0;
};

struct CompressOptions {
  // Called once per (layer, kv head) with the tokens it evicted (after selection, before the
  // moment stage). Optional; default none.
  EvictionHook on_evict;
  // The calibrated KVSplice projection of the model (kvcomp/kernels/calibration.h),
  // needed when policy.value_codec is not none (FailedPrecondition without it); its layers, kv
  // heads and head_dim must be the cache's. The cache records its version. Default none.
  std::shared_ptr<const Projection> projection;
  // The model's pq calibration (kvcomp/codecs/pq.h), needed when a codec is pq
  // (FailedPrecondition without it, or when it was fitted at other bits than the policy's
  // key_bits / value_bits); its shape must be the cache's. The cache records its version and the
  // bases' fingerprints. Every backend encodes them to the same bytes (a device backend with
  // the CUDA twin of the library, kernels/src/cuda/pq_cuda.cu). Default none.
  std::shared_ptr<const pq::Calibration> pq;
  // When set, the bytes Compress copies between host and device are added to it. Default none.
  TransferBytes* transfers = nullptr;
};

// Compresses a whole sequence at once. On a device backend this is CompressToDevice (below)
// followed by DeviceCompressedCache::Download: host inputs are copied in layer by layer (device
// inputs are read in place), kept tokens, positions and moments are written into whole-cache
// arrays in device memory, and the result is copied to the host once at the end (a few bytes
// of kept counts first, then every section). InvalidArgument for bad input (see KvCacheView::Validate,
// CompressionPolicy::Validate, NaN/Inf keys, a budget of zero, snapkv without queries).
// Unimplemented for codecs not yet available. policy.block_size is ignored here (BlockCompressor).
absl::StatusOr<CompressedCache> Compress(Backend& backend, const KvCacheView& cache,
                                         const CompressionPolicy& policy,
                                         const CompressOptions& options = {});

// A compressed cache whose bulk arrays live in device memory (the backend's allocator), as a
// device compression leaves it: the format encoder and the GPU tier read it in place, and
// Download() brings it to host memory when it must go there.
//
// `host` carries every field of CompressedCache except the arrays listed below, which are left
// EMPTY there (layout, original_tokens, policy, key_codec, value_codec, rank, group_size,
// projection_version, value_gamma, layer_rank, kept, has_moments). Each device buffer holds
// exactly the bytes the host field would hold, in the same element type and order, so
// Download() is one copy per array. CompressToDevice allocates every buffer with exactly its
// array's bytes (Buffer::size()); a cache built elsewhere may hand over larger buffers, so
// readers take the array sizes from the host fields: total_kept() positions,
// total_kept() * KeyTokenBytes() key bytes, KeyScaleCount() key scales, ValueBytes() value
// bytes, ValueScaleCount() value scales, raw_value_row_count outlier rows (and as many rows of
// head_dim raw values in layout.dtype), num_heads() moment counts, num_heads() * head_dim key
// and value sums, num_heads() * head_dim^2 vk sums. An empty array has an empty Buffer.
// Move-only (Buffer is); the buffers must not outlive the backend's allocator.
struct DeviceCompressedCache {
  CompressedCache host;
  Buffer positions;       // u32, total_kept
  Buffer keys;            // total_kept * KeyTokenBytes() bytes
  Buffer key_scales;      // f32, KeyScaleCount() (empty for raw and fp16 keys)
  Buffer values;          // ValueBytes() bytes (raw values, or latents)
  Buffer value_scales;    // f16 bits (u16), ValueScaleCount()
  Buffer raw_value_rows;  // u64, raw_value_row_count: KVSplice outlier rows (usually few)
  Buffer raw_values;      // raw_value_row_count rows of head_dim in layout.dtype
  // MomentKV summaries when host.has_moments (else empty): u64 counts, f32 sums.
  Buffer moment_count, moment_key_sum, moment_value_sum, moment_vk_sum;
  // Element count of raw_value_rows (the one array the host fields do not size).
  uint64_t raw_value_row_count = 0;
  // When the compression wrote the arrays straight into the cache format's layout (eviction
  // with raw codecs, every layer full: the counts, hence every section's place, are known
  // before the first kernel), the buffer of the whole encoding, of which the array buffers
  // above are parts (Buffer::Part) at their sections' offsets; EncodeOnDevice then writes only
  // the header, the host sections, the padding and the CRCs there, and the encoding shares the
  // memory. Null otherwise (KVCOMP_FORMAT_IN_PLACE=0: always null).
  std::shared_ptr<const Buffer> encoding;
  // With `encoding` and KVCOMP_FORMAT_CRC_BESIDE=1: CRC32C words (u32, device memory,
  // crc_words) of consecutive parts of its sections, computed while the compression wrote them
  // (each layer group's part of each section, on a stream of its own beside the next group's
  // work), in the order of the words. Empty by default. A section whose parts, in the order listed, add up to its
  // size has its CRC combined from them (Crc32cCombine) instead of read again. Else empty.
  struct CrcPart {
    uint32_t section = 0;  // format::SectionId
    uint64_t size = 0;     // bytes
  };
  std::vector<CrcPart> crc_parts;
  Buffer crc_words;

  // One copy per array into a host CompressedCache on `backend`'s stream (the backend whose
  // allocator holds the buffers), waited for once; the bytes copied are added to
  // transfers->to_host and the wall time to transfers->to_host_seconds. InvalidArgument when a
  // buffer is smaller than its array.
  absl::StatusOr<CompressedCache> Download(Backend& backend,
                                           TransferBytes* transfers = nullptr) const;
};

// On a device backend: the whole compression, with nothing of the cache downloaded but control
// data (the kept counts, the per-layer check records, the count of KVSplice outlier rows and
// the ops' own argument readbacks). Host inputs are copied to the device layer by layer and
// counted in options.transfers->to_device; device inputs are read in place. FailedPrecondition
// on a host backend; the other errors are Compress's. When it returns, the device is done
// reading `cache` (the view may be freed); the cache's own device work may still be queued on
// the backend's stream, which every later use of the buffers follows. Compress() on a device
// backend is CompressToDevice followed by Download.
absl::StatusOr<DeviceCompressedCache> CompressToDevice(Backend& backend, const KvCacheView& cache,
                                                       const CompressionPolicy& policy,
                                                       const CompressOptions& options = {});

// Whether a device backend encodes every codec of `policy` on the device with an encoder that
// has been verified on a GPU, so a compression on a device engine should stay there
// (CompressToDevice; kvcompd's device put path). True for every policy by default, the Hadamard
// codecs (hq4/hq3, CodecOps::EncodeHq in kernels/src/cuda/hq_cuda.cu, the CPU's bits) included;
// KVCOMP_HQ_DEVICE_ENCODE=0 in the environment (read at each call) makes it false for them, so
// Compress selects on the device and encodes hq on the host (an operator's way back). The pq
// codecs are always encoded on the device (CodecOps::EncodePq), whatever this says.
bool DeviceEncodes(const CompressionPolicy& policy);

// Scores of one layer's keys ([num_heads, num_tokens] f32, host), as the policy's scorer gives
// them (no protection applied). `queries` for snapkv.
absl::StatusOr<std::vector<float>> ScoreLayer(Backend& backend, const HeadsView& keys,
                                              const CompressionPolicy& policy, uint32_t layer = 0,
                                              const HeadsView& queries = {});

struct BlockCompressorOptions {
  // Tokens per head the working set is evicted down to after each block. 0 = from the policy:
  // policy.token_budget, else policy.KeptPerHead(expected_tokens). One of them must be set.
  uint64_t budget = 0;
  // Expected sequence length, used only to turn policy.ratio into a budget. Default 0.
  uint64_t expected_tokens = 0;
  // Receives every token evicted from the working set (after each block and at Finish).
  EvictionHook on_evict;
  // As CompressOptions::projection and ::pq. Default none.
  std::shared_ptr<const Projection> projection;
  std::shared_ptr<const pq::Calibration> pq;
};

// Block-wise compression for streaming prefill (KeyDiff): blocks of at most
// policy.block_size tokens arrive in order per layer; after each block the layer's working set
// is scored and evicted down to the budget. Memory: at most budget + block_size tokens per head
// (AdaKV: per layer on average, heads may hold more than others). The working set is host memory;
// block inputs may be host or backend memory. Scores are recomputed over the working set each
// time (keydiff/manifold means over the working set; windowed_manifold windows over its rows).
// snapkv is not supported (its queries exist only at the end) and is InvalidArgument.
//
// Not thread-safe. Owns its working set; the Backend must outlive it.
class BlockCompressor {
 public:
  static absl::StatusOr<std::unique_ptr<BlockCompressor>> Create(
      Backend& backend, const KvLayout& layout, const CompressionPolicy& policy,
      BlockCompressorOptions options = {});
  virtual ~BlockCompressor() = default;

  // Appends the next block of `layer`: keys/values [num_kv_heads, b, head_dim] of layout.dtype,
  // 1 <= b <= block_size. InvalidArgument for bad shapes or NaN/Inf keys (the block is then
  // dropped and the compressor stays usable).
  virtual absl::Status Append(uint32_t layer, const HeadsView& keys, const HeadsView& values) = 0;
  // Evicts what still exceeds the budget and returns the cache. Every layer must have seen the
  // same number of tokens (>= 1). The compressor is spent afterwards.
  virtual absl::StatusOr<CompressedCache> Finish() = 0;

  virtual uint64_t budget() const = 0;
  virtual uint64_t tokens_seen(uint32_t layer) const = 0;
  // The most tokens any head of any layer held at once (the memory bound tests check).
  virtual uint64_t peak_tokens_per_head() const = 0;
};

// ---- Device staging: a put's K and V copied to the device once, as its blocks arrive ----

// Host-to-device copies for one CUDA device, on a stream of its own, through a ring of
// page-locked staging buffers: Upload copies the host bytes into a free staging buffer and
// queues its copy to the device, so the caller may reuse its memory on return while the DMA of
// earlier pieces overlaps the next host copy. One uploader serves every put of an engine.
//
// Thread-safe (calls are serialised inside).
class DeviceUploader {
 public:
  // For CUDA device `device`; FailedPrecondition when it is absent (or this build has no
  // CUDA). `chunk_bytes` x `chunks` of page-locked memory are allocated once, here.
  static absl::StatusOr<std::unique_ptr<DeviceUploader>> Create(int device,
                                                                size_t chunk_bytes = 8 << 20,
                                                                int chunks = 4);
  virtual ~DeviceUploader() = default;

  // Copies `height` rows of `width` bytes from host `src` (rows `src_pitch` bytes apart) to
  // device `dst` (rows `dst_pitch` apart). Returns once `src` may be reused; the device copy
  // completes in the uploader's stream order.
  virtual absl::Status Upload2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                                size_t width, size_t height) = 0;
  // The same for a source in device memory of the same device (no staging).
  virtual absl::Status Copy2DOnDevice(void* dst, size_t dst_pitch, const void* src,
                                      size_t src_pitch, size_t width, size_t height) = 0;
  // `consumer`'s stream waits for every copy issued so far (an event; the host does not wait).
  virtual absl::Status OrderBefore(Backend& consumer) = 0;
  // Device memory allocated and freed in the uploader's stream order.
  virtual Allocator& allocator() = 0;
  // Host-to-device bytes copied since creation.
  virtual uint64_t uploaded_bytes() const = 0;

  // A mark in the uploader's stream after every copy issued so far: Done() says, without
  // waiting, whether those copies have completed on the device (an event, polled). Any thread
  // may create, poll and destroy one; destroying it never waits.
  class Fence {
   public:
    virtual ~Fence() = default;
    // True once the copies issued before the mark are complete; an error when the device failed.
    virtual absl::StatusOr<bool> Done() = 0;
  };
  virtual absl::StatusOr<std::unique_ptr<Fence>> MarkCopies() = 0;
};

// One sequence's K and V in device memory, [K, V][layer][kv head][token][head_dim] in the
// layout's dtype (every layer's keys, then every layer's values, so that Compress takes the
// layers as one view of layers x heads heads), filled part by part (any order, each (layer,
// part, token range) once) by the owner of a put. View() is the KvCacheView Compress reads in
// place.
//
// Entry points for a put's blocks: AddHost for blocks received into host memory (one upload,
// staged), AddDevice for blocks already in device memory of the uploader's device (one copy on
// the device, nothing crosses to the host). Not thread-safe: the owner serialises calls.
class DeviceKv {
 public:
  // ResourceExhausted when the device has no room for layout.CacheBytes(num_tokens).
  static absl::StatusOr<std::unique_ptr<DeviceKv>> Create(DeviceUploader& uploader,
                                                          const KvLayout& layout,
                                                          uint64_t num_tokens);
  virtual ~DeviceKv() = default;

  // Copies `src` ([num_kv_heads, t, head_dim] of layout.dtype, rows dense along head_dim) into
  // `layer`'s keys (values when `values`), tokens [token_begin, token_begin + t).
  // InvalidArgument when it does not fit the layout or the memory space is wrong.
  virtual absl::Status AddHost(uint32_t layer, bool values, uint64_t token_begin,
                               const HeadsView& src) = 0;
  virtual absl::Status AddDevice(uint32_t layer, bool values, uint64_t token_begin,
                                 const HeadsView& src) = 0;
  // Orders `consumer` after every copy so far and returns the device view of the whole cache.
  // The consumer's stream must be done with the view before this object is destroyed (Compress
  // synchronises before it returns).
  virtual absl::StatusOr<KvCacheView> View(Backend& consumer) = 0;
  // Host-to-device bytes this sequence's parts cost (0 for AddDevice).
  virtual uint64_t uploaded_bytes() const = 0;
  virtual uint64_t device_bytes() const = 0;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_PIPELINE_H_
