// kvcompd's device-resident put path, in-process on a GPU (label gpu): an Engine on the CUDA
// backend, a CacheRepository over a real TieredStore (host tier or GPU tier, RocksDB in a
// temporary directory) and a CacheService, puts handed in as BlockData. Checks the bytes that
// cross between host and device per put (one upload of the blocks; the cache encoded on the
// device, then copied to the host once for the host tier or RocksDB and never for the GPU tier,
// besides control bytes), reads into device memory, the result against the CPU twin, the GPU memory cap, device-memory blocks,
// the engine's failure on a (injected) sticky error, and the data checks that run without a
// host wait per layer (a NaN/Inf in one layer fails the put, nothing stored).
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "cache_repository.h"
#include "cache_service.h"
#include "common/gpu.h"
#include "engine.h"
#include "gtest/gtest.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/storage/tiered_store.h"
#include "kvsplice_glue.h"
#include "service_context.h"
#include "put.h"
#include "service_test_util.h"

namespace kvcomp {
namespace service {
namespace {

KVCOMP_GPU_TEST_BINARY();

const KvLayout kLayout{4, 4, 8, 128, DType::kF32};
constexpr uint64_t kTokens = 512;

using testutil::MakeBlock;

// K and V of kLayout over kTokens.
struct Tensor : testutil::KvTensor {
  explicit Tensor(uint64_t seed) : KvTensor(kLayout, kTokens, seed) {}
};

#if defined(KVCOMP_HAVE_CUDA)
// The same block in device memory (what a GPU-to-GPU channel hands over).
BlockData ToDevice(BlockData b) {
  void* dev = nullptr;
  if (cudaMalloc(&dev, b.bytes) != cudaSuccess) return BlockData{};
  const auto* host = static_cast<const float*>(b.keys[0].data);
  cudaMemcpy(dev, host, b.bytes, cudaMemcpyHostToDevice);
  const auto* base = static_cast<const uint8_t*>(dev);
  for (auto* part : {&b.keys, &b.values}) {
    for (HeadsView& v : *part) {
      v.data = base + (static_cast<const uint8_t*>(v.data) - reinterpret_cast<const uint8_t*>(host));
      v.space = MemorySpace::kDevice;
    }
  }
  b.memory = std::shared_ptr<void>(dev, [](void* p) { cudaFree(p); });
  return b;
}
#endif

class DevicePathTest : public testutil::ServiceFixture {
 protected:
  void Start(storage::TierKind tier, uint64_t gpu_cap = 0,
             storage::Durability durability = storage::Durability::kMemory) {
    storage::StoreOptions so;
    so.host.enabled = true;
    so.host.capacity_bytes = 256 << 20;
    so.device.enabled = tier == storage::TierKind::kDevice;
    so.device.capacity_bytes = 256 << 20;
    so.rocksdb.enabled = true;
    so.rocksdb.capacity_bytes = 1 << 30;
    so.rocksdb.reserve_bytes = 1;
    EngineOptions eo;
    eo.backend = "cuda";
    eo.workers = 1;
    eo.gpu_memory_bytes = gpu_cap;
    RepositoryOptions ro;
    ro.durability = durability;
    ro.put_tier = static_cast<int>(tier);
    ServiceOptions svo;
    svo.max_put_bytes = 1 << 30;
    ASSERT_NO_FATAL_FAILURE(Open(so, eo, ro, svo));
    ASSERT_NE(engine_->uploader(), nullptr);
  }

