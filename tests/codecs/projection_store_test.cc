#include "kvcomp/codecs/projection_store.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "kvcomp/storage/tiered_store.h"
#include "storage/storage_test_util.h"

namespace kvcomp {
namespace codecs {
namespace {

using storage::testing::EncodedCache;
using storage::testing::TempDir;

std::unique_ptr<storage::TieredStore> OpenStore(const std::string& path) {
  storage::StoreOptions o;
  o.host.capacity_bytes = 1 << 20;
  o.rocksdb.enabled = true;
  o.rocksdb.path = path;
  o.rocksdb.capacity_bytes = 1ull << 30;
  auto s = storage::TieredStore::Open(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// A sealed one-layer, one-head projection whose basis is the unit vector e_`axis`.
Projection UnitProjection(const std::string& model, uint32_t axis) {
  Projection p;
  p.model_id = model;
  p.num_layers = 1;
  p.num_kv_heads = 1;
  p.head_dim = 64;
  p.rows = 1;
  p.basis.assign(64, 0.0f);
  p.basis[axis] = 1.0f;
  p.eigenvalues.assign(64, 0.0f);
  p.eigenvalues[0] = 1.0f;
  p.gamma = {1.0f};
  EXPECT_TRUE(p.Seal().ok());
  return p;
}

TEST(ProjectionKey, EncodesInModelLayerHeadVersionOrderAndRoundTrips) {
  const ProjectionKey a{"llama", 0, 7, 9}, b{"llama", 3, 1, 1}, c{"llama", 3, 1, 2};
  EXPECT_LT(EncodeProjectionKey(a), EncodeProjectionKey(b));
  EXPECT_LT(EncodeProjectionKey(b), EncodeProjectionKey(c));
  EXPECT_EQ(*DecodeProjectionKey(EncodeProjectionKey(c)), c);
  EXPECT_EQ(EncodeProjectionKey(c).rfind(ProjectionKeyPrefix("llama"), 0), 0u);
  EXPECT_NE(EncodeProjectionKey({"llama-8b", 0, 0, 1}).rfind(ProjectionKeyPrefix("llama"), 0), 0u);
  EXPECT_TRUE(absl::IsDataLoss(DecodeProjectionKey("x").status()));
  EXPECT_TRUE(absl::IsDataLoss(DecodeProjectionKey(EncodeProjectionKey(c) + "z").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateProjectionKey({"llama", 0, 0, 0})));
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateProjectionKey({"", 0, 0, 1})));
  EXPECT_TRUE(ProjectionModel("t", std::string(200, 'm')).status().code() ==
              absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ProjectionModel("t", "llama"), "t/llama");
}

TEST(TieredProjectionStore, KeepsVersionsDurablyAndLatestIsTheLastCalibration) {
  TempDir dir;
  const Projection p1 = UnitProjection("t/llama", 0), p2 = UnitProjection("t/llama", 1);
  {
    auto store = OpenStore(dir.path());
    TieredProjectionStore projections(store.get());
    EXPECT_TRUE(absl::IsFailedPrecondition(projections.Latest("t/llama").status()));
    ASSERT_TRUE(projections.Put(p1).ok());
    ASSERT_TRUE(projections.Put(p2).ok());
    ASSERT_TRUE(projections.Put(p1).ok());  // the same version again: no new entry
    ASSERT_TRUE(projections.Put(UnitProjection("t/llama-8b", 2)).ok());
    EXPECT_EQ(*projections.Count(), 3u);
  }
  auto store = OpenStore(dir.path());  // reopened: nothing cached in memory
  TieredProjectionStore projections(store.get());
  EXPECT_EQ(*projections.Latest("t/llama"), p2.version);
  auto got = projections.Get("t/llama", p1.version);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->basis, p1.basis);
  EXPECT_TRUE(absl::IsNotFound(projections.Get("t/llama", 12345).status()));
  // The store holds the engine's bytes under the encoded key.
  const auto raw = store->ListCalibration(ProjectionKeyPrefix("t/llama"));
  ASSERT_TRUE(raw.ok());
  ASSERT_EQ(raw->size(), 2u);
  EXPECT_EQ(*store->GetCalibration((*raw)[0]), p1.Serialize());
}

TEST(TieredProjectionStore, AVersionStaysWhileACacheOrAPutNamesIt) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  TieredProjectionStore projections(store.get());
  const Projection p1 = UnitProjection("t/llama", 0), p2 = UnitProjection("t/llama", 1);
  ASSERT_TRUE(projections.Put(p1).ok());
  CacheKey key;
  key.tenant = "t";
  key.model_id = "llama";
  key.key = "a";
  storage::CacheMeta meta;
  meta.projection_version = p1.version;
  ASSERT_TRUE(store->Put(key, EncodedCache(3), meta, {}).ok());
  ASSERT_TRUE(projections.Put(p2).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(projections.Delete("t/llama", p1.version)));
  EXPECT_EQ(*projections.Collect("t/llama"), 0u);  // a stored cache names p1; p2 is the latest
  ASSERT_TRUE(store->Delete(key).ok());
  {
    auto pinned = projections.AcquireLatest("t/llama");
    ASSERT_TRUE(pinned.ok());
    EXPECT_EQ((*pinned)->version, p2.version);
  }
  EXPECT_EQ(*projections.Collect("t/llama"), 1u);  // p1: not the latest, named by nothing
  EXPECT_TRUE(absl::IsNotFound(projections.Get("t/llama", p1.version).status()));
  EXPECT_EQ(*projections.Collect("t/llama"), 0u);  // the latest stays
  ASSERT_TRUE(projections.Delete("t/llama", p2.version).ok());
  EXPECT_EQ(*projections.Count(), 0u);
}

TEST(TieredProjectionStore, WithoutTheDiskTierNothingIsStored) {
  storage::StoreOptions o;
  o.host.capacity_bytes = 1 << 20;
  auto store = storage::TieredStore::Open(o);
  ASSERT_TRUE(store.ok());
  TieredProjectionStore projections(store->get());
  EXPECT_TRUE(absl::IsFailedPrecondition(projections.Put(UnitProjection("t/m", 0))));
  EXPECT_EQ(*projections.Collect(), 0u);
  EXPECT_EQ(*projections.Count(), 0u);
}

}  // namespace
}  // namespace codecs
}  // namespace kvcomp
