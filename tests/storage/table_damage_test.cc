// A damaged RocksDB table file (a media fault in an .sst: its footer, a data block, or the file
// cut short), on a real RocksDB in a temporary directory. The database holds three batches of
// caches, each closed cleanly (so each batch's records sit in table files of their own); then
// one table of the middle batch is damaged and the tier opened again. The tier must open (RocksDB
// refuses the open, or the scan at open fails, on such a table), take that table out, serve
// every cache of the other batches byte-exact, read the middle batch's caches as misses (never
// other bytes), say what it dropped, stay writable, and open cleanly afterwards.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kvcomp/storage/tiered_store.h"
#include "rocksdb/db.h"
#include "rocksdb/metadata.h"
#include "rocksdb/options.h"
#include "rocksdb_tier.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

using testing::MetaFor;
using testing::TempDir;

RocksDbTierOptions Options(const std::string& path) {
  RocksDbTierOptions o;
  o.enabled = true;
  o.path = path;
  o.capacity_bytes = 64 << 20;
  o.min_blob_size = 64 << 10;  // the 3,000-byte payloads sit in the payload family's tables
  o.reserve_bytes = 1 << 20;
  return o;
}

// Payload of `key`: 3,000 bytes of a pattern of its own.
std::string Bytes(const std::string& key) {
  std::string s = "payload " + key + " ";
  s.resize(3000);
  for (size_t j = key.size() + 9; j < s.size(); ++j) {
    s[j] = static_cast<char>(key.back() * 31 + key.size() * 17 + j * 7);
  }
  return s;
}

std::string Key(char batch, int i) { return std::string(1, batch) + std::to_string(i); }

constexpr int kPerBatch = 20;

// Batches a, b, c of kPerBatch caches, each written by a tier opened for it and closed cleanly
// (the close flushes: each batch's meta and payload records land in table files of their own).
// The second opening also deletes a0, so its tombstone sits in batch b's tables.
void MakeDatabase(const std::string& dir, int per_batch = kPerBatch) {
  for (char batch : {'a', 'b', 'c'}) {
    auto tier = RocksDbTier::Open(Options(dir));
    ASSERT_TRUE(tier.ok()) << tier.status();
    for (int i = 0; i < per_batch; ++i) {
      Payload p = Payload::Copy(Bytes(Key(batch, i)));
      ASSERT_TRUE((*tier)->Put(Key(batch, i), MetaFor(p), p, /*sync=*/true).ok());
    }
    if (batch == 'b') {
      ASSERT_TRUE((*tier)->Delete("a0", /*sync=*/true).ok());
    }
  }
}

// The table file of `family` whose largest key starts with `batch` (batch b's tables start with
// a0's tombstone).
std::filesystem::path TableOf(const std::string& dir, const std::string& family, char batch) {
  std::vector<std::string> names;
  rocksdb::DBOptions options;
  EXPECT_TRUE(rocksdb::DB::ListColumnFamilies(options, dir, &names).ok());
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const auto& n : names) cfs.push_back({n, rocksdb::ColumnFamilyOptions()});
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  EXPECT_TRUE(rocksdb::DB::OpenForReadOnly(options, dir, cfs, &handles, &raw).ok());
  if (raw == nullptr) return {};
  std::unique_ptr<rocksdb::DB> db(raw);
  std::vector<rocksdb::LiveFileMetaData> files;
  db->GetLiveFilesMetaData(&files);
  for (auto* h : handles) db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
  for (const auto& f : files) {
    if (f.column_family_name == family && !f.largestkey.empty() && f.largestkey[0] == batch) {
      return std::filesystem::path(dir) / f.relative_filename;
    }
  }
  return {};
}

void FlipByte(const std::filesystem::path& p, uint64_t at) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char b = 0;
  f.read(&b, 1);
  b = static_cast<char>(b ^ 0x10);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&b, 1);
}

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

enum class Damage { kFooter, kCut, kDataBlock, kProperties };