  static CompressionPolicy Policy() {
    CompressionPolicy p;
    p.scorer = Scorer::kManifold;
    p.ratio = 0.5;
    p.moments = true;
    return p;
  }
  absl::StatusOr<PutRequest> Request(const std::string& key,
                                     const CompressionPolicy& policy = Policy()) {
    return PutRequest::Make(CacheKey{"alice", "m", key}, kLayout, kTokens, policy, false);
  }
  // The whole tensor in blocks of two layers x 128 tokens, out of order.
  absl::StatusOr<CacheSummary> PutCache(const std::string& key, const Tensor& x,
                                        bool device_blocks = false,
                                        const CompressionPolicy& policy = Policy()) {
    KVCOMP_ASSIGN_OR_RETURN(PutRequest r, Request(key, policy));
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<OpenPut> put, service_->BeginPut(std::move(r)));
    for (uint64_t t0 = kTokens; t0 > 0; t0 -= 128) {
      for (uint32_t l = 0; l < kLayout.num_layers; l += 2) {
        BlockData b = MakeBlock(x, l, l + 2, t0 - 128, t0);
#if defined(KVCOMP_HAVE_CUDA)
        if (device_blocks) b = ToDevice(std::move(b));
#endif
        KVCOMP_RETURN_IF_ERROR(Add(*put, std::move(b)));
      }
    }
    return Commit(*put);
  }
  absl::StatusOr<CompressedCache> Stored(const std::string& key) {
    KVCOMP_ASSIGN_OR_RETURN(storage::Payload out, Get(CacheKey{"alice", "m", key}));
    return format::ParseCache(out.view());
  }
  // The control bytes of encoding `key`'s stored cache on the device (EncodeOnDevice): up, the
  // header region (header, section table, kept counts, policy, padding); down, one CRC32C per
  // section copied on the device.
  struct Control {
    uint64_t up = 0, down = 0;
  };
  absl::StatusOr<Control> EncodingControl(const std::string& key) {
    KVCOMP_ASSIGN_OR_RETURN(CompressedCache c, Stored(key));
    KVCOMP_ASSIGN_OR_RETURN(format::EncodingPlan plan,
                            format::PlanEncoding(c, c.raw_value_rows.size()));
    Control out;
    out.up = plan.sections[2].offset;  // through the policy section's padding
    out.down = (plan.sections.size() - 2) * 4;  // no layer ranks with raw codecs
    return out;
  }
};

// Compress on the device (inputs in device memory, as the daemon hands them) against the CPU
// twin for the policies whose per-layer totals and evicted sets it computes on the device.
TEST(CompressOnDevice, AgreesWithTheCpuTwin) {
  Tensor x(3);
  auto cpu = MakeCpuBackend(CpuBackendOptions{2});
  auto gpu = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  auto uploader = DeviceUploader::Create(0);
  ASSERT_TRUE(uploader.ok()) << uploader.status();
  auto kv = DeviceKv::Create(**uploader, kLayout, kTokens);
  ASSERT_TRUE(kv.ok()) << kv.status();
  const KvCacheView host = x.View();
  for (uint32_t l = 0; l < kLayout.num_layers; ++l) {
    ASSERT_TRUE((*kv)->AddHost(l, false, 0, host.keys[l]).ok());
    ASSERT_TRUE((*kv)->AddHost(l, true, 0, host.values[l]).ok());
  }
  EXPECT_EQ((*kv)->uploaded_bytes(), kLayout.CacheBytes(kTokens));
  auto device = (*kv)->View(**gpu);
  ASSERT_TRUE(device.ok());
  std::vector<CompressionPolicy> policies(4);
  policies[0].scorer = Scorer::kManifold;
  policies[0].moments = true;
  policies[1].scorer = Scorer::kKnorm;
  policies[1].head_budget = HeadBudget::kAdaKV;
  policies[1].moments = true;
  policies[2].scorer = Scorer::kKeyDiff;
  policies[2].moments = false;
  policies[3].scorer = Scorer::kManifold;
  policies[3].moments = true;
  policies[3].ratio = 0.75;
  for (const CompressionPolicy& p : policies) {
    SCOPED_TRACE(p.DebugString());
    TransferBytes moved;
    CompressOptions o;
    o.transfers = &moved;
    absl::StatusOr<CompressedCache> g = Compress(**gpu, *device, p, o);
    absl::StatusOr<CompressedCache> c = Compress(**cpu, host, p);
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(moved.to_device, 0u);  // inputs already on the device
    EXPECT_EQ(g->kept, c->kept);
    ASSERT_EQ(g->positions.size(), c->positions.size());
    uint64_t same = 0;
    for (size_t i = 0; i < c->positions.size(); ++i) same += g->positions[i] == c->positions[i];
    EXPECT_GE(same, c->positions.size() * 99 / 100);
    EXPECT_EQ(g->has_moments, c->has_moments);
    EXPECT_EQ(g->moment_count, c->moment_count);
    EXPECT_TRUE(g->Validate().ok()) << g->Validate();
    // An eviction hook sees the same evicted tokens through the host-list path.
    uint64_t hooked = 0;
    CompressOptions h;
    h.on_evict = [&](const EvictedTokens& e) {
      hooked += e.rows.size();
      return absl::OkStatus();
    };
    absl::StatusOr<CompressedCache> gh = Compress(**gpu, *device, p, h);
    ASSERT_TRUE(gh.ok()) << gh.status();
    EXPECT_EQ(hooked, uint64_t{kLayout.num_layers} * kLayout.num_kv_heads * kTokens -
                          gh->total_kept());
    EXPECT_EQ(gh->moment_count, g->moment_count);
  }
}

TEST_F(DevicePathTest, HostTierPutUploadsOnceDownloadsOnceAndMatchesTheCpu) {
  Start(storage::TierKind::kHost);
  Tensor x(7);
  absl::StatusOr<CacheSummary> s = PutCache("k", x);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tier, storage::TierKind::kHost);
  // One upload of the blocks (and the encoding's header region), one download: the encoded
  // cache, into the host tier (besides the control bytes).
  absl::StatusOr<Control> control = EncodingControl("k");
  ASSERT_TRUE(control.ok()) << control.status();
  const uint64_t heads = uint64_t{kLayout.num_layers} * kLayout.num_kv_heads;
  EXPECT_EQ(s->h2d_bytes, kLayout.CacheBytes(kTokens) + control->up);
  EXPECT_EQ(s->d2h_bytes, heads * 4 + control->down + s->stored_bytes);
  EXPECT_EQ(engine_->device_reserved_bytes(), 0u);

