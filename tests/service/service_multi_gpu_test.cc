// kvcompd's engines on two GPUs, in-process (label gpu; skipped with fewer than two devices):
// EngineSet::Create with engine.cuda_devices "0,1" makes one CUDA engine per device, the GPU
// tier keeps a pool on each, and a CacheService over them places puts. Checks that open puts
// land on both devices, each cache is stored in the GPU tier from its own device and reads back
// (to the host, and into device memory of either GPU) as the CPU twin compresses it; that the
// GPU memory cap is per device (a third put waits for room on either); that a GPU without free
// memory for a put is passed over; and that a sticky error of one engine fails its put, leaves
// the other engine taking puts and fails the set.
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cache_repository.h"
#include "cache_service.h"
#include "engine.h"
#include "engine_set.h"
#include "gtest/gtest.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/storage/tiered_store.h"
#include "put.h"
#include "service_test_util.h"

#if defined(KVCOMP_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace kvcomp {
namespace service {
namespace {

int DeviceCount() {
#if defined(KVCOMP_HAVE_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

// Exits 77 (ctest: skipped) before any test without two CUDA devices.
class TwoGpus : public ::testing::Environment {
 public:
  void SetUp() override {
    if (DeviceCount() >= 2) return;
    std::fprintf(stderr, "fewer than two CUDA devices (or built without CUDA): skipping\n");
    std::fflush(stderr);
    std::exit(77);
  }
};
::testing::Environment* const kTwoGpus = ::testing::AddGlobalTestEnvironment(new TwoGpus);

const KvLayout kLayout{4, 4, 8, 128, DType::kF32};
constexpr uint64_t kTokens = 512;
constexpr uint64_t kPoolBytes = uint64_t{256} << 20;

using testutil::MakeBlock;

struct Tensor : testutil::KvTensor {
  explicit Tensor(uint64_t seed) : KvTensor(kLayout, kTokens, seed) {}
};

class MultiGpuTest : public testutil::ServiceFixture {
 protected:
  void Start(uint64_t gpu_cap = 0) {
    storage::StoreOptions so;
    so.host.enabled = true;
    so.host.capacity_bytes = 256 << 20;
    so.device.enabled = true;
    so.device.devices = {0, 1};
    so.device.capacity_bytes = kPoolBytes;
    so.rocksdb.enabled = true;
    so.rocksdb.capacity_bytes = 1 << 30;
    so.rocksdb.reserve_bytes = 1;
    EngineOptions eo;
    eo.backend = "cuda";
    eo.cuda_devices = "0,1";
    eo.workers = 1;
    eo.gpu_memory_bytes = gpu_cap;
    RepositoryOptions ro;
    ro.durability = storage::Durability::kMemory;
    ro.put_tier = static_cast<int>(storage::TierKind::kDevice);
    ServiceOptions svo;
    svo.max_put_bytes = 1 << 30;
    ASSERT_NO_FATAL_FAILURE(Open(so, eo, ro, svo));
    ASSERT_EQ(engines_->size(), 2u);
    ASSERT_EQ(engines_->at(0).cuda_device(), 0);
    ASSERT_EQ(engines_->at(1).cuda_device(), 1);
    ASSERT_NE(engines_->at(1).uploader(), nullptr);
  }

  static CompressionPolicy Policy() {
    CompressionPolicy p;
    p.scorer = Scorer::kManifold;
    p.ratio = 0.5;
    p.moments = true;
    return p;
  }
  absl::StatusOr<std::shared_ptr<OpenPut>> Begin(const std::string& key) {
    KVCOMP_ASSIGN_OR_RETURN(
        PutRequest r,
        PutRequest::Make(CacheKey{"alice", "m", key}, kLayout, kTokens, Policy(), false));
    return service_->BeginPut(std::move(r));
  }
  // The whole tensor in blocks of two layers x 128 tokens, then the commit.
  absl::StatusOr<CacheSummary> Finish(OpenPut& put, const Tensor& x) {
    for (uint64_t t0 = 0; t0 < kTokens; t0 += 128) {
      for (uint32_t l = 0; l < kLayout.num_layers; l += 2) {
        KVCOMP_RETURN_IF_ERROR(Add(put, MakeBlock(x, l, l + 2, t0, t0 + 128)));
      }
    }
    return Commit(put);
  }
  absl::StatusOr<CompressedCache> Stored(const std::string& key) {
    KVCOMP_ASSIGN_OR_RETURN(storage::Payload out, Get(CacheKey{"alice", "m", key}));
    return format::ParseCache(out.view());
  }
  // The CPU twin: the same positions up to near-tied scores at the threshold.
  static void ExpectLikeTheCpu(const CompressedCache& gpu, const Tensor& x) {
    auto cpu_backend = MakeCpuBackend(CpuBackendOptions{2});
    ASSERT_TRUE(cpu_backend.ok());
    absl::StatusOr<CompressedCache> cpu = Compress(**cpu_backend, x.View(), Policy());
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_EQ(gpu.kept, cpu->kept);
    ASSERT_EQ(gpu.positions.size(), cpu->positions.size());
    uint64_t same = 0;
    for (size_t i = 0; i < cpu->positions.size(); ++i) same += gpu.positions[i] == cpu->positions[i];
    EXPECT_GE(same, cpu->positions.size() * 99 / 100);
    ASSERT_TRUE(gpu.has_moments);
    EXPECT_EQ(gpu.moment_count, cpu->moment_count);
  }
};

TEST_F(MultiGpuTest, PutsLandOnBothDevicesAndReadBackFromEither) {
#if defined(KVCOMP_HAVE_CUDA)
  // One pool of the GPU tier on each device.
  size_t free_before[2], free_after[2], total = 0;
  for (int d = 0; d < 2; ++d) {
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    ASSERT_EQ(cudaMemGetInfo(&free_before[d], &total), cudaSuccess);
  }
  Start();
  for (int d = 0; d < 2; ++d) {
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    ASSERT_EQ(cudaMemGetInfo(&free_after[d], &total), cudaSuccess);
    EXPECT_GE(free_before[d] - free_after[d], kPoolBytes) << "device " << d;
  }
  EXPECT_EQ(store_->Stats().tier(storage::TierKind::kDevice).capacity, 2 * kPoolBytes);

  // Four puts open at once: two on each device.
  const uint64_t need = Engine::DeviceBytesForPut(kLayout, kTokens, true);
  std::vector<Tensor> xs;
  std::vector<std::shared_ptr<OpenPut>> puts;
  int on_device[2] = {0, 0};
  for (int i = 0; i < 4; ++i) {
    xs.emplace_back(40 + i);
    absl::StatusOr<std::shared_ptr<OpenPut>> put = Begin("k" + std::to_string(i));
    ASSERT_TRUE(put.ok()) << put.status();
    const int d = (*put)->engine().cuda_device();
    ASSERT_TRUE(d == 0 || d == 1) << d;
    ++on_device[d];
    puts.push_back(*put);
  }
  EXPECT_EQ(on_device[0], 2);
  EXPECT_EQ(on_device[1], 2);
  EXPECT_EQ(engines_->at(0).device_reserved_bytes(), 2 * need);
  EXPECT_EQ(engines_->at(1).device_reserved_bytes(), 2 * need);
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<CacheSummary> s = Finish(*puts[i], xs[i]);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->tier, storage::TierKind::kDevice);
    // The blocks went up once to the put's own device; nothing of the cache came down.
    EXPECT_GE(s->h2d_bytes, kLayout.CacheBytes(kTokens));
    EXPECT_LT(s->d2h_bytes, 4096u);
  }
  puts.clear();
  EXPECT_EQ(engines_->at(0).device_reserved_bytes(), 0u);
  EXPECT_EQ(engines_->at(1).device_reserved_bytes(), 0u);
  EXPECT_EQ(store_->Stats().tier(storage::TierKind::kDevice).entries, 4u);

