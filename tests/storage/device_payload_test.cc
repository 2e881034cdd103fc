// Payloads in device memory (gpu label): the device tier takes one with one copy on the device
// and nothing through the host; a put that lands anywhere else (its tier, a spill, the RocksDB
// copy of a disk-durable put) copies it to the host exactly once and checks it against the CRC
// it carries; GetInto serves a cache into device memory (device to device from the GPU tier).
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/format.h"
#include "kvcomp/storage/tiered_store.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

KVCOMP_GPU_TEST_BINARY();

#if defined(KVCOMP_HAVE_CUDA)

// `bytes` (an encoded cache) copied into fresh device memory, as a device encoder leaves it.
Payload OnDevice(const std::string& bytes, uint32_t crc_flip = 0) {
  void* dev = nullptr;
  EXPECT_EQ(cudaMalloc(&dev, bytes.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dev, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  DeviceBytes d;
  d.data = std::shared_ptr<const void>(dev, [](const void* p) { cudaFree(const_cast<void*>(p)); });
  d.size = bytes.size();
  d.device = 0;
  d.crc32c = Crc32c(bytes.data(), bytes.size()) ^ crc_flip;
  auto info = format::PeekCache(bytes);
  EXPECT_TRUE(info.ok());
  uint32_t sections;
  std::memcpy(&sections, bytes.data() + 52, 4);
  d.header = bytes.substr(0, format::kHeaderBytes + format::kSectionEntryBytes * sections);
  return Payload::OnDevice(std::move(d));
}

// Device memory to read into, and its bytes back on the host.
struct DeviceBuffer {
  explicit DeviceBuffer(uint64_t n) : size(n) { EXPECT_EQ(cudaMalloc(&data, n), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(data); }
  std::string Read(uint64_t n) const {
    std::string out(n, '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), data, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  DeviceTarget Target() const { return DeviceTarget{data, size, 0, nullptr}; }
  void* data = nullptr;
  uint64_t size;
};

class DevicePayloadTest : public ::testing::Test {
 protected:
  void Open(uint64_t device_capacity, bool rocks = true) {
    StoreOptions o;
    o.device.enabled = true;
    o.device.capacity_bytes = device_capacity;
    o.host.capacity_bytes = 64 << 20;
    o.rocksdb.enabled = rocks;
    o.rocksdb.path = dir_.Sub("db");
    o.rocksdb.reserve_bytes = 1;
    o.default_tier = TierKind::kDevice;
    o.open_without_failed_tiers = false;
    store_.reset();
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  absl::Status Put(const std::string& key, Payload p, DeviceCopies* copies,
                   TierKind tier = TierKind::kDevice, Durability d = Durability::kMemory) {
    PutOptions po;
    po.tier = static_cast<int>(tier);
    po.durability = d;
    po.copies = copies;
    return store_->Put(CacheKey{"t", "m", key}, std::move(p), CacheMeta{}, po);
  }

  testing::TempDir dir_;
  std::unique_ptr<TieredStore> store_;
};

TEST_F(DevicePayloadTest, TheDeviceTierTakesItWithOneCopyOnTheDevice) {
  Open(64 << 20);
  const std::string bytes = testing::EncodedCache(1, 400);
  DeviceCopies c;
  ASSERT_TRUE(Put("a", OnDevice(bytes), &c).ok());
  EXPECT_EQ(c.on_device, bytes.size());
  EXPECT_EQ(c.to_host, 0u);
  EXPECT_EQ(c.to_device, 0u);
  auto where = store_->Lookup(CacheKey{"t", "m", "a"});
  ASSERT_TRUE(where.ok());
  EXPECT_EQ(where->tier, TierKind::kDevice);
  EXPECT_FALSE(where->persisted);
  EXPECT_EQ(where->meta.crc32c, Crc32c(bytes.data(), bytes.size()));
  EXPECT_EQ(where->meta.stored_bytes, bytes.size());
  // A get copies it to the host once; GetInto copies it on the device.
  auto got = store_->Get(CacheKey{"t", "m", "a"});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->payload.view() == bytes);
  DeviceBuffer buf(bytes.size() + 100);
  DeviceCopies g;
  auto meta = store_->GetInto(CacheKey{"t", "m", "a"}, buf.Target(), &g);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(meta->stored_bytes, bytes.size());
  EXPECT_EQ(g.on_device, bytes.size());
  EXPECT_EQ(g.to_device + g.to_host, 0u);
  EXPECT_TRUE(buf.Read(bytes.size()) == bytes);
  // Too small a target: nothing written, the size named.
  DeviceBuffer small(bytes.size() - 1);
  auto refused = store_->GetInto(CacheKey{"t", "m", "a"}, small.Target(), nullptr);
  EXPECT_TRUE(absl::IsOutOfRange(refused.status())) << refused.status();
  EXPECT_TRUE(absl::IsNotFound(
      store_->GetInto(CacheKey{"t", "m", "absent"}, buf.Target(), nullptr).status()));
}

TEST_F(DevicePayloadTest, ElsewhereItIsCopiedToTheHostExactlyOnce) {
  Open(64 << 20);
  const std::string bytes = testing::EncodedCache(2, 400);
  // Into the host tier.
  DeviceCopies c;
  ASSERT_TRUE(Put("h", OnDevice(bytes), &c, TierKind::kHost).ok());
  EXPECT_EQ(c.to_host, bytes.size());
  EXPECT_EQ(c.on_device + c.to_device, 0u);
  // Disk durability on the device tier: the RocksDB copy from one download, the device copy on
  // the device.
  DeviceCopies d;
  ASSERT_TRUE(Put("d", OnDevice(bytes), &d, TierKind::kDevice, Durability::kDisk).ok());
  EXPECT_EQ(d.to_host, bytes.size());
  EXPECT_EQ(d.on_device, bytes.size());
  auto where = store_->Lookup(CacheKey{"t", "m", "d"});
  ASSERT_TRUE(where.ok());
  EXPECT_EQ(where->tier, TierKind::kDevice);
  EXPECT_TRUE(where->persisted);
  // Into RocksDB directly.
  DeviceCopies r;
  ASSERT_TRUE(Put("r", OnDevice(bytes), &r, TierKind::kRocksDb).ok());
  EXPECT_EQ(r.to_host, bytes.size());
  // GetInto from the host tier: one upload.
  DeviceBuffer buf(bytes.size());
  DeviceCopies g;
  ASSERT_TRUE(store_->GetInto(CacheKey{"t", "m", "h"}, buf.Target(), &g).ok());
  EXPECT_EQ(g.to_device, bytes.size());
  EXPECT_TRUE(buf.Read(bytes.size()) == bytes);
  // Every cache reads back whole, and the disk-durable one survives a restart.
  for (const char* k : {"h", "d", "r"}) {
    auto got = store_->Get(CacheKey{"t", "m", k});
    ASSERT_TRUE(got.ok()) << k << ": " << got.status();
    EXPECT_TRUE(got->payload.view() == bytes) << k;
  }
  Open(64 << 20);
  auto back = store_->Get(CacheKey{"t", "m", "d"});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->payload.view() == bytes);
}

TEST_F(DevicePayloadTest, AFullDeviceTierSpillsWithOneDownloadAndDemotesWholeCaches) {
  const std::string bytes = testing::EncodedCache(3, 2000);
  Open(bytes.size() * 5 / 2, /*rocks=*/false);  // room for two
  std::vector<DeviceCopies> c(4);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(Put("k" + std::to_string(i), OnDevice(bytes), &c[i]).ok()) << i;
    EXPECT_EQ(c[i].on_device + c[i].to_host, bytes.size()) << i;  // one copy, wherever it went
  }
  int on_device = 0;
  for (int i = 0; i < 4; ++i) {
    auto where = store_->Lookup(CacheKey{"t", "m", "k" + std::to_string(i)});
    ASSERT_TRUE(where.ok());
    on_device += where->tier == TierKind::kDevice;
    auto got = store_->Get(CacheKey{"t", "m", "k" + std::to_string(i)});
    ASSERT_TRUE(got.ok());
    EXPECT_TRUE(got->payload.view() == bytes) << i;
  }
  EXPECT_GE(on_device, 1);
  EXPECT_LE(on_device, 2);
  // A cache too big for the device tier at all goes to the host, downloaded once.
  const std::string big = testing::EncodedCache(4, 20000);
  DeviceCopies b;
  ASSERT_TRUE(Put("big", OnDevice(big), &b).ok());
  EXPECT_EQ(b.to_host, big.size());
  EXPECT_EQ(b.on_device, 0u);
  EXPECT_EQ(store_->Lookup(CacheKey{"t", "m", "big"})->tier, TierKind::kHost);
}

TEST_F(DevicePayloadTest, BytesThatDoNotMatchTheirCrcOrHeaderAreRefused) {
  Open(64 << 20);
  const std::string bytes = testing::EncodedCache(5, 400);
  DeviceCopies c;
  absl::Status st = Put("bad", OnDevice(bytes, /*crc_flip=*/1), &c, TierKind::kHost);
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  EXPECT_TRUE(absl::IsNotFound(store_->Lookup(CacheKey{"t", "m", "bad"}).status()));
  Payload p = OnDevice(bytes);
  DeviceBytes broken = *p.device_bytes();
  broken.header[60] ^= 1;  // the header checksum no longer holds
  st = Put("bad", Payload::OnDevice(broken), nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(absl::IsNotFound(store_->Lookup(CacheKey{"t", "m", "bad"}).status()));
}

#endif  // KVCOMP_HAVE_CUDA

}  // namespace
}  // namespace storage
}  // namespace kvcomp