  absl::StatusOr<CompressedCache> gpu = Stored("k");
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu_backend = MakeCpuBackend(CpuBackendOptions{2});
  ASSERT_TRUE(cpu_backend.ok());
  absl::StatusOr<CompressedCache> cpu = Compress(**cpu_backend, x.View(), Policy());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_EQ(gpu->kept, cpu->kept);
  ASSERT_EQ(gpu->positions.size(), cpu->positions.size());
  // The two backends sum in different orders: near-tied scores may swap at the threshold.
  uint64_t same = 0;
  for (size_t i = 0; i < cpu->positions.size(); ++i) same += gpu->positions[i] == cpu->positions[i];
  EXPECT_GE(same, cpu->positions.size() * 99 / 100);
  EXPECT_EQ(gpu->keys == cpu->keys, gpu->positions == cpu->positions);
  ASSERT_TRUE(gpu->has_moments);
  EXPECT_EQ(gpu->moment_count, cpu->moment_count);
  double worst = 0;
  for (size_t i = 0; i < cpu->moment_key_sum.size(); ++i) {
    worst = std::max(worst, std::abs(double{gpu->moment_key_sum[i]} - cpu->moment_key_sum[i]));
  }
  EXPECT_LT(worst, 1e-2 * std::sqrt(double(kTokens)));
}

TEST_F(DevicePathTest, GpuTierPutKeepsTheCacheOnTheDeviceAndAGetCopiesItOnce) {
  Start(storage::TierKind::kDevice);
  Tensor x(8);
  const std::string before_put = metrics_->Scrape();
  absl::StatusOr<CacheSummary> s = PutCache("k", x);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string after_put = metrics_->Scrape();
  EXPECT_EQ(s->tier, storage::TierKind::kDevice);
  // Up: the blocks once, and the encoding's header region. Down: nothing of the cache, only
  // control data: the kept counts (one u32 per head) and one CRC32C per section copied on the
  // device. The encoded cache is never copied to the host nor back.
  absl::StatusOr<Control> control = EncodingControl("k");
  ASSERT_TRUE(control.ok()) << control.status();
  const uint64_t heads = uint64_t{kLayout.num_layers} * kLayout.num_kv_heads;
  EXPECT_EQ(s->h2d_bytes, kLayout.CacheBytes(kTokens) + control->up);
  EXPECT_EQ(s->d2h_bytes, heads * 4 + control->down);
  EXPECT_LT(s->d2h_bytes, 4096u);
  const std::string before = metrics_->Scrape();
  absl::StatusOr<CompressedCache> got = Stored("k");
  ASSERT_TRUE(got.ok()) << got.status();
  const std::string after = metrics_->Scrape();
  auto counter = [](const std::string& text, const std::string& name) {
    return Scraped(text, name, -1.0);
  };
  EXPECT_NEAR(
      counter(after, "kvcomp_d2h_bytes_total") - counter(before, "kvcomp_d2h_bytes_total"),
      static_cast<double>(s->stored_bytes), 0.5);
  EXPECT_EQ(counter(after, "kvcomp_h2d_bytes_total"), counter(before, "kvcomp_h2d_bytes_total"));
  // The put's own counts are what the daemon exports.
  for (const char* name : {"kvcomp_h2d_bytes_total", "kvcomp_d2h_bytes_total"}) {
    const double want = name[7] == 'h' ? s->h2d_bytes : s->d2h_bytes;
    EXPECT_NEAR(counter(after_put, name) - counter(before_put, name), want, 0.5) << name;
  }
}

// A disk-durable put into the GPU tier: the RocksDB copy needs the bytes on the host, so the
// encoded cache comes down exactly once (checked there against its device CRC32C); the GPU tier
// keeps the device copy. The cache is the one a host-tier put of the same blocks stores.
TEST_F(DevicePathTest, ADiskDurableGpuTierPutDownloadsTheEncodedCacheOnce) {
  Start(storage::TierKind::kDevice, 0, storage::Durability::kDisk);
  Tensor x(16);
  absl::StatusOr<CacheSummary> s = PutCache("k", x);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tier, storage::TierKind::kDevice);
  absl::StatusOr<storage::LookupResult> where = store_->Lookup(CacheKey{"alice", "m", "k"});
  ASSERT_TRUE(where.ok());
  EXPECT_TRUE(where->persisted);
  absl::StatusOr<Control> control = EncodingControl("k");
  ASSERT_TRUE(control.ok()) << control.status();
  const uint64_t heads = uint64_t{kLayout.num_layers} * kLayout.num_kv_heads;
  EXPECT_EQ(s->h2d_bytes, kLayout.CacheBytes(kTokens) + control->up);
  EXPECT_EQ(s->d2h_bytes, heads * 4 + control->down + s->stored_bytes);
  absl::StatusOr<CompressedCache> on_gpu = Stored("k");
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();

