// Several engines in one daemon, in-process, with CPU engines standing in for GPUs: EngineSet's
// placement on its own (the most free reservation headroom, then the shortest queue, then the
// next engine in turn; failed engines skipped; reservations held and given back by the engine
// that took them), then a CacheService over three engines and a real store (puts spread while
// open at once, each on its own engine's workers, read back equal to an in-process
// compression; a failed engine skipped), and the engine.cuda_devices option.
#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "cache_service.h"
#include "engine.h"
#include "engine_set.h"
#include "gtest/gtest.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/service/config.h"
#include "put.h"
#include "service_test_util.h"

namespace kvcomp {
namespace service {
namespace {

const KvLayout kLayout{2, 2, 4, 64, DType::kF32};
constexpr uint64_t kTokens = 48;

using testutil::MakeBlock;

struct Tensor : testutil::KvTensor {
  explicit Tensor(uint64_t seed) : KvTensor(kLayout, kTokens, seed) {}
};

EngineOptions CpuEngine() {
  EngineOptions eo;
  eo.backend = "cpu";
  eo.workers = 1;
  eo.cpu_threads = 1;
  eo.queue_capacity = 8;
  return eo;
}

std::unique_ptr<EngineSet> CpuSet(int n) {
  std::vector<std::unique_ptr<Engine>> engines;
  for (int i = 0; i < n; ++i) {
    auto e = Engine::Create(CpuEngine());
    EXPECT_TRUE(e.ok()) << e.status();
    engines.push_back(*std::move(e));
  }
  return std::make_unique<EngineSet>(std::move(engines));
}

size_t IndexOf(const EngineSet& set, const Engine* e) {
  for (size_t i = 0; i < set.size(); ++i) {
    if (&set.at(i) == e) return i;
  }
  return set.size();
}

// Marks `e` failed as a sticky device error does (the test hook; no real one can be made).
void Fail(Engine& e) {
  auto backend = MakeCpuBackend(CpuBackendOptions{1});
  ASSERT_TRUE(backend.ok());
  e.InjectStickyFaultForTest();
  ASSERT_TRUE(e.CheckAfterError(**backend, absl::InternalError("device lost")));
}

// ---- placement on its own ----

TEST(EngineSetTest, APutGoesToTheEngineWithTheLeastReservedAndGivesItBackThere) {
  std::unique_ptr<EngineSet> set = CpuSet(3);
  // Other puts hold 300, 100 and 200 bytes.
  auto a = set->at(0).ReserveDevice(300);
  auto b = set->at(1).ReserveDevice(100);
  auto c = set->at(2).ReserveDevice(200);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  absl::StatusOr<EngineSet::Placement> p = set->Place(1000);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(IndexOf(*set, p->engine), 1u);
  EXPECT_EQ(set->at(0).device_reserved_bytes(), 300u);
  EXPECT_EQ(set->at(1).device_reserved_bytes(), 1100u);
  EXPECT_EQ(set->at(2).device_reserved_bytes(), 200u);
  // Now engine 2 holds the least.
  absl::StatusOr<EngineSet::Placement> q = set->Place(10);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(IndexOf(*set, q->engine), 2u);
  EXPECT_EQ(set->at(2).device_reserved_bytes(), 210u);
  // Each reservation goes back to the engine that took it, and only there.
  p->reservation = Engine::DeviceReservation();
  EXPECT_EQ(set->at(1).device_reserved_bytes(), 100u);
  EXPECT_EQ(set->at(2).device_reserved_bytes(), 210u);
  *q = EngineSet::Placement();
  EXPECT_EQ(set->at(2).device_reserved_bytes(), 200u);
  EXPECT_EQ(set->at(0).device_reserved_bytes(), 300u);
}

TEST(EngineSetTest, TiesGoToTheShortestQueueThenToEachEngineInTurn) {
  std::unique_ptr<EngineSet> set = CpuSet(3);
  // Equal reservations, one at a time: every engine in turn.
  std::vector<size_t> order;
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<EngineSet::Placement> p = set->Place(64);
    ASSERT_TRUE(p.ok()) << p.status();
    order.push_back(IndexOf(*set, p->engine));
  }
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 0, 1, 2}));

  // Engine 0's only worker is busy and one more task waits behind it: engine 0 is never
  // chosen while the others are equally free.
  absl::Notification release;
  std::atomic<int> ran{0};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(set->at(0).TrySubmit("t", [&](Backend&) {
      release.WaitForNotification();
      ran.fetch_add(1);
    }));
  }
  EXPECT_EQ(set->at(0).queue_depth(), 2u);
  EXPECT_EQ(set->queue_depth(), 2u);
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<EngineSet::Placement> p = set->Place(64);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_NE(IndexOf(*set, p->engine), 0u);
  }
  // Reservations come before queues: engine 0 with the least reserved wins despite its queue.
  auto held1 = set->at(1).ReserveDevice(1);
  auto held2 = set->at(2).ReserveDevice(1);
  ASSERT_TRUE(held1.ok() && held2.ok());
  absl::StatusOr<EngineSet::Placement> p = set->Place(64);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(IndexOf(*set, p->engine), 0u);
  release.Notify();
  ASSERT_TRUE(set->WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(ran.load(), 2);
}