// Damages batch b's table of `family` in `dir`: the table's file name.
std::string DamageTable(const std::string& dir, const std::string& family, Damage damage) {
  const std::filesystem::path table = TableOf(dir, family, 'b');
  EXPECT_FALSE(table.empty()) << "no table of batch b in " << family;
  if (table.empty()) return "";
  const uint64_t size = std::filesystem::file_size(table);
  switch (damage) {
    case Damage::kFooter: FlipByte(table, size - 1); break;  // the footer's magic number
    case Damage::kCut: std::filesystem::resize_file(table, size / 2); break;
    case Damage::kDataBlock: FlipByte(table, 40); break;  // inside the first data block
    case Damage::kProperties: {
      // "rocksdb.data.size" (its key stored as "data.size" after the shared "rocksdb.") becomes
      // "rocksdb.tata.size": the properties block is out of order
      // (RocksDB's error then names the MANIFEST, not the table).
      std::ifstream in(table, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      const size_t at = bytes.find("data.size");
      EXPECT_NE(at, std::string::npos);
      if (at != std::string::npos) FlipByte(table, at);
      break;
    }
  }
  return table.filename().string();
}

// Every cache of batches a (but a0, deleted) and c byte-exact; batch b's caches misses.
void ExpectBatchBLost(RocksDbTier& tier) {
  for (char batch : {'a', 'b', 'c'}) {
    for (int i = 0; i < kPerBatch; ++i) {
      const std::string key = Key(batch, i);
      auto got = tier.Get(key);
      if (batch == 'b') {
        // Its meta is gone (the store never serves it); a payload record left behind holds
        // only its own bytes.
        EXPECT_TRUE(absl::IsNotFound(tier.GetMeta(key).status())) << key;
        if (got.ok()) {
          EXPECT_EQ(got->view(), Bytes(key)) << key;
        }
        continue;
      }
      if (key == "a0") {
        // Its delete was recorded in batch b's tables: gone, or (its tombstone lost with the
        // meta table) back whole; never other bytes.
        if (got.ok()) {
          EXPECT_EQ(got->view(), Bytes(key));
        }
        continue;
      }
      ASSERT_TRUE(got.ok()) << key << ": " << got.status();
      EXPECT_EQ(got->view(), Bytes(key)) << key;
    }
  }
}

void CheckMetaTableDamage(Damage damage) {
  TempDir dir;
  MakeDatabase(dir.path());
  if (::testing::Test::HasFatalFailure()) return;
  const std::string table = DamageTable(dir.path(), "meta", damage);
  if (table.empty()) return;
  {
    auto tier = RocksDbTier::Open(Options(dir.path()));
    ASSERT_TRUE(tier.ok()) << tier.status();
    EXPECT_EQ((*tier)->table_damage().tables, 1u);
    EXPECT_TRUE(absl::StrContains((*tier)->table_damage().last, table))
        << (*tier)->table_damage().last;
    EXPECT_TRUE(absl::StrContains((*tier)->table_damage().last, "meta"));
    EXPECT_TRUE(std::filesystem::exists(dir.path() + "/damaged/" + table));
    EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + table));
    ExpectBatchBLost(**tier);
    for (int i = 0; i < kPerBatch; ++i) {
      EXPECT_TRUE(absl::IsNotFound((*tier)->GetMeta(Key('b', i)).status()));
    }
    // Writable: a new cache and one of the lost keys put again.
    for (const std::string key : {"d0", "b3"}) {
      Payload p = Payload::Copy(Bytes(key));
      ASSERT_TRUE((*tier)->Put(key, MetaFor(p), p, /*sync=*/true).ok()) << key;
    }
  }
  // A clean open afterwards: nothing more dropped, the same caches.
  auto tier = RocksDbTier::Open(Options(dir.path()));
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ((*tier)->table_damage().tables, 0u);
  for (const std::string key : {"a5", "c7", "d0", "b3"}) {
    auto got = (*tier)->Get(key);
    ASSERT_TRUE(got.ok()) << key << ": " << got.status();
    EXPECT_EQ(got->view(), Bytes(key));
  }
  EXPECT_TRUE(absl::IsNotFound((*tier)->GetMeta("b4").status()));
}

// RocksDB refuses the open: "Bad table magic number".
TEST(TableDamage, TheFooterOfAMetaTableDamaged) { CheckMetaTableDamage(Damage::kFooter); }

// RocksDB refuses the open: "Sst file size mismatch".
TEST(TableDamage, AMetaTableCutShort) { CheckMetaTableDamage(Damage::kCut); }

// RocksDB refuses the open without naming the table ("properties unsorted in file
// .../MANIFEST-..."): the tier finds it by reading each table on its own.
TEST(TableDamage, ThePropertiesOfAMetaTableDamaged) { CheckMetaTableDamage(Damage::kProperties); }

// RocksDB opens; the scan of the meta family at open fails its block checksum.
TEST(TableDamage, ADataBlockOfAMetaTableDamaged) { CheckMetaTableDamage(Damage::kDataBlock); }