  TearDown();
  Start(storage::TierKind::kHost);
  absl::StatusOr<CacheSummary> h = PutCache("k", x);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->stored_bytes, s->stored_bytes);
  absl::StatusOr<CompressedCache> on_host = Stored("k");
  ASSERT_TRUE(on_host.ok()) << on_host.status();
  EXPECT_EQ(on_gpu->kept, on_host->kept);
  EXPECT_EQ(on_gpu->positions, on_host->positions);
  EXPECT_EQ(on_gpu->keys, on_host->keys);
  EXPECT_EQ(on_gpu->values, on_host->values);
  EXPECT_EQ(on_gpu->moment_count, on_host->moment_count);
}

#if defined(KVCOMP_HAVE_CUDA)
// GetInto: a cache in the GPU tier read into device memory with one copy on the device, nothing
// through the host (what a GPU-to-GPU channel serves from).
TEST_F(DevicePathTest, AGetIntoDeviceMemoryCopiesOnTheDeviceOnly) {
  Start(storage::TierKind::kDevice);
  Tensor x(17);
  absl::StatusOr<CacheSummary> s = PutCache("k", x);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<storage::Payload> host = Get(CacheKey{"alice", "m", "k"});
  ASSERT_TRUE(host.ok());
  const std::string before = metrics_->Scrape();
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, s->stored_bytes), cudaSuccess);
  absl::StatusOr<storage::CacheMeta> meta = repository_->GetInto(
      CacheKey{"alice", "m", "k"}, storage::DeviceTarget{dev, s->stored_bytes, 0, nullptr});
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(meta->stored_bytes, s->stored_bytes);
  std::string back(s->stored_bytes, '\0');
  ASSERT_EQ(cudaMemcpy(back.data(), dev, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(back == host->view());
  // Another tenant's key reads as missing here too.
  EXPECT_TRUE(absl::IsNotFound(
      repository_->GetInto(CacheKey{"bob", "m", "k"},
                           storage::DeviceTarget{dev, s->stored_bytes, 0, nullptr})
          .status()));
  cudaFree(dev);
  const std::string after = metrics_->Scrape();
  auto counter = [](const std::string& text, const std::string& name) {
    return Scraped(text, name, -1.0);
  };
  EXPECT_EQ(counter(after, "kvcomp_d2h_bytes_total"), counter(before, "kvcomp_d2h_bytes_total"));
  EXPECT_EQ(counter(after, "kvcomp_h2d_bytes_total"), counter(before, "kvcomp_h2d_bytes_total"));
}
#endif

// A get of the decoded representation of a KVSplice cache (int8 keys, int8 latent values) on a
// GPU engine: decoded by the engine's worker on the device (the codecs' inputs up, the decoded
// keys and values down, counted in the transfer metrics, and the decode stage observed), against
// its CPU twin (the shared CPU decoder over the same stored bytes): the same kept tokens, keys
// within f32 rounding, values within the device expansion's bound (f16 operands on tensor
// cores, f32 sums: 5e-3 of the largest value, as the codec's own CUDA tests).
TEST_F(DevicePathTest, ADecodedGetOfAnEncodedCacheDecodesOnTheDeviceAndMatchesTheCpu) {
  Start(storage::TierKind::kHost);
  Tensor x(21);
  for (const char* k : {"raw0", "raw1"}) {
    absl::StatusOr<CacheSummary> raw = PutCache(k, x);
    ASSERT_TRUE(raw.ok()) << raw.status();
  }
  absl::Status calibrated = CalibrateOrthogonalInt8(kLayout.head_dim / 2);
  ASSERT_TRUE(calibrated.ok()) << calibrated;
  CompressionPolicy splice = Policy();
  splice.moments = false;
  splice.key_codec = KeyCodec::kInt8;
  splice.value_codec = ValueCodec::kOrthogonalInt8;
  splice.rank = kLayout.head_dim / 2;
  absl::StatusOr<CacheSummary> s = PutCache("splice", x, false, splice);
  ASSERT_TRUE(s.ok()) << s.status();
  const CacheKey key{"alice", "m", "splice"};
  absl::StatusOr<storage::Payload> stored = Get(key);
  ASSERT_TRUE(stored.ok()) << stored.status();

  const std::string before = metrics_->Scrape();
  absl::StatusOr<storage::Payload> on_gpu = Get(key, Representation::kDecoded);
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  const std::string after = metrics_->Scrape();
  absl::StatusOr<storage::Payload> on_cpu = repository_->Decode(key, *stored, nullptr);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  absl::StatusOr<CompressedCache> g = format::ParseCache(on_gpu->view());
  absl::StatusOr<CompressedCache> c = format::ParseCache(on_cpu->view());
  ASSERT_TRUE(g.ok() && c.ok()) << g.status() << " " << c.status();
  EXPECT_EQ(g->key_codec, KeyCodec::kRaw);
  EXPECT_EQ(g->value_codec, ValueCodec::kRaw);
  EXPECT_EQ(g->positions, c->positions);
  ASSERT_EQ(g->keys.size(), c->keys.size());
  ASSERT_EQ(g->values.size(), c->values.size());
  auto worst = [](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
    const auto* fa = reinterpret_cast<const float*>(a.data());
    const auto* fb = reinterpret_cast<const float*>(b.data());
    double diff = 0, top = 0;
    for (size_t i = 0; i < a.size() / sizeof(float); ++i) {
      diff = std::max(diff, std::abs(double{fa[i]} - fb[i]));
      top = std::max(top, std::abs(double{fb[i]}));
    }
    return top > 0 ? diff / top : diff;
  };
  EXPECT_LT(worst(g->keys, c->keys), 1e-6);
  EXPECT_LT(worst(g->values, c->values), 5e-3);
  auto counter = [](const std::string& text, const std::string& name) {
    return Scraped(text, name, -1.0);
  };
  // The decoded keys and values came down from the device; the encoded arrays went up.
  EXPECT_GE(counter(after, "kvcomp_d2h_bytes_total") - counter(before, "kvcomp_d2h_bytes_total"),
            static_cast<double>(g->keys.size() + g->values.size()));
  EXPECT_GT(counter(after, "kvcomp_h2d_bytes_total") - counter(before, "kvcomp_h2d_bytes_total"),
            0.0);
  const std::string decode_count = "kvcomp_stage_duration_seconds_count{stage=\"decode\"}";
  EXPECT_EQ(counter(after, decode_count) - std::max(0.0, counter(before, decode_count)), 1.0);
}

#if defined(KVCOMP_HAVE_CUDA)
TEST_F(DevicePathTest, DeviceMemoryBlocksNeverCrossToTheHost) {
  Start(storage::TierKind::kHost);
  Tensor x(9);
  absl::StatusOr<CacheSummary> dev = PutCache("dev", x, /*device_blocks=*/true);
  ASSERT_TRUE(dev.ok()) << dev.status();
  // Nothing of the blocks up; the encoding's header region up, the encoded cache down once.
  absl::StatusOr<Control> control = EncodingControl("dev");
  ASSERT_TRUE(control.ok()) << control.status();
  const uint64_t heads = uint64_t{kLayout.num_layers} * kLayout.num_kv_heads;
  EXPECT_EQ(dev->h2d_bytes, control->up);
  EXPECT_EQ(dev->d2h_bytes, heads * 4 + control->down + dev->stored_bytes);
  absl::StatusOr<CacheSummary> host = PutCache("host", x);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<CompressedCache> a = Stored("dev"), b = Stored("host");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->positions, b->positions);
  EXPECT_EQ(a->keys, b->keys);
  EXPECT_EQ(a->values, b->values);
}
#endif