TEST(EngineSetTest, FailedEnginesAreSkippedAndTheSetReportsThem) {
  std::unique_ptr<EngineSet> set = CpuSet(3);
  EXPECT_FALSE(set->failed());
  ASSERT_NO_FATAL_FAILURE(Fail(set->at(1)));
  EXPECT_TRUE(set->failed());
  EXPECT_NE(set->failure().find("device lost"), std::string::npos) << set->failure();
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<EngineSet::Placement> p = set->Place(64);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_NE(IndexOf(*set, p->engine), 1u);
    EXPECT_NE(set->Pick(), &set->at(1));
  }
  ASSERT_NO_FATAL_FAILURE(Fail(set->at(0)));
  ASSERT_NO_FATAL_FAILURE(Fail(set->at(2)));
  absl::StatusOr<EngineSet::Placement> none = set->Place(64);
  EXPECT_TRUE(absl::IsUnavailable(none.status())) << none.status();
  EXPECT_NE(none.status().message().find("engine failed"), std::string::npos) << none.status();
  EXPECT_EQ(set->Pick(), nullptr);
}

TEST(EngineSetTest, APutForADeviceNoEngineRunsOnIsRefused) {
  std::unique_ptr<EngineSet> set = CpuSet(2);
  EXPECT_EQ(set->OnDevice(0), nullptr);
  absl::StatusOr<EngineSet::Placement> p = set->Place(64, /*device=*/0);
  EXPECT_TRUE(absl::IsFailedPrecondition(p.status())) << p.status();
  // The CPU engines have no cap on what they hold; their reservations are counted for placement.
  EXPECT_EQ(set->at(0).device_cap_bytes(), 0u);
  EXPECT_EQ(set->at(0).cuda_device(), -1);
  EXPECT_FALSE(set->uses_gpu());
}

// ---- the service over three engines ----

class MultiEngineServiceTest : public testutil::ServiceFixture {
 protected:
  void SetUp() override {
    storage::StoreOptions so;
    so.host.enabled = true;
    so.host.capacity_bytes = 64 << 20;
    so.rocksdb.enabled = true;
    so.rocksdb.capacity_bytes = 256 << 20;
    so.rocksdb.reserve_bytes = 1;
    RepositoryOptions ro;
    ro.durability = storage::Durability::kMemory;
    ServiceOptions svo;
    svo.max_put_bytes = 1 << 20;
    svo.serve_threads = 2;
    ASSERT_NO_FATAL_FAILURE(Open(so, CpuEngine(), ro, svo, /*engines=*/3));
  }

  static CompressionPolicy Policy() {
    CompressionPolicy p;
    p.scorer = Scorer::kManifold;
    p.ratio = 0.5;
    p.moments = true;
    return p;
  }
  static PutRequest Request(const std::string& key, bool block_wise = false) {
    CompressionPolicy p = Policy();
    if (block_wise) p.block_size = 16;
    absl::StatusOr<PutRequest> r =
        PutRequest::Make(CacheKey{"alice", "m", key}, kLayout, kTokens, p, block_wise);
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  }
  absl::Status AddAll(OpenPut& put, const Tensor& x) {
    KVCOMP_RETURN_IF_ERROR(Add(put, MakeBlock(x, 0, 2, 16, kTokens)));
    return Add(put, MakeBlock(x, 0, 2, 0, 16));
  }
  absl::StatusOr<CompressedCache> Stored(const std::string& key) {
    KVCOMP_ASSIGN_OR_RETURN(storage::Payload out, Get(CacheKey{"alice", "m", key}));
    return format::ParseCache(out.view());
  }
  // `x` compressed in process by the same policy, as every engine must store it.
  static CompressedCache Expected(const Tensor& x) {
    auto backend = MakeCpuBackend(CpuBackendOptions{1});
    EXPECT_TRUE(backend.ok());
    absl::StatusOr<CompressedCache> c =
        Compress(**backend, x.View(), Request("expected").policy.get());
    EXPECT_TRUE(c.ok()) << c.status();
    return *std::move(c);
  }
  static void ExpectSame(const CompressedCache& got, const CompressedCache& want) {
    EXPECT_EQ(got.original_tokens, want.original_tokens);
    EXPECT_EQ(got.kept, want.kept);
    EXPECT_EQ(got.positions, want.positions);
    EXPECT_EQ(got.keys, want.keys);
    EXPECT_EQ(got.values, want.values);
    EXPECT_EQ(got.moment_count, want.moment_count);
    EXPECT_EQ(got.moment_key_sum, want.moment_key_sum);
  }
};

