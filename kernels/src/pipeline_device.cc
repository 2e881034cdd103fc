// Device staging of a put (pipeline.h: DeviceUploader, DeviceKv). With CUDA: a ring of
// page-locked buffers and a stream of the uploader's own; without it, FailedPrecondition.
//
// DeviceKv also sums each layer's keys as they arrive (KeySums: per chunk of
// kKeySumChunkTokens tokens, the keys and the unit keys), on the uploader's stream right after
// the copy that completes a chunk, while its rows are still in L2. Compress then hands them to
// the mean-based scorers, which read the keys once instead of twice. KVCOMP_DEVICE_KEY_SUMS=0
// turns this off (the scorers then sum the keys themselves; for comparisons).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/pipeline.h"
#include "pipeline_device.h"

#if defined(KVCOMP_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"
#include "cuda/scoring_cuda.h"
#include "cuda/stream_allocator.h"
#endif

namespace kvcomp {

#if defined(KVCOMP_HAVE_CUDA)
namespace {

// Freed device memory the uploader's pool keeps mapped for the next put's input.
constexpr uint64_t kUploadPoolKeepBytes = uint64_t{64} << 20;

// An event recorded on the uploader's stream; cudaEventQuery polls it, cudaEventDestroy does
// not wait for it.
class EventFence final : public DeviceUploader::Fence {
 public:
  explicit EventFence(cudaEvent_t event) : event_(event) {}
  ~EventFence() override { cudaEventDestroy(event_); }
  absl::StatusOr<bool> Done() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(e);
    return true;
  }

