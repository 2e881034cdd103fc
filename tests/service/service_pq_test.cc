// The calibrated basis codec (pq) in kvcompd's service layers, in-process: a tenant's pq
// calibration fitted from its stored raw caches (the Calibrate call's work), a put of pq k3v2
// (the `codec` preset's codecs) that pins it, gets of the stored and the decoded
// representation, and the refusals: no calibration, another tenant's calibration, bad bits.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "cache_repository.h"
#include "cache_service.h"
#include "gtest/gtest.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvsplice_glue.h"
#include "put.h"
#include "service_context.h"
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

// Every token, keys at 3 bits and values at 2 bits per element: the `codec` preset's codecs.
CompressionPolicy K3V2() {
  CompressionPolicy p;
  p.ratio = 0.0;
  p.moments = false;
  p.key_codec = KeyCodec::kPq;
  p.value_codec = ValueCodec::kPq;
  p.key_bits = 3;
  p.value_bits = 2;
  return p;
}

CompressionPolicy Raw() {
  CompressionPolicy p;
  p.ratio = 0.0;
  return p;
}

class PqServiceTest : public testutil::ServiceFixture {
 protected:
  void SetUp() override {
    storage::StoreOptions so;
    so.host.enabled = true;
    so.host.capacity_bytes = 64 << 20;
    so.rocksdb.enabled = true;
    so.rocksdb.capacity_bytes = 256 << 20;
    so.rocksdb.reserve_bytes = 1;
    EngineOptions eo;
    eo.backend = "cpu";
    eo.workers = 1;
    eo.cpu_threads = 1;
    eo.queue_capacity = 4;
    RepositoryOptions ro;
    ro.durability = storage::Durability::kDisk;
    ServiceOptions svo;
    svo.max_put_bytes = 1 << 20;
    svo.serve_threads = 2;
    Open(so, eo, ro, svo);
  }

  absl::StatusOr<CacheSummary> Put(const std::string& tenant, const std::string& key,
                                   const Tensor& x, const CompressionPolicy& policy) {
    KVCOMP_ASSIGN_OR_RETURN(PutRequest r, PutRequest::Make(CacheKey{tenant, "m", key}, kLayout,
                                                           kTokens, policy, false));
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<OpenPut> put, service_->BeginPut(std::move(r)));
    KVCOMP_RETURN_IF_ERROR(Add(*put, MakeBlock(x, 0, 2, 0, kTokens)));
    return Commit(*put);
  }
  absl::StatusOr<CalibrationResult> CalibratePq(const std::string& tenant, uint32_t key_bits = 3,
                                                uint32_t value_bits = 2) {
    CalibrationRequest cr;
    cr.tenant = tenant;
    cr.model_id = "m";
    cr.value_codec = "pq";
    cr.key_bits = key_bits;
    cr.value_bits = value_bits;
    return CalibrateFromStore(store_.get(), projections_.get(), cr);
  }
};

TEST_F(PqServiceTest, CalibrateThenPutK3V2AndGetItStoredAndDecoded) {
  const CompressionPolicy codec = K3V2();
  Tensor x(21);
  // Before any calibration the put is refused, naming the call.
  auto early = Put("alice", "early", x, codec);
  ASSERT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(early.status().message(), "Calibrate")) << early.status();
  auto empty = CalibratePq("alice");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kFailedPrecondition) << empty.status();

  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(Put("alice", "raw" + std::to_string(i), Tensor(30 + i), Raw()).ok());
  auto cal = CalibratePq("alice");
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_EQ(cal->caches_used, 4u);
  EXPECT_NE(cal->projection_version, 0u);
  EXPECT_EQ(CalibratePq("alice", 0, 2).status().code(), absl::StatusCode::kInvalidArgument);

  auto put = Put("alice", "pq", x, codec);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_TRUE(service_->WaitIdle(absl::Seconds(10)));
  const CacheKey key{"alice", "m", "pq"};
  auto stored = Get(key);
  ASSERT_TRUE(stored.ok()) << stored.status();
  auto cache = format::ParseCache(stored->view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->key_codec, KeyCodec::kPq);
  EXPECT_EQ(cache->value_codec, ValueCodec::kPq);
  EXPECT_EQ(cache->projection_version, cal->projection_version);
  EXPECT_EQ(cache->KeyTokenBytes(), 24u);  // 3 bits x 64
  EXPECT_EQ(cache->ValueTokenBytes(), 16u);
  // k3v2 of f32 rows: 12.8x fewer bytes per kept row than the input (6.4x of bf16).
  EXPECT_GT(static_cast<double>(put->original_bytes) / put->stored_bytes, 6.0);

  // The decoded get: raw codecs, the values the calibration decodes the stored cache to.
  auto decoded = Get(key, Representation::kDecoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  auto raw = format::ParseCache(decoded->view());
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->key_codec, KeyCodec::kRaw);
  EXPECT_EQ(raw->value_codec, ValueCodec::kRaw);
  std::string model = "alice/m";
  auto calibration = projections_->GetPq(model, cal->projection_version);
  ASSERT_TRUE(calibration.ok()) << calibration.status();
  auto backend = MakeCpuBackend(CpuBackendOptions{1});
  ASSERT_TRUE(backend.ok());
  auto want = DecodeToRawCodecs(**backend, *cache, nullptr, calibration->get());
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(want->keys, raw->keys);
  EXPECT_EQ(want->values, raw->values);

  // Another calibration at the same bits becomes the latest; the stored cache keeps its own
  // (named by it, so not collected) and still decodes.
  ASSERT_TRUE(Put("alice", "raw9", Tensor(50), Raw()).ok());
  auto again = CalibratePq("alice");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->projection_version, cal->projection_version);
  EXPECT_EQ(*projections_->Collect("alice/m"), 0u);
  EXPECT_TRUE(Get(key, Representation::kDecoded).ok());
  // Once the cache is gone its calibration goes with it (the delete collects its model's
  // versions that nothing names).
  absl::Notification done;
  service_->Delete(key, [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_EQ(*projections_->CountPq(), 1u);
  EXPECT_TRUE(absl::IsNotFound(projections_->GetPq(model, cal->projection_version).status()));
}

TEST_F(PqServiceTest, ATenantNeverSeesAnothersCalibration) {
  for (int i = 0; i < 2; ++i)
    ASSERT_TRUE(Put("alice", "raw" + std::to_string(i), Tensor(40 + i), Raw()).ok());
  ASSERT_TRUE(CalibratePq("alice").ok());
  // Bob has no raw caches of "m": nothing to calibrate on (alice's caches are not his).
  EXPECT_EQ(CalibratePq("bob").status().code(), absl::StatusCode::kFailedPrecondition);
  // Bob's pq put finds no calibration of his own.
  auto put = Put("bob", "pq", Tensor(3), K3V2());
  ASSERT_EQ(put.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(put.status().message(), "Calibrate")) << put.status();
  // Calibrated at k3v2, a put at k4v2 is refused the same way.
  CompressionPolicy k4 = K3V2();
  k4.key_bits = 4;
  auto other = Put("alice", "k4", Tensor(4), k4);
  ASSERT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(other.status().message(), "k3v2")) << other.status();
  // Alice's pq cache read as bob: missing.
  ASSERT_TRUE(Put("alice", "pq", Tensor(5), K3V2()).ok());
  EXPECT_EQ(Get(CacheKey{"bob", "m", "pq"}, Representation::kDecoded).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace service
}  // namespace kvcomp