TEST_F(MultiEngineServiceTest, OpenPutsSpreadOverTheEnginesAndReadBackAsCompressed) {
  const uint64_t need = Engine::DeviceBytesForPut(kLayout, kTokens, /*moments=*/true);
  std::vector<Tensor> xs;
  std::vector<std::shared_ptr<OpenPut>> puts;
  for (int i = 0; i < 4; ++i) {
    xs.emplace_back(100 + i);
    absl::StatusOr<std::shared_ptr<OpenPut>> put =
        service_->BeginPut(Request("k" + std::to_string(i)));
    ASSERT_TRUE(put.ok()) << put.status();
    puts.push_back(*put);
  }
  // Open at once: each put holds its bytes where it was placed, so the first three take one
  // engine each and the fourth the next in turn.
  std::vector<size_t> where;
  for (const auto& put : puts) where.push_back(IndexOf(*engines_, &put->engine()));
  EXPECT_EQ(where, (std::vector<size_t>{0, 1, 2, 0}));
  EXPECT_EQ(engines_->at(0).device_reserved_bytes(), 2 * need);
  EXPECT_EQ(engines_->at(1).device_reserved_bytes(), need);
  EXPECT_EQ(engines_->at(2).device_reserved_bytes(), need);

  // Committed in another order; each on its own engine, each given back there.
  for (int i : {2, 0, 3, 1}) {
    ASSERT_TRUE(AddAll(*puts[i], xs[i]).ok());
    const size_t e = where[i];
    const uint64_t before = engines_->at(e).device_reserved_bytes();
    absl::StatusOr<CacheSummary> s = Commit(*puts[i]);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->original_tokens, kTokens);
    EXPECT_EQ(engines_->at(e).device_reserved_bytes(), before - need) << "engine " << e;
  }
  for (size_t e = 0; e < engines_->size(); ++e) {
    EXPECT_EQ(engines_->at(e).device_reserved_bytes(), 0u) << e;
  }
  puts.clear();
  EXPECT_TRUE(service_->WaitIdle(absl::Seconds(10)));
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<CompressedCache> got = Stored("k" + std::to_string(i));
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSame(*got, Expected(xs[i]));
  }
}

TEST_F(MultiEngineServiceTest, PutsOneAtATimeTakeEachEngineInTurn) {
  std::vector<size_t> where;
  for (int i = 0; i < 6; ++i) {
    Tensor x(200 + i);
    absl::StatusOr<std::shared_ptr<OpenPut>> put =
        service_->BeginPut(Request("k" + std::to_string(i)));
    ASSERT_TRUE(put.ok()) << put.status();
    where.push_back(IndexOf(*engines_, &(*put)->engine()));
    ASSERT_TRUE(AddAll(**put, x).ok());
    ASSERT_TRUE(Commit(**put).ok());
    absl::StatusOr<CompressedCache> got = Stored("k" + std::to_string(i));
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSame(*got, Expected(x));
  }
  EXPECT_EQ(where, (std::vector<size_t>{0, 1, 2, 0, 1, 2}));
}

TEST_F(MultiEngineServiceTest, AnAbortedPutGivesItsReservationBackToItsEngine) {
  const uint64_t need = Engine::DeviceBytesForPut(kLayout, kTokens, true);
  auto first = service_->BeginPut(Request("a"));
  auto second = service_->BeginPut(Request("b"));
  ASSERT_TRUE(first.ok() && second.ok());
  const size_t e1 = IndexOf(*engines_, &(*first)->engine());
  const size_t e2 = IndexOf(*engines_, &(*second)->engine());
  ASSERT_NE(e1, e2);
  (*second)->Abort();
  EXPECT_EQ(engines_->at(e2).device_reserved_bytes(), 0u);
  EXPECT_EQ(engines_->at(e1).device_reserved_bytes(), need);
  (*first)->Abort();
  EXPECT_EQ(engines_->at(e1).device_reserved_bytes(), 0u);
}