 private:
  cudaEvent_t event_;
};

class CudaUploader final : public DeviceUploader {
 public:
  ~CudaUploader() override {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (Chunk& c : chunks_) {
      if (c.event != nullptr) cudaEventDestroy(c.event);
      if (c.host != nullptr) cudaFreeHost(c.host);
    }
    if (fence_ != nullptr) cudaEventDestroy(fence_);
    alloc_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init(int device, size_t chunk_bytes, int chunks) {
    device_ = device;
    chunk_bytes_ = chunk_bytes;
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fence_, cudaEventDisableTiming));
    chunks_.resize(static_cast<size_t>(std::max(1, chunks)));
    for (Chunk& c : chunks_) {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&c.host, chunk_bytes_));
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&c.event, cudaEventDisableTiming));
    }
    // In the uploader's stream order.
    KVCOMP_ASSIGN_OR_RETURN(alloc_,
                            StreamAllocator::Create(device_, stream_, kUploadPoolKeepBytes));
    return absl::OkStatus();
  }

  absl::Status Upload2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                        size_t width, size_t height) override {
    if (width == 0 || height == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("upload: null pointer");
    absl::MutexLock lock(&mu_);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    if (width > chunk_bytes_) {  // rows larger than a staging buffer: piece by piece
      for (size_t r = 0; r < height; ++r) {
        for (size_t off = 0; off < width; off += chunk_bytes_) {
          const size_t n = std::min(chunk_bytes_, width - off);
          KVCOMP_RETURN_IF_ERROR(StageLocked(d + r * dst_pitch + off, 0, s + r * src_pitch + off,
                                             0, n, 1));
        }
      }
      return absl::OkStatus();
    }
    const size_t rows_per_chunk = chunk_bytes_ / width;
    for (size_t r = 0; r < height; r += rows_per_chunk) {
      const size_t rows = std::min(rows_per_chunk, height - r);
      KVCOMP_RETURN_IF_ERROR(
          StageLocked(d + r * dst_pitch, dst_pitch, s + r * src_pitch, src_pitch, width, rows));
    }
    return absl::OkStatus();
  }

  absl::Status Copy2DOnDevice(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                              size_t width, size_t height) override {
    if (width == 0 || height == 0) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                                  cudaMemcpyDeviceToDevice, stream_));
    return absl::OkStatus();
  }

  absl::Status OrderBefore(Backend& consumer) override {
    auto* other = static_cast<cudaStream_t>(consumer.native_stream());
    if (other == nullptr) return absl::InvalidArgumentError("upload: consumer is not a CUDA backend");
    absl::MutexLock lock(&mu_);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventRecord(fence_, stream_));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(other, fence_, 0));
    return absl::OkStatus();
  }

  // The uploader's stream waits for `other`'s work so far (before memory it read is freed).
  void WaitFor(cudaStream_t other) {
    absl::MutexLock lock(&mu_);
    cudaSetDevice(device_);
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      cudaStreamSynchronize(other);
      return;
    }
    cudaEventRecord(e, other);
    cudaStreamWaitEvent(stream_, e, 0);
    cudaEventDestroy(e);
  }

  // Runs `f` with the uploader's stream, in order after every copy issued so far.
  absl::Status OnStream(const std::function<absl::Status(cudaStream_t)>& f) {
    absl::MutexLock lock(&mu_);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return f(stream_);
  }

  absl::StatusOr<std::unique_ptr<Fence>> MarkCopies() override {
    absl::MutexLock lock(&mu_);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaEvent_t e = nullptr;
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    auto fence = std::make_unique<EventFence>(e);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, stream_));
    return std::unique_ptr<Fence>(std::move(fence));
  }

  Allocator& allocator() override { return *alloc_; }
  uint64_t uploaded_bytes() const override {
    absl::MutexLock lock(&mu_);
    return uploaded_;
  }
  int device() const { return device_; }

 private:
  struct Chunk {
    void* host = nullptr;
    cudaEvent_t event = nullptr;
  };

  // One piece that fits a staging buffer: packed after the previous pieces of the current
  // buffer, or at the start of the next one once that buffer's earlier copies are done; its
  // copy is queued at once.
  absl::Status StageLocked(uint8_t* dst, size_t dst_pitch, const uint8_t* src, size_t src_pitch,
                           size_t width, size_t rows) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t bytes = width * rows;
    if (fill_ == 0 || fill_ + bytes > chunk_bytes_) {
      next_ = (next_ + 1) % chunks_.size();
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(chunks_[next_].event));
      fill_ = 0;
    }
    Chunk& c = chunks_[next_];
    auto* h = static_cast<uint8_t*>(c.host) + fill_;
    fill_ += (bytes + 255) / 256 * 256;
    if (rows == 1 || src_pitch == width) {
      std::memcpy(h, src, width * rows);
    } else {
      for (size_t r = 0; r < rows; ++r) std::memcpy(h + r * width, src + r * src_pitch, width);
    }
    if (rows == 1) {
      KVCOMP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst, h, width, cudaMemcpyHostToDevice, stream_));
    } else {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dst, dst_pitch, h, width, width, rows,
                                                    cudaMemcpyHostToDevice, stream_));
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaEventRecord(c.event, stream_));
    uploaded_ += width * rows;
    return absl::OkStatus();
  }

  int device_ = 0;
  size_t chunk_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t fence_ = nullptr;
  std::unique_ptr<Allocator> alloc_;
  mutable absl::Mutex mu_;
  std::vector<Chunk> chunks_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // the buffer being filled
  size_t fill_ ABSL_GUARDED_BY(mu_) = 0;  // its bytes in use (0: take the next buffer)
  uint64_t uploaded_ ABSL_GUARDED_BY(mu_) = 0;
};

bool KeySumsEnabled() {
  static const bool enabled = pipeline_internal::SwitchOn("KVCOMP_DEVICE_KEY_SUMS");
  return enabled;
}

class CudaDeviceKv final : public DeviceKv {
 public:
  CudaDeviceKv(CudaUploader* uploader, const KvLayout& layout, uint64_t n, Buffer memory)
      : uploader_(uploader),
        layout_(layout),
        n_(n),
        chunks_((n + kKeySumChunkTokens - 1) / kKeySumChunkTokens),
        memory_(std::move(memory)) {}