// A meta table of many blocks with its first data block damaged: the records of its other
// blocks are read from the table itself and written again before it is taken out, so only the
// caches of the damaged block are lost.
TEST(TableDamage, TheIntactBlocksOfADamagedMetaTableAreSalvaged) {
  constexpr int kMany = 300;  // batch b's meta table: several 4 KiB blocks
  TempDir dir;
  MakeDatabase(dir.path(), kMany);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string table = DamageTable(dir.path(), "meta", Damage::kDataBlock);
  if (table.empty()) return;
  auto tier = RocksDbTier::Open(Options(dir.path()));
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ((*tier)->table_damage().tables, 1u);
  const uint64_t salvaged = (*tier)->table_damage().salvaged;
  EXPECT_GT(salvaged, 0u);
  EXPECT_LT(salvaged, static_cast<uint64_t>(kMany));
  EXPECT_TRUE(absl::StrContains((*tier)->table_damage().last, "written again first"));
  uint64_t kept = 0;
  for (int i = 0; i < kMany; ++i) {
    const std::string key = Key('b', i);
    if (!(*tier)->GetMeta(key).ok()) continue;
    ++kept;
    auto got = (*tier)->Get(key);
    ASSERT_TRUE(got.ok()) << key << ": " << got.status();
    EXPECT_EQ(got->view(), Bytes(key)) << key;
  }
  EXPECT_EQ(kept, salvaged);
  for (char batch : {'a', 'c'}) {
    for (int i = 1; i < kMany; ++i) {
      auto got = (*tier)->Get(Key(batch, i));
      ASSERT_TRUE(got.ok()) << Key(batch, i) << ": " << got.status();
      EXPECT_EQ(got->view(), Bytes(Key(batch, i)));
    }
  }
}

// A payload table's data block damaged: RocksDB opens and the open's scans do not read payloads;
// a get of a cache in that block fails cleanly (DataLoss, never other bytes) and notes the table;
// the next open writes the table's readable records again and takes the table out: the caches
// of its intact blocks are still served, those of the damaged block are misses.
TEST(TableDamage, ADamagedPayloadTableMetByAGetIsTakenOutAtTheNextOpen) {
  TempDir dir;
  MakeDatabase(dir.path());
  if (::testing::Test::HasFatalFailure()) return;
  const std::string table = DamageTable(dir.path(), "payload", Damage::kDataBlock);
  if (table.empty()) return;
  std::vector<bool> failed(kPerBatch, false);
  int failures = 0;
  {
    auto tier = RocksDbTier::Open(Options(dir.path()));
    ASSERT_TRUE(tier.ok()) << tier.status();
    EXPECT_EQ((*tier)->table_damage().tables, 0u);
    for (int i = 0; i < kPerBatch; ++i) {
      auto got = (*tier)->Get(Key('b', i));
      if (got.ok()) {
        EXPECT_EQ(got->view(), Bytes(Key('b', i)));
      } else {
        EXPECT_TRUE(absl::IsDataLoss(got.status())) << got.status();
        failed[i] = true;
        ++failures;
      }
    }
    EXPECT_GE(failures, 1);
    EXPECT_LT(failures, kPerBatch);
    EXPECT_TRUE(std::filesystem::exists(dir.path() + "/damaged/pending"));
  }
  auto tier = RocksDbTier::Open(Options(dir.path()));
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ((*tier)->table_damage().tables, 1u);
  EXPECT_TRUE(absl::StrContains((*tier)->table_damage().last, table));
  EXPECT_TRUE(absl::StrContains((*tier)->table_damage().last, "payload"));
  EXPECT_EQ((*tier)->table_damage().salvaged, static_cast<uint64_t>(kPerBatch - failures));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/damaged/pending"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/damaged/" + table));
  // a0's delete left a tombstone in that payload table: the older payload it hid is back with
  // no meta and is removed, so nothing of a0 can come back.
  EXPECT_TRUE(absl::IsNotFound((*tier)->Get("a0").status()));
  EXPECT_TRUE(absl::IsNotFound((*tier)->GetMeta("a0").status()));
  EXPECT_GE((*tier)->table_damage().orphans, 1u);
  for (char batch : {'a', 'b', 'c'}) {
    for (int i = 0; i < kPerBatch; ++i) {
      const std::string key = Key(batch, i);
      if (key == "a0") continue;
      auto got = (*tier)->Get(key);
      if (batch == 'b' && failed[i]) {
        EXPECT_TRUE(absl::IsNotFound(got.status())) << key << ": " << got.status();
        continue;
      }
      ASSERT_TRUE(got.ok()) << key << ": " << got.status();
      EXPECT_EQ(got->view(), Bytes(key)) << key;
    }
  }
}