TEST_F(MultiEngineServiceTest, BlockWisePutsRunOnTheirEngine) {
  std::vector<size_t> where;
  for (int i = 0; i < 3; ++i) {
    Tensor x(300 + i);
    auto put = service_->BeginPut(Request("bw" + std::to_string(i), /*block_wise=*/true));
    ASSERT_TRUE(put.ok()) << put.status();
    where.push_back(IndexOf(*engines_, &(*put)->engine()));
    // A block-wise put holds nothing on its engine: its working set is host memory.
    EXPECT_EQ((*put)->engine().device_reserved_bytes(), 0u);
    ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 0, 16)).ok());
    ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 16, 32)).ok());
    ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 32, kTokens)).ok());
    absl::StatusOr<CacheSummary> s = Commit(**put);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->total_kept, kTokens / 2 * kLayout.num_layers * kLayout.num_kv_heads);
  }
  EXPECT_EQ(where, (std::vector<size_t>{0, 1, 2}));
}

// A sticky failure of one engine fails the put on it; later puts skip that engine and succeed;
// the set reports the failure (the daemon then drains and exits); stored caches are served.
TEST_F(MultiEngineServiceTest, AFailedEngineIsSkippedAndTheSetIsFailed) {
  Tensor x(400);
  ASSERT_TRUE(engines_->Place(0).ok());  // the next put goes to engine 1
  engines_->at(1).InjectStickyFaultForTest();
  auto doomed = service_->BeginPut(Request("doomed"));
  ASSERT_TRUE(doomed.ok()) << doomed.status();
  ASSERT_EQ(&(*doomed)->engine(), &engines_->at(1));
  ASSERT_TRUE(AddAll(**doomed, x).ok());
  absl::StatusOr<CacheSummary> s = Commit(**doomed);
  EXPECT_TRUE(absl::IsInternal(s.status())) << s.status();
  EXPECT_TRUE(engines_->at(1).failed());
  EXPECT_TRUE(engines_->failed());
  EXPECT_EQ(engines_->at(1).device_reserved_bytes(), 0u);
  EXPECT_TRUE(absl::IsNotFound(Stored("doomed").status()));
  for (int i = 0; i < 4; ++i) {
    const std::string key = "after" + std::to_string(i);
    auto put = service_->BeginPut(Request(key));
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_NE(&(*put)->engine(), &engines_->at(1));
    ASSERT_TRUE(AddAll(**put, x).ok());
    ASSERT_TRUE(Commit(**put).ok());
    absl::StatusOr<CompressedCache> got = Stored(key);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSame(*got, Expected(x));
  }
}

// ---- the option ----

TEST(EngineCudaDevicesTest, AListOfDistinctOrdinalsOrOneDevice) {
  EngineOptions eo;
  eo.cuda_device = 3;
  absl::StatusOr<std::vector<int>> d = EngineCudaDevices(eo);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, std::vector<int>{3});
  Options o;
  ASSERT_TRUE(SetOption(o, "engine.cuda_devices", " 1, 0 ,2").ok());
  EXPECT_EQ(o.engine.cuda_devices, "1,0,2");
  d = EngineCudaDevices(o.engine);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, (std::vector<int>{1, 0, 2}));
  for (const char* bad : {"0,0", "a", "0,,1", "-1", "65", "0;1"}) {
    absl::Status s = SetOption(o, "engine.cuda_devices", bad);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad << ": " << s;
    EXPECT_NE(s.message().find("engine.cuda_devices"), std::string::npos) << s;
  }
  EXPECT_EQ(o.engine.cuda_devices, "1,0,2");  // a refused value leaves the option as it was
  // A GPU list with the CPU backend is a contradiction; with auto or cuda it is used.
  o.engine.backend = "cpu";
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateOptions(o)));
  o.engine.backend = "auto";
  EXPECT_TRUE(ValidateOptions(o).ok());
  // Printed and read back as the same list.
  Options back;
  ASSERT_TRUE(ApplyYaml(back, OptionsToYaml(o)).ok());
  EXPECT_EQ(back.engine.cuda_devices, "1,0,2");
  ASSERT_TRUE(SetOption(o, "engine.cuda_devices", "").ok());
  EXPECT_EQ(o.engine.cuda_devices, "");
  ASSERT_TRUE(ApplyYaml(back, OptionsToYaml(o)).ok());
  EXPECT_EQ(back.engine.cuda_devices, "");
}

// Without a GPU, backend auto makes one CPU engine whatever the list says.
TEST(EngineSetTest, CreateMakesOneCpuEngineWithoutAGpu) {
  if (CudaAvailable()) GTEST_SKIP() << "a GPU is present";
  EngineOptions eo = CpuEngine();
  eo.backend = "auto";
  eo.cuda_devices = "0,1";
  absl::StatusOr<std::unique_ptr<EngineSet>> set = EngineSet::Create(eo);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*set)->size(), 1u);
  EXPECT_FALSE((*set)->uses_gpu());
  eo.backend = "cuda";
  EXPECT_TRUE(absl::IsFailedPrecondition(EngineSet::Create(eo).status()));
}

}  // namespace
}  // namespace service
}  // namespace kvcomp