// The hq codecs have no device encoder: a put from device memory into the GPU tier is selected
// on the device, encoded on the host, and stores the same bytes as the put from host memory.
TEST_F(DevicePathTest, AnHqPutFromDeviceMemoryEncodesOnTheHostLikeAHostPut) {
  Start(storage::TierKind::kDevice);
  Tensor x(13);
  CompressionPolicy p = Policy();
  p.moments = false;
  p.key_codec = KeyCodec::kHq4;
  p.value_codec = ValueCodec::kHq3;
  absl::StatusOr<CacheSummary> dev = PutCache("dev", x, /*device_blocks=*/true, p);
  ASSERT_TRUE(dev.ok()) << dev.status();
  absl::StatusOr<CacheSummary> host = PutCache("host", x, /*device_blocks=*/false, p);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(dev->stored_bytes, host->stored_bytes);
  absl::StatusOr<CompressedCache> a = Stored("dev"), b = Stored("host");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->key_codec, KeyCodec::kHq4);
  EXPECT_EQ(a->value_codec, ValueCodec::kHq3);
  EXPECT_EQ(a->positions, b->positions);
  EXPECT_EQ(a->keys, b->keys);
  EXPECT_EQ(a->values, b->values);
}

// The `codec` preset's codecs (pq keys at 3 bits, values at 2) on a GPU engine: calibrated from
// raw caches the engine stored, the put encodes on the device (blocks in host or device memory)
// into the bytes the CPU backend writes with the same calibration, and a decoded get gives the
// CPU decoder's rows.
TEST_F(DevicePathTest, APqPutEncodesOnTheDeviceIntoTheCpusBytes) {
  Start(storage::TierKind::kDevice);
  CompressionPolicy raw;
  raw.ratio = 0.0;
  raw.moments = false;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<CacheSummary> s = PutCache("raw" + std::to_string(i), Tensor(70 + i),
                                              /*device_blocks=*/false, raw);
    ASSERT_TRUE(s.ok()) << s.status();
  }
  CompressionPolicy p;
  p.ratio = 0.0;
  p.moments = false;
  p.key_codec = KeyCodec::kPq;
  p.value_codec = ValueCodec::kPq;
  p.key_bits = 3;
  p.value_bits = 2;
  // Before a calibration the put is refused, naming the call.
  Tensor x(17);
  absl::StatusOr<CacheSummary> early = PutCache("early", x, false, p);
  ASSERT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  CalibrationRequest cr;
  cr.tenant = "alice";
  cr.model_id = "m";
  cr.value_codec = "pq";
  cr.key_bits = 3;
  cr.value_bits = 2;
  absl::StatusOr<CalibrationResult> cal = CalibrateFromStore(store_.get(), projections_.get(), cr);
  ASSERT_TRUE(cal.ok()) << cal.status();
  absl::StatusOr<std::shared_ptr<const pq::Calibration>> calibration =
      projections_->GetPq("alice/m", cal->projection_version);
  ASSERT_TRUE(calibration.ok()) << calibration.status();

  absl::StatusOr<CacheSummary> dev = PutCache("dev", x, /*device_blocks=*/true, p);
  ASSERT_TRUE(dev.ok()) << dev.status();
  absl::StatusOr<CacheSummary> host = PutCache("host", x, /*device_blocks=*/false, p);
  ASSERT_TRUE(host.ok()) << host.status();
  auto cpu_backend = MakeCpuBackend(CpuBackendOptions{2});
  ASSERT_TRUE(cpu_backend.ok());
  CompressOptions o;
  o.pq = *calibration;
  absl::StatusOr<CompressedCache> want = Compress(**cpu_backend, x.View(), p, o);
  ASSERT_TRUE(want.ok()) << want.status();
  for (const char* key : {"dev", "host"}) {
    SCOPED_TRACE(key);
    absl::StatusOr<CompressedCache> got = Stored(key);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->key_codec, KeyCodec::kPq);
    EXPECT_EQ(got->value_codec, ValueCodec::kPq);
    EXPECT_EQ(got->projection_version, cal->projection_version);
    EXPECT_EQ(got->kept, want->kept);
    EXPECT_EQ(got->keys, want->keys);
    EXPECT_EQ(got->values, want->values);
  }
  absl::StatusOr<storage::Payload> decoded =
      Get(CacheKey{"alice", "m", "dev"}, Representation::kDecoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  absl::StatusOr<CompressedCache> rows = format::ParseCache(decoded->view());
  ASSERT_TRUE(rows.ok()) << rows.status();
  absl::StatusOr<CompressedCache> want_rows =
      DecodeToRawCodecs(**cpu_backend, *want, nullptr, calibration->get());
  ASSERT_TRUE(want_rows.ok()) << want_rows.status();
  EXPECT_EQ(rows->keys, want_rows->keys);
  EXPECT_EQ(rows->values, want_rows->values);
}