  for (int i = 0; i < 4; ++i) {
    const std::string key = "k" + std::to_string(i);
    SCOPED_TRACE(key);
    absl::StatusOr<storage::Payload> host = Get(CacheKey{"alice", "m", key});
    ASSERT_TRUE(host.ok()) << host.status();
    absl::StatusOr<CompressedCache> cache = format::ParseCache(host->view());
    ASSERT_TRUE(cache.ok()) << cache.status();
    ExpectLikeTheCpu(*cache, xs[i]);
    // Into device memory of each GPU: the same bytes, from the pool that holds them (a copy on
    // that device, or peer to peer to the other).
    for (int d = 0; d < 2; ++d) {
      ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
      void* dst = nullptr;
      ASSERT_EQ(cudaMalloc(&dst, host->size()), cudaSuccess);
      storage::DeviceTarget target;
      target.data = dst;
      target.capacity = host->size();
      target.device = d;
      absl::StatusOr<storage::CacheMeta> meta =
          repository_->GetInto(CacheKey{"alice", "m", key}, target);
      ASSERT_TRUE(meta.ok()) << meta.status();
      std::string back(host->size(), '\0');
      ASSERT_EQ(cudaMemcpy(back.data(), dst, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      cudaFree(dst);
      EXPECT_EQ(back, std::string(host->view())) << "into device " << d;
    }
  }
#endif
}

TEST_F(MultiGpuTest, TheGpuMemoryCapIsPerDevice) {
  const uint64_t need = Engine::DeviceBytesForPut(kLayout, kTokens, true);
  Start(/*gpu_cap=*/need + need / 2);
  absl::StatusOr<std::shared_ptr<OpenPut>> a = Begin("a");
  absl::StatusOr<std::shared_ptr<OpenPut>> b = Begin("b");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE((*a)->engine().cuda_device(), (*b)->engine().cuda_device());
  // Neither device has room for a third put.
  absl::StatusOr<std::shared_ptr<OpenPut>> c = Begin("c");
  EXPECT_TRUE(absl::IsResourceExhausted(c.status())) << c.status();
  EXPECT_EQ(engines_->at(0).device_reserved_bytes(), need);
  EXPECT_EQ(engines_->at(1).device_reserved_bytes(), need);
  // Once a's device has room again, the third put goes there.
  const int freed = (*a)->engine().cuda_device();
  (*a)->Abort();
  a->reset();
  c = Begin("c");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->engine().cuda_device(), freed);
  Tensor x(50);
  absl::StatusOr<CacheSummary> s = Finish(**c, x);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<CompressedCache> got = Stored("c");
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectLikeTheCpu(*got, x);
}

// Without a cap, a GPU whose free memory (as the driver reports it, another process's or
// another library's allocations counted) cannot hold a put is passed over, and taken again once
// the memory is back.
TEST_F(MultiGpuTest, AGpuWithoutFreeMemoryIsPassedOver) {
#if defined(KVCOMP_HAVE_CUDA)
  Start();
  const uint64_t need = Engine::DeviceBytesForPut(kLayout, kTokens, true);
  // Device 1 filled to less than one put's worth of free memory.
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  size_t free1 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  void* filler = nullptr;
  const size_t take = free1 > need / 2 ? free1 - need / 2 : 0;
  ASSERT_EQ(cudaMalloc(&filler, take), cudaSuccess);
  std::vector<std::shared_ptr<OpenPut>> puts;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::shared_ptr<OpenPut>> put = Begin("full" + std::to_string(i));
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ((*put)->engine().cuda_device(), 0) << "put " << i;
    puts.push_back(*put);
  }
  Tensor x(70);
  ASSERT_TRUE(Finish(*puts[0], x).ok());
  // With device 1's memory back, puts are spread again.
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaFree(filler), cudaSuccess);
  absl::StatusOr<std::shared_ptr<OpenPut>> next = Begin("after");
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ((*next)->engine().cuda_device(), 1);  // the engine with the most room left
  ASSERT_TRUE(Finish(**next, x).ok());
  absl::StatusOr<CompressedCache> got = Stored("after");
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectLikeTheCpu(*got, x);
  puts[1]->Abort();
  puts[2]->Abort();
#endif
}