  // The key sums' memory: [sums, unit sums][layer] of [heads, chunks, head_dim] f32 (every
  // layer's sums one after another, as its keys), then one u64 slot for the rows the sums found
  // bad (the scorer reports those itself). Optional: a put without it is compressed as before.
  absl::Status InitKeySums() {
    if (!KeySumsEnabled()) return absl::OkStatus();
    const uint64_t bytes = uint64_t{layout_.num_layers} * 2 * SumFloats() * sizeof(float) + 256;
    KVCOMP_ASSIGN_OR_RETURN(sums_, Buffer::Allocate(uploader_->allocator(), bytes));
    KVCOMP_RETURN_IF_ERROR(uploader_->OnStream([&](cudaStream_t s) -> absl::Status {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(BadKeySlot(), 0xFF, 8, s));
      return absl::OkStatus();
    }));
    covered_.assign(layout_.num_layers, std::vector<uint16_t>(chunks_, 0));
    sums_ok_.assign(layout_.num_layers, true);
    return absl::OkStatus();
  }
  ~CudaDeviceKv() override {
    // Compress synchronises its stream before it returns; a consumer that failed half-way may
    // still have kernels queued: the memory is freed after them.
    if (consumer_ != nullptr) uploader_->WaitFor(consumer_);
  }

  absl::Status AddHost(uint32_t layer, bool values, uint64_t token_begin,
                       const HeadsView& src) override {
    KVCOMP_RETURN_IF_ERROR(Check(layer, token_begin, src, MemorySpace::kHost));
    const uint64_t before = uploader_->uploaded_bytes();
    KVCOMP_RETURN_IF_ERROR(Copy(layer, values, token_begin, src, /*host=*/true));
    uploaded_ += uploader_->uploaded_bytes() - before;
    return values ? absl::OkStatus() : AccumulateKeySums(layer, token_begin, src.num_tokens);
  }
  absl::Status AddDevice(uint32_t layer, bool values, uint64_t token_begin,
                         const HeadsView& src) override {
    KVCOMP_RETURN_IF_ERROR(Check(layer, token_begin, src, MemorySpace::kDevice));
    KVCOMP_RETURN_IF_ERROR(Copy(layer, values, token_begin, src, /*host=*/false));
    return values ? absl::OkStatus() : AccumulateKeySums(layer, token_begin, src.num_tokens);
  }

  absl::StatusOr<KvCacheView> View(Backend& consumer) override {
    KVCOMP_RETURN_IF_ERROR(uploader_->OrderBefore(consumer));
    consumer_ = static_cast<cudaStream_t>(consumer.native_stream());
    KvCacheView v;
    v.layout = layout_;
    v.num_tokens = n_;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      v.keys.push_back(HeadsView::Dense(Part(l, false), layout_.dtype, layout_.num_kv_heads, n_,
                                        layout_.head_dim, MemorySpace::kDevice));
      v.values.push_back(HeadsView::Dense(Part(l, true), layout_.dtype, layout_.num_kv_heads, n_,
                                          layout_.head_dim, MemorySpace::kDevice));
    }
    if (sums_.data() != nullptr) {
      // A layer's sums only once every chunk of its keys arrived.
      for (uint32_t l = 0; l < layout_.num_layers; ++l) {
        bool complete = sums_ok_[l];
        for (uint64_t c = 0; complete && c < chunks_; ++c) complete = covered_[l][c] == ChunkLen(c);
        v.key_sums.push_back(complete ? KeySums{Sums(l, false), Sums(l, true), n_} : KeySums{});
      }
    }
    return v;
  }
  uint64_t uploaded_bytes() const override { return uploaded_; }
  uint64_t device_bytes() const override { return memory_.size() + sums_.size(); }

 private:
  size_t Row() const { return layout_.head_dim * DTypeBytes(layout_.dtype, 1); }
  // Every layer's keys, then every layer's values: the layers of the cache are one view of
  // layers x heads heads, which CompressOnDevice compresses at once.
  uint8_t* Part(uint32_t layer, bool values) const {
    const uint64_t part = uint64_t{layout_.num_kv_heads} * n_ * Row();
    return memory_.as<uint8_t>() + ((values ? layout_.num_layers : 0) + uint64_t{layer}) * part;
  }
  absl::Status Check(uint32_t layer, uint64_t token_begin, const HeadsView& src,
                     MemorySpace space) const {
    if (layer >= layout_.num_layers || src.data == nullptr || src.space != space ||
        src.dtype != layout_.dtype || src.num_heads != layout_.num_kv_heads ||
        src.head_dim != layout_.head_dim || src.num_tokens == 0 ||
        token_begin + src.num_tokens > n_ || src.token_stride < src.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "device staging: a part of layer %u, tokens %u..%u, does not fit the put", layer,
          token_begin, token_begin + src.num_tokens));
    }
    return absl::OkStatus();
  }
  absl::Status Copy(uint32_t layer, bool values, uint64_t token_begin, const HeadsView& src,
                    bool host) {
    const size_t es = DTypeBytes(layout_.dtype, 1);
    const size_t row = Row();
    uint8_t* base = Part(layer, values) + token_begin * row;
    const auto* s = static_cast<const uint8_t*>(src.data);
    const bool dense_tokens = src.token_stride == src.head_dim;
    for (uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      uint8_t* d = base + uint64_t{h} * n_ * row;
      const uint8_t* from = s + src.offset(h, 0) * es;
      // A head's tokens: one run when dense, else one row per token.
      const size_t width = dense_tokens ? src.num_tokens * row : row;
      const size_t height = dense_tokens ? 1 : src.num_tokens;
      const size_t spitch = dense_tokens ? width : src.token_stride * es;
      const size_t dpitch = dense_tokens ? width : row;
      KVCOMP_RETURN_IF_ERROR(host ? uploader_->Upload2D(d, dpitch, from, spitch, width, height)
                                  : uploader_->Copy2DOnDevice(d, dpitch, from, spitch, width,
                                                              height));
    }
    return absl::OkStatus();
  }

  uint64_t SumFloats() const { return uint64_t{layout_.num_kv_heads} * chunks_ * layout_.head_dim; }
  float* Sums(uint32_t layer, bool unit) const {
    return sums_.as<float>() + ((unit ? layout_.num_layers : 0) + uint64_t{layer}) * SumFloats();
  }
  unsigned long long* BadKeySlot() const {
    return reinterpret_cast<unsigned long long*>(
        sums_.as<char>() + uint64_t{layout_.num_layers} * 2 * SumFloats() * sizeof(float));
  }
  uint64_t ChunkLen(uint64_t c) const {
    return std::min<uint64_t>(kKeySumChunkTokens, n_ - c * kKeySumChunkTokens);
  }

  // Keys [b, b + t) of `layer` were just queued: the chunks this completes are summed now, in
  // the uploader's stream after the copy. A layer's tokens arrive once each, so the chunks inside
  // the range are new and complete, and only its two end chunks can have been started before:
  // the completed chunks are one run.
  absl::Status AccumulateKeySums(uint32_t layer, uint64_t b, uint64_t t) {
    if (sums_.data() == nullptr || !sums_ok_[layer]) return absl::OkStatus();
    std::vector<uint16_t>& cov = covered_[layer];
    const uint64_t e = b + t;
    const uint64_t first = b / kKeySumChunkTokens, last = (e - 1) / kKeySumChunkTokens;
    for (uint64_t c = first; c <= last; ++c) {
      const uint64_t c0 = c * kKeySumChunkTokens;
      const uint64_t add = std::min(e, c0 + ChunkLen(c)) - std::max(b, c0);
      if (cov[c] + add > ChunkLen(c)) {  // a range given twice: these sums are not used
        sums_ok_[layer] = false;
        return absl::OkStatus();
      }
      cov[c] = static_cast<uint16_t>(cov[c] + add);
    }
    const uint64_t lo = cov[first] == ChunkLen(first) ? first : first + 1;
    const uint64_t hi = cov[last] == ChunkLen(last) ? last + 1 : last;
    if (lo >= hi) return absl::OkStatus();
    const HeadsView keys = HeadsView::Dense(Part(layer, false), layout_.dtype,
                                            layout_.num_kv_heads, n_, layout_.head_dim,
                                            MemorySpace::kDevice);
    return uploader_->OnStream([&](cudaStream_t s) {
      return cuda::EnqueueKeySums(s, keys, lo, hi, Sums(layer, false), Sums(layer, true),
                                  BadKeySlot());
    });
  }

  CudaUploader* const uploader_;
  const KvLayout layout_;
  const uint64_t n_;
  const uint64_t chunks_;
  Buffer memory_;
  Buffer sums_;
  std::vector<std::vector<uint16_t>> covered_;  // per layer, key tokens arrived per chunk
  std::vector<bool> sums_ok_;                   // per layer
  uint64_t uploaded_ = 0;
  cudaStream_t consumer_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceUploader>> DeviceUploader::Create(int device,
                                                                       size_t chunk_bytes,
                                                                       int chunks) {
  if (chunk_bytes == 0) return absl::InvalidArgumentError("device staging: zero chunk size");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("device staging: CUDA device ", device, " absent"));
  }
  auto up = std::make_unique<CudaUploader>();
  KVCOMP_RETURN_IF_ERROR(up->Init(device, chunk_bytes, chunks));
  return std::unique_ptr<DeviceUploader>(std::move(up));
}