TEST_F(DevicePathTest, APutBeyondTheGpuMemoryCapIsRefusedWithNothingKept) {
  const uint64_t need = Engine::DeviceBytesForPut(kLayout, kTokens, true);
  Start(storage::TierKind::kHost, /*gpu_cap=*/need + need / 2);
  Tensor x(10);
  auto r1 = Request("a");
  auto r2 = Request("b");
  ASSERT_TRUE(r1.ok() && r2.ok());
  absl::StatusOr<std::shared_ptr<OpenPut>> first = service_->BeginPut(*std::move(r1));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(engine_->device_reserved_bytes(), need);
  // A second put would need more than the cap leaves: refused before any block.
  absl::StatusOr<std::shared_ptr<OpenPut>> second = service_->BeginPut(*std::move(r2));
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(second.status())) << second.status();
  EXPECT_EQ(engine_->device_reserved_bytes(), need);
  (*first)->Abort();
  first->reset();
  EXPECT_EQ(engine_->device_reserved_bytes(), 0u);
  EXPECT_TRUE(absl::IsNotFound(Stored("b").status()));
  // With the first put gone the same put fits.
  absl::StatusOr<CacheSummary> ok = PutCache("b", x);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(engine_->device_reserved_bytes(), 0u);
}

// The data checks of a device put run without the host waiting per layer; a NaN or Inf in one
// layer still fails the whole put with that layer, K or V, head and token named, and nothing of
// it is stored. The engine stays healthy and takes the next put.
TEST_F(DevicePathTest, ANonFiniteValueInOneLayerFailsThePutAndStoresNothing) {
  for (storage::TierKind tier : {storage::TierKind::kHost, storage::TierKind::kDevice}) {
    SCOPED_TRACE(static_cast<int>(tier));
    TearDown();
    Start(tier);
    Tensor bad_keys(12);
    bad_keys.keys[(((uint64_t{2} * kLayout.num_kv_heads + 1) * kTokens + 300) *
                   kLayout.head_dim) + 17] = std::nanf("");
    absl::StatusOr<CacheSummary> s = PutCache("bad-keys", bad_keys);
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
    EXPECT_NE(s.status().message().find("layer 2: keys: NaN or Inf"), std::string::npos)
        << s.status();
    EXPECT_NE(s.status().message().find("head 1, token 300"), std::string::npos) << s.status();
    EXPECT_TRUE(absl::IsNotFound(Stored("bad-keys").status()));

    Tensor bad_values(13);
    bad_values.values[(((uint64_t{3} * kLayout.num_kv_heads + 0) * kTokens + 5) *
                       kLayout.head_dim)] = INFINITY;
    s = PutCache("bad-values", bad_values, /*device_blocks=*/true);
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
    EXPECT_NE(s.status().message().find("layer 3: values: NaN or Inf"), std::string::npos)
        << s.status();
    EXPECT_NE(s.status().message().find("head 0, token 5"), std::string::npos) << s.status();
    EXPECT_TRUE(absl::IsNotFound(Stored("bad-values").status()));

    EXPECT_FALSE(engine_->failed());
    EXPECT_EQ(engine_->device_reserved_bytes(), 0u);
    Tensor good(14);
    absl::StatusOr<CacheSummary> ok = PutCache("good", good);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_TRUE(Stored("good").ok());
  }
}