TEST_F(MultiGpuTest, AStickyErrorOfOneEngineLeavesTheOtherTakingPuts) {
  Start();
  Tensor x(60);
  engines_->at(1).InjectStickyFaultForTest();
  // Equal engines take puts in turn: one of two puts lands on device 1 and fails there.
  int failed = 0;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::shared_ptr<OpenPut>> put = Begin("first" + std::to_string(i));
    ASSERT_TRUE(put.ok()) << put.status();
    const int d = (*put)->engine().cuda_device();
    absl::StatusOr<CacheSummary> s = Finish(**put, x);
    if (d == 1) {
      EXPECT_FALSE(s.ok());
      ++failed;
    } else {
      EXPECT_TRUE(s.ok()) << s.status();
    }
  }
  EXPECT_EQ(failed, 1);
  EXPECT_TRUE(engines_->at(1).failed());
  EXPECT_TRUE(engines_->failed());  // the daemon reports not ready, drains and exits
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::shared_ptr<OpenPut>> put = Begin("after" + std::to_string(i));
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ((*put)->engine().cuda_device(), 0);
    ASSERT_TRUE(Finish(**put, x).ok());
  }
  absl::StatusOr<CompressedCache> got = Stored("after2");
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectLikeTheCpu(*got, x);
}

}  // namespace
}  // namespace service
}  // namespace kvcomp