namespace pipeline_internal {

absl::Status ZeroDevice(Backend& backend, void* dst, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(backend.native_stream())));
  return absl::OkStatus();
}

absl::Status FillDevice(Backend& backend, void* dst, uint8_t value, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(backend.native_stream())));
  return absl::OkStatus();
}

absl::Status DownloadAsync(void* stream, void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost,
                                              static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

}  // namespace pipeline_internal

absl::StatusOr<std::unique_ptr<DeviceKv>> DeviceKv::Create(DeviceUploader& uploader,
                                                           const KvLayout& layout,
                                                           uint64_t num_tokens) {
  KVCOMP_RETURN_IF_ERROR(layout.Validate());
  if (num_tokens == 0) return absl::InvalidArgumentError("device staging: zero tokens");
  auto* up = static_cast<CudaUploader*>(&uploader);
  KVCOMP_ASSIGN_OR_RETURN(Buffer memory,
                          Buffer::Allocate(up->allocator(), layout.CacheBytes(num_tokens)));
  auto kv = std::make_unique<CudaDeviceKv>(up, layout, num_tokens, std::move(memory));
  KVCOMP_RETURN_IF_ERROR(kv->InitKeySums());
  return std::unique_ptr<DeviceKv>(std::move(kv));
}

#else  // no CUDA

namespace pipeline_internal {

absl::Status ZeroDevice(Backend&, void*, uint64_t) {
  return absl::FailedPreconditionError("this build has no CUDA");
}
absl::Status FillDevice(Backend&, void*, uint8_t, uint64_t) {
  return absl::FailedPreconditionError("this build has no CUDA");
}
absl::Status DownloadAsync(void*, void*, const void*, uint64_t) {
  return absl::FailedPreconditionError("this build has no CUDA");
}
absl::Status LaunchEvictedLists(void*, const uint32_t*, const uint32_t*, uint32_t, uint64_t,
                                uint64_t*, uint64_t*, uint32_t*) {
  return absl::FailedPreconditionError("this build has no CUDA");
}

}  // namespace pipeline_internal

absl::StatusOr<std::unique_ptr<DeviceUploader>> DeviceUploader::Create(int, size_t, int) {
  return absl::FailedPreconditionError("device staging: this build has no CUDA");
}

absl::StatusOr<std::unique_ptr<DeviceKv>> DeviceKv::Create(DeviceUploader&, const KvLayout&,
                                                           uint64_t) {
  return absl::FailedPreconditionError("device staging: this build has no CUDA");
}

#endif  // KVCOMP_HAVE_CUDA

}  // namespace kvcomp