// The ops' deferred checks on their own: findings land in device memory, the call returns OK,
// and the record read afterwards gives the message the waiting call gives.
TEST(DeferredChecks, ScoreSelectCompactAndAccumulateReportInDeviceMemory) {
  auto gpu = MakeCudaBackend();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  Backend& b = **gpu;
  Tensor x(15);
  const uint32_t H = kLayout.num_kv_heads, D = kLayout.head_dim;
  const uint64_t layer = uint64_t{H} * kTokens * D;
  x.values[(uint64_t{2} * kTokens + 40) * D + 3] = std::nanf("");  // head 2, token 40
  auto upload = [&](const float* src, uint64_t count) {
    auto buf = Buffer::Allocate(b.allocator(), count * sizeof(float));
    EXPECT_TRUE(buf.ok());
    EXPECT_TRUE(b.CopyFromHost(buf->data(), src, count * sizeof(float)).ok());
    return std::move(*buf);
  };
  Buffer k = upload(x.keys.data(), layer), v = upload(x.values.data(), layer);
  CompressionPolicy p;
  p.scorer = Scorer::kManifold;
  p.ratio = 0.5;
  auto select = SelectParamsFromPolicy(p, kTokens);
  ASSERT_TRUE(select.ok());
  const uint64_t cap = KeptCapacity(H, kTokens, select->kept_per_head);
  auto counts = Buffer::Allocate(b.allocator(), H * 4);
  auto idx = Buffer::Allocate(b.allocator(), cap * 4);
  auto ko = Buffer::Allocate(b.allocator(), cap * D * 4);
  auto vo = Buffer::Allocate(b.allocator(), cap * D * 4);
  auto rec = Buffer::Allocate(b.allocator(), sizeof(DeferredCheck) + 4);
  ASSERT_TRUE(counts.ok() && idx.ok() && ko.ok() && vo.ok() && rec.ok());
  const DeferredCheck clean;
  const uint32_t zero = 0;
  ASSERT_TRUE(b.CopyFromHost(rec->data(), &clean, sizeof(clean)).ok());
  ASSERT_TRUE(b.CopyFromHost(rec->as<char>() + sizeof(clean), &zero, 4).ok());
  ScoreSelectCompactArgs a;
  a.keys = HeadsView::Dense(k.data(), DType::kF32, H, kTokens, D, MemorySpace::kDevice);
  a.values = HeadsView::Dense(v.data(), DType::kF32, H, kTokens, D, MemorySpace::kDevice);
  a.score = ScoreParamsFromPolicy(p, 0);
  a.select = *select;
  a.kept = {counts->as<uint32_t>(), idx->as<uint32_t>()};
  a.keys_out = ko->data();
  a.values_out = vo->data();
  // Waiting: the error at once.
  absl::Status waited = b.scoring().ScoreSelectCompact(a);
  EXPECT_TRUE(absl::IsInvalidArgument(waited)) << waited;
  // Deferred: OK now, the same message from the record.
  a.deferred_check = rec->as<DeferredCheck>();
  ASSERT_TRUE(b.scoring().ScoreSelectCompact(a).ok());
  DeferredCheck found;
  ASSERT_TRUE(b.CopyToHost(&found, rec->data(), sizeof(found)).ok());
  absl::Status deferred = DeferredCheckStatus(found, kTokens, 0);
  EXPECT_EQ(deferred, waited);
  EXPECT_NE(deferred.message().find("values: NaN or Inf"), std::string::npos) << deferred;
  EXPECT_NE(deferred.message().find("head 2, token 40"), std::string::npos) << deferred;

  // Moments over a list with an index out of range: flagged, nothing added.
  std::vector<uint32_t> list(H * 4, 1);
  list[5] = kTokens + 7;
  std::vector<uint64_t> off(H + 1);
  for (uint32_t h = 0; h <= H; ++h) off[h] = uint64_t{h} * 4;
  auto dl = Buffer::Allocate(b.allocator(), list.size() * 4);
  auto doff = Buffer::Allocate(b.allocator(), off.size() * 8);
  const uint64_t mom_bytes = H * 8 + 2 * H * D * 4 + H * D * D * 4;
  auto mom = Buffer::Allocate(b.allocator(), mom_bytes);
  ASSERT_TRUE(dl.ok() && doff.ok() && mom.ok());
  ASSERT_TRUE(b.CopyFromHost(dl->data(), list.data(), list.size() * 4).ok());
  ASSERT_TRUE(b.CopyFromHost(doff->data(), off.data(), off.size() * 8).ok());
  std::vector<char> zeros(mom_bytes, 0);
  ASSERT_TRUE(b.CopyFromHost(mom->data(), zeros.data(), mom_bytes).ok());
  char* m0 = mom->as<char>();
  MomentsView m{reinterpret_cast<uint64_t*>(m0), reinterpret_cast<float*>(m0 + H * 8),
                reinterpret_cast<float*>(m0 + H * 8 + H * D * 4),
                reinterpret_cast<float*>(m0 + H * 8 + 2 * H * D * 4), H, D,
                MemorySpace::kDevice};
  TokenLists lists{dl->as<uint32_t>(), doff->as<uint64_t>(), H, MemorySpace::kDevice};
  HeadsView kk = a.keys, vv = a.keys;  // finite inputs
  EXPECT_TRUE(absl::IsInvalidArgument(b.moments().Accumulate(kk, vv, lists, m)));
  auto* word = reinterpret_cast<uint32_t*>(rec->as<char>() + sizeof(clean));
  ASSERT_TRUE(b.moments().AccumulateDeferred(kk, vv, lists, 4, word, m).ok());
  uint32_t flag = 0;
  ASSERT_TRUE(b.CopyToHost(&flag, word, 4).ok());
  EXPECT_NE(flag, 0u);
  EXPECT_TRUE(absl::IsInvalidArgument(AccumulateErrorStatus(flag)));
  std::vector<char> after(mom_bytes, 1);
  ASSERT_TRUE(b.CopyToHost(after.data(), mom->data(), mom_bytes).ok());
  EXPECT_EQ(after, zeros);
  // A list longer than the bound given is flagged too; good lists are summed.
  list[5] = 2;
  ASSERT_TRUE(b.CopyFromHost(dl->data(), list.data(), list.size() * 4).ok());
  ASSERT_TRUE(b.CopyFromHost(word, &zero, 4).ok());
  ASSERT_TRUE(b.moments().AccumulateDeferred(kk, vv, lists, 3, word, m).ok());
  ASSERT_TRUE(b.CopyToHost(&flag, word, 4).ok());
  EXPECT_NE(flag, 0u);
  ASSERT_TRUE(b.CopyFromHost(word, &zero, 4).ok());
  ASSERT_TRUE(b.moments().AccumulateDeferred(kk, vv, lists, 4, word, m).ok());
  ASSERT_TRUE(b.CopyToHost(&flag, word, 4).ok());
  EXPECT_EQ(flag, 0u);
  std::vector<uint64_t> count(H);
  ASSERT_TRUE(b.CopyToHost(count.data(), m0, H * 8).ok());
  EXPECT_EQ(count, std::vector<uint64_t>(H, 4));
}

TEST_F(DevicePathTest, AStickyErrorFailsTheEngineAndItTakesNoMorePuts) {
  Start(storage::TierKind::kHost);
  Tensor x(11);
  ASSERT_TRUE(PutCache("before", x).ok());
  engine_->InjectStickyFaultForTest();
  absl::StatusOr<CacheSummary> s = PutCache("during", x);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(engine_->failed());
  EXPECT_TRUE(absl::IsNotFound(Stored("during").status()));
  auto r = Request("after");
  ASSERT_TRUE(r.ok());
  absl::StatusOr<std::shared_ptr<OpenPut>> after = service_->BeginPut(*std::move(r));
  EXPECT_TRUE(absl::IsUnavailable(after.status())) << after.status();
  // What was stored before stays served.
  EXPECT_TRUE(Stored("before").ok());
}

}  // namespace
}  // namespace service
}  // namespace kvcomp