// A damaged MANIFEST is not edited: the open is refused as before (docs/storage.md).
TEST(TableDamage, NoTableIsDroppedThroughADamagedManifest) {
  TempDir dir;
  MakeDatabase(dir.path());
  if (::testing::Test::HasFatalFailure()) return;
  DamageTable(dir.path(), "meta", Damage::kCut);
  std::string current;
  {
    std::ifstream in(dir.path() + "/CURRENT");
    std::getline(in, current);
  }
  const std::filesystem::path manifest = std::filesystem::path(dir.path()) / current;
  const uint64_t size = std::filesystem::file_size(manifest);
  FlipByte(manifest, size / 2);
  const std::string before = ReadFile(manifest);
  auto tier = RocksDbTier::Open(Options(dir.path()));
  EXPECT_FALSE(tier.ok());
  EXPECT_EQ(ReadFile(manifest), before);
}

// A MANIFEST that ends in part of a record (a crash while a record was appended; RocksDB reads it
// as the file's end) is cut back to its last whole record before the tier's edit is appended.
TEST(TableDamage, AManifestEndingInPartOfARecordIsCutBeforeTheEdit) {
  TempDir dir;
  MakeDatabase(dir.path());
  if (::testing::Test::HasFatalFailure()) return;
  const std::string table = DamageTable(dir.path(), "meta", Damage::kFooter);
  std::string current;
  {
    std::ifstream in(dir.path() + "/CURRENT");
    std::getline(in, current);
  }
  const std::filesystem::path manifest = std::filesystem::path(dir.path()) / current;
  {
    // A header announcing 40 bytes, of which 5 were written.
    std::ofstream out(manifest, std::ios::binary | std::ios::app);
    const char part[] = {0x11, 0x22, 0x33, 0x44, 40, 0, 1, 'a', 'b', 'c', 'd', 'e'};
    out.write(part, sizeof(part));
  }
  auto tier = RocksDbTier::Open(Options(dir.path()));
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ((*tier)->table_damage().tables, 1u);
  EXPECT_TRUE(absl::StrContains((*tier)->table_damage().last, table));
  ExpectBatchBLost(**tier);
}

// A MANIFEST cut inside its last record: RocksDB opens without that edit (the tables of the last
// flush, batch c's, are no longer part of the database); the tier says so, and what it serves is
// still byte-exact.
TEST(TableDamage, AManifestCutInsideItsLastRecordIsReported) {
  TempDir dir;
  MakeDatabase(dir.path());
  if (::testing::Test::HasFatalFailure()) return;
  std::string current;
  {
    std::ifstream in(dir.path() + "/CURRENT");
    std::getline(in, current);
  }
  const std::filesystem::path manifest = std::filesystem::path(dir.path()) / current;
  std::filesystem::resize_file(manifest, std::filesystem::file_size(manifest) - 3);
  {
    auto tier = RocksDbTier::Open(Options(dir.path()));
    ASSERT_TRUE(tier.ok()) << tier.status();
    EXPECT_EQ((*tier)->table_damage().manifest_tails, 1u);
    EXPECT_TRUE(absl::StrContains((*tier)->table_damage().last_manifest_tail, current))
        << (*tier)->table_damage().last_manifest_tail;
    int served = 0;
    for (char batch : {'a', 'b', 'c'}) {
      for (int i = 0; i < kPerBatch; ++i) {
        auto got = (*tier)->Get(Key(batch, i));
        if (!got.ok()) continue;
        EXPECT_EQ(got->view(), Bytes(Key(batch, i)));
        ++served;
      }
    }
    EXPECT_GT(served, 0);
  }
  // The open wrote a new MANIFEST: the next one reports nothing.
  auto tier = RocksDbTier::Open(Options(dir.path()));
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ((*tier)->table_damage().manifest_tails, 0u);
}

// The store opens with its RocksDB tier and counts the table it took out.
TEST(TableDamage, TheStoreOpensWithItsDiskTierAndCountsTheTable) {
  TempDir dir;
  MakeDatabase(dir.path());
  if (::testing::Test::HasFatalFailure()) return;
  const std::string table = DamageTable(dir.path(), "meta", Damage::kCut);
  StoreOptions o;
  o.host.capacity_bytes = 1 << 20;
  o.rocksdb = Options(dir.path());
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  const StoreStats st = (*store)->Stats();
  EXPECT_TRUE(st.tier(TierKind::kRocksDb).present) << st.tier(TierKind::kRocksDb).error;
  EXPECT_EQ(st.tables_dropped, 1u);
  EXPECT_TRUE(absl::StrContains(st.last_table_dropped, table)) << st.last_table_dropped;
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
