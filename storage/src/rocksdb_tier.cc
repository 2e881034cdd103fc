#include "rocksdb_tier.h"

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/status.h"
#include "rocksdb/cache.h"
#include "rocksdb/db.h"
#include "rocksdb/listener.h"
#include "rocksdb/options.h"
#include "rocksdb/table.h"
#include "rocksdb/write_batch.h"

namespace kvcomp {
namespace storage {
namespace {

constexpr uint8_t kMetaVersion = 1;
constexpr size_t kMetaBytes = 52;
constexpr char kQuarantineReason = 'r';
constexpr char kQuarantineMeta = 'm';
constexpr char kQuarantinePayload = 'p';

// RocksDB hands NoSpace errors to its SstFileManager, which retries only every 5 s and only once
// the disk has a reserve it computes (large next to a small volume), refusing DB::Resume() as Busy
// meanwhile. The tier owns recovery instead: the next write after a failure calls Resume(), so
// puts go on as soon as the disk has room (docs/storage.md, "Faults").
class ManualRecovery : public rocksdb::EventListener {
 public:
  const char* Name() const override { return "kvcomp.ManualRecovery"; }
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason, rocksdb::Status bg_error,
                            bool* auto_recovery) override {
    bg_error.PermitUncheckedError();
    *auto_recovery = false;
  }
};

void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}
void PutBe(std::string* out, uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetBe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

rocksdb::Slice ToSlice(absl::string_view s) { return rocksdb::Slice(s.data(), s.size()); }

}  // namespace

std::string EncodeMeta(const CacheMeta& meta) {
  std::string out;
  out.reserve(kMetaBytes);
  PutLe(&out, kMetaVersion, 1);
  PutLe(&out, static_cast<uint8_t>(meta.tier), 1);
  PutLe(&out, 0, 2);
  PutLe(&out, meta.crc32c, 4);
  PutLe(&out, meta.original_bytes, 8);
  PutLe(&out, meta.stored_bytes, 8);
  PutLe(&out, static_cast<uint64_t>(meta.created_unix_ms), 8);
  PutLe(&out, static_cast<uint64_t>(meta.ttl_ms), 8);
  PutLe(&out, meta.projection_version, 8);
  PutLe(&out, Crc32c(out.data(), out.size()), 4);
  return out;
}

absl::StatusOr<CacheMeta> DecodeMeta(absl::string_view b) {
  if (b.size() != kMetaBytes) {
    return absl::DataLossError(
        absl::StrCat("meta record of ", b.size(), " bytes, want ", kMetaBytes));
  }
  if (GetLe(b.data() + kMetaBytes - 4, 4) != Crc32c(b.data(), kMetaBytes - 4)) {
    return absl::DataLossError("meta record checksum mismatch");
  }
  if (static_cast<uint8_t>(b[0]) != kMetaVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("meta record version ", static_cast<int>(b[0]), " unknown"));
  }
  const uint8_t tier = static_cast<uint8_t>(b[1]);
  if (tier >= kNumTiers) return absl::DataLossError("meta record names an unknown tier");
  CacheMeta m;
  m.tier = static_cast<TierKind>(tier);
  m.crc32c = static_cast<uint32_t>(GetLe(b.data() + 4, 4));
  m.original_bytes = GetLe(b.data() + 8, 8);
  m.stored_bytes = GetLe(b.data() + 16, 8);
  m.created_unix_ms = static_cast<int64_t>(GetLe(b.data() + 24, 8));
  m.ttl_ms = static_cast<int64_t>(GetLe(b.data() + 32, 8));
  m.projection_version = GetLe(b.data() + 40, 8);
  return m;
}

std::string EncodeProjectionKey(const ProjectionKey& key) {
  std::string out;
  PutBe(&out, key.model_id.size(), 2);
  out.append(key.model_id);
  PutBe(&out, key.layer, 4);
  PutBe(&out, key.kv_head, 4);
  PutBe(&out, key.version, 8);
  return out;
}

absl::StatusOr<ProjectionKey> DecodeProjectionKey(absl::string_view b) {
  if (b.size() < 2) return absl::DataLossError("projection key too short");
  const size_t n = GetBe(b.data(), 2);
  if (b.size() != 2 + n + 16) return absl::DataLossError("projection key of wrong size");
  ProjectionKey k;
  k.model_id = std::string(b.substr(2, n));
  k.layer = static_cast<uint32_t>(GetBe(b.data() + 2 + n, 4));
  k.kv_head = static_cast<uint32_t>(GetBe(b.data() + 6 + n, 4));
  k.version = GetBe(b.data() + 10 + n, 8);
  return k;
}

absl::Status FromRocksDb(const rocksdb::Status& s, absl::string_view context) {
  if (s.ok()) return absl::OkStatus();
  const std::string msg = absl::StrCat(context, ": ", s.ToString());
  if (s.IsNoSpace()) return absl::ResourceExhaustedError(absl::StrCat("disk full: ", msg));
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsIOError()) return absl::UnavailableError(msg);
  if (s.IsInvalidArgument()) return absl::InvalidArgumentError(msg);
  return absl::InternalError(msg);
}

RocksDbTier::RocksDbTier(const RocksDbTierOptions& options) : capacity_(options.capacity_bytes) {}

RocksDbTier::~RocksDbTier() {
  if (db_ != nullptr) {
    for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    db_->Close().PermitUncheckedError();
  }
}

absl::StatusOr<std::unique_ptr<RocksDbTier>> RocksDbTier::Open(const RocksDbTierOptions& o) {
  if (o.path.empty()) return absl::InvalidArgumentError("rocksdb tier: path is empty");
  if (o.capacity_bytes == 0) {
    return absl::InvalidArgumentError("rocksdb tier: capacity_bytes must be > 0");
  }
  if (o.create_if_missing && o.env == nullptr) {
    std::error_code ec;
    std::filesystem::create_directories(o.path, ec);  // RocksDB makes only the last level
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("rocksdb tier: cannot create ", o.path, ": ", ec.message()));
    }
  }
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = o.create_if_missing;
  db_options.create_missing_column_families = o.create_if_missing;
  db_options.max_background_jobs = o.max_background_jobs;
  db_options.bgerror_resume_retry_interval = 100000;  // us: retry after a write error quickly
  if (o.env != nullptr) db_options.env = o.env;
  db_options.listeners.push_back(std::make_shared<ManualRecovery>());

  rocksdb::ColumnFamilyOptions base;
  base.compression = rocksdb::kNoCompression;
  base.write_buffer_size = o.write_buffer_bytes;
  rocksdb::BlockBasedTableOptions table;
  std::shared_ptr<rocksdb::Cache> block_cache = rocksdb::NewLRUCache(o.block_cache_bytes);
  table.block_cache = block_cache;
  base.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::ColumnFamilyOptions payload = base;
  payload.enable_blob_files = o.enable_blob_files;
  payload.min_blob_size = o.min_blob_size;
  payload.blob_compression_type = rocksdb::kNoCompression;
  payload.enable_blob_garbage_collection = true;

  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, base},
      {"meta", base},
      {"payload", payload},
      {"calibration", base},
      {"quarantine", base},
  };
  std::unique_ptr<RocksDbTier> tier(new RocksDbTier(o));
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, o.path, cfs, &tier->handles_, &db);
  if (!s.ok()) return FromRocksDb(s, absl::StrCat("rocksdb tier: open ", o.path));
  tier->db_.reset(db);
  tier->block_cache_ = std::move(block_cache);
  tier->meta_ = tier->handles_[1];
  tier->payload_ = tier->handles_[2];
  tier->calibration_ = tier->handles_[3];
  tier->quarantine_ = tier->handles_[4];

  // Sizes for accounting come from the meta records (small); payloads are checked by Recover.
  std::unique_ptr<rocksdb::Iterator> it(
      tier->db_->NewIterator(rocksdb::ReadOptions(), tier->meta_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto meta = DecodeMeta(absl::string_view(it->value().data(), it->value().size()));
    const uint64_t n = meta.ok() ? meta->stored_bytes : 0;
    const absl::string_view key(it->key().data(), it->key().size());
    Stripe& st = tier->stripes_[absl::Hash<absl::string_view>()(key) % kStripes];
    WriterLock lock(&st.mu);
    st.sizes[std::string(key)] = n;
    tier->used_ += n;
    tier->entries_ += 1;
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "rocksdb tier: scan meta"));
  return tier;
}

SharedMutex& RocksDbTier::StripeOf(absl::string_view key) {
  return stripes_[absl::Hash<absl::string_view>()(key) % kStripes].mu;
}

absl::Status RocksDbTier::Write(void* batch, bool sync, absl::string_view what) {
  if (needs_resume_.load()) {
    // A write failed earlier (e.g. disk full) and RocksDB stopped writes. Ask it to go on; Busy
    // means its own recovery is running, and the write below tells whether it is done.
    if (db_->Resume().ok()) needs_resume_.store(false);
  }
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  rocksdb::Status s = db_->Write(wo, static_cast<rocksdb::WriteBatch*>(batch));
  if (!s.ok()) {
    needs_resume_.store(true);
    return FromRocksDb(s, absl::StrCat("rocksdb tier: ", what));
  }
  return absl::OkStatus();
}

absl::Status RocksDbTier::Put(absl::string_view key, const CacheMeta& meta, const Payload& payload,
                              bool sync) {
  Stripe& st = stripes_[absl::Hash<absl::string_view>()(key) % kStripes];
  WriterLock lock(&st.mu);
  auto it = st.sizes.find(key);
  const uint64_t old = it == st.sizes.end() ? 0 : it->second;
  const uint64_t n = payload.size();
  const uint64_t used = used_.load();
  if (used - old + n > capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat("rocksdb tier: ", n, " bytes do not fit (",
                                                     used, " of ", capacity_, " used)"));
  }
  CacheMeta m = meta;
  m.tier = TierKind::kRocksDb;
  m.stored_bytes = n;
  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Put(meta_, ToSlice(key), EncodeMeta(m));
  if (s.ok()) s = batch.Put(payload_, ToSlice(key), ToSlice(payload.view()));
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: batch"));
  KVCOMP_RETURN_IF_ERROR(Write(&batch, sync, "put"));
  if (it == st.sizes.end()) {
    st.sizes.emplace(std::string(key), n);
    entries_ += 1;
  } else {
    it->second = n;
  }
  used_ += n;
  used_ -= old;
  return absl::OkStatus();
}

absl::StatusOr<Payload> RocksDbTier::Get(absl::string_view key) {
  // The payload shares RocksDB's pinned buffer (block cache or blob read) instead of copying it.
  // A pinned block-cache entry is released into the cache, which the holder keeps alive, so the
  // payload may outlive the store.
  struct Pinned {
    std::shared_ptr<rocksdb::Cache> cache;  // destroyed after `slice` releases into it
    rocksdb::PinnableSlice slice;
  };
  auto value = std::make_shared<Pinned>();
  value->cache = block_cache_;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), payload_, ToSlice(key), &value->slice);
  if (s.IsNotFound()) return absl::NotFoundError("rocksdb tier: no such key");
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: get"));
  const size_t n = value->slice.size();
  const auto* data = reinterpret_cast<const uint8_t*>(value->slice.data());
  return Payload(std::shared_ptr<const uint8_t>(std::move(value), data), n);
}

absl::StatusOr<CacheMeta> RocksDbTier::GetMeta(absl::string_view key) {
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), meta_, ToSlice(key), &value);
  if (s.IsNotFound()) return absl::NotFoundError("rocksdb tier: no such key");
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: get meta"));
  return DecodeMeta(value);
}

absl::Status RocksDbTier::Delete(absl::string_view key, bool sync) {
  Stripe& st = stripes_[absl::Hash<absl::string_view>()(key) % kStripes];
  WriterLock lock(&st.mu);
  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Delete(meta_, ToSlice(key));
  if (s.ok()) s = batch.Delete(payload_, ToSlice(key));
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: batch"));
  KVCOMP_RETURN_IF_ERROR(Write(&batch, sync, "delete"));
  auto it = st.sizes.find(key);
  if (it != st.sizes.end()) {
    used_ -= it->second;
    entries_ -= 1;
    st.sizes.erase(it);
  }
  return absl::OkStatus();
}

absl::Status RocksDbTier::DeleteMany(const std::vector<std::string>& keys, bool sync) {
  if (keys.empty()) return absl::OkStatus();
  rocksdb::WriteBatch batch;
  for (const std::string& key : keys) {
    rocksdb::Status s = batch.Delete(meta_, ToSlice(key));
    if (s.ok()) s = batch.Delete(payload_, ToSlice(key));
    KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: batch"));
  }
  KVCOMP_RETURN_IF_ERROR(Write(&batch, sync, "delete"));
  for (const std::string& key : keys) {
    Stripe& st = stripes_[absl::Hash<absl::string_view>()(key) % kStripes];
    WriterLock lock(&st.mu);
    auto it = st.sizes.find(key);
    if (it != st.sizes.end()) {
      used_ -= it->second;
      entries_ -= 1;
      st.sizes.erase(it);
    }
  }
  return absl::OkStatus();
}

absl::Status RocksDbTier::Recover(
    bool verify, const std::function<void(absl::string_view, const CacheMeta&)>& fn,
    std::vector<QuarantinedCache>* quarantined) {
  std::vector<std::pair<std::string, std::string>> bad;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), meta_));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const absl::string_view key(it->key().data(), it->key().size());
      auto meta = DecodeMeta(absl::string_view(it->value().data(), it->value().size()));
      if (!meta.ok()) {
        bad.emplace_back(std::string(key), meta.status().ToString());
        continue;
      }
      if (verify) {
        auto payload = Get(key);
        if (!payload.ok()) {
          bad.emplace_back(std::string(key),
                           absl::StrCat("payload unreadable: ", payload.status().ToString()));
          continue;
        }
        if (payload->size() != meta->stored_bytes ||
            Crc32c(payload->data(), payload->size()) != meta->crc32c) {
          bad.emplace_back(std::string(key), "payload checksum mismatch");
          continue;
        }
      }
      fn(key, *meta);
    }
    KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "rocksdb tier: recover"));
  }
  for (auto& [key, reason] : bad) {
    KVCOMP_RETURN_IF_ERROR(Quarantine(key, reason));
    if (quarantined != nullptr) quarantined->push_back({key, reason});
  }
  return absl::OkStatus();
}

absl::Status RocksDbTier::Quarantine(absl::string_view key, absl::string_view reason) {
  Stripe& st = stripes_[absl::Hash<absl::string_view>()(key) % kStripes];
  WriterLock lock(&st.mu);
  WriterLock quarantine_lock(&quarantine_mu_);
  std::string meta, payload;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), meta_, ToSlice(key), &meta);
  if (!s.ok() && !s.IsNotFound()) return FromRocksDb(s, "rocksdb tier: quarantine");
  s = db_->Get(rocksdb::ReadOptions(), payload_, ToSlice(key), &payload);
  if (!s.ok() && !s.IsNotFound()) return FromRocksDb(s, "rocksdb tier: quarantine");
  rocksdb::WriteBatch batch;
  auto qkey = [&](char tag) { return std::string(1, tag) + std::string(key); };
  s = batch.Put(quarantine_, qkey(kQuarantineReason), ToSlice(reason));
  if (s.ok()) s = batch.Put(quarantine_, qkey(kQuarantineMeta), meta);
  if (s.ok()) s = batch.Put(quarantine_, qkey(kQuarantinePayload), payload);
  if (s.ok()) s = batch.Delete(meta_, ToSlice(key));
  if (s.ok()) s = batch.Delete(payload_, ToSlice(key));
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: batch"));
  KVCOMP_RETURN_IF_ERROR(Write(&batch, /*sync=*/true, "quarantine"));
  auto it = st.sizes.find(key);
  if (it != st.sizes.end()) {
    used_ -= it->second;
    entries_ -= 1;
    st.sizes.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<QuarantinedCache>> RocksDbTier::ListQuarantine() {
  std::vector<QuarantinedCache> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), quarantine_));
  const std::string prefix(1, kQuarantineReason);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    out.push_back(
        {std::string(it->key().data() + 1, it->key().size() - 1), it->value().ToString()});
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "rocksdb tier: list quarantine"));
  return out;
}

absl::StatusOr<bool> RocksDbTier::PurgeQuarantine(absl::string_view key) {
  WriterLock lock(&quarantine_mu_);
  const std::string reason_key = std::string(1, kQuarantineReason) + std::string(key);
  std::string reason;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), quarantine_, reason_key, &reason);
  if (s.IsNotFound()) return false;
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: purge quarantine"));
  rocksdb::WriteBatch batch;
  for (char tag : {kQuarantineReason, kQuarantineMeta, kQuarantinePayload}) {
    KVCOMP_RETURN_IF_ERROR(FromRocksDb(
        batch.Delete(quarantine_, std::string(1, tag) + std::string(key)), "rocksdb tier: batch"));
  }
  KVCOMP_RETURN_IF_ERROR(Write(&batch, /*sync=*/true, "purge quarantine"));
  return true;
}

absl::StatusOr<std::vector<std::string>> RocksDbTier::PurgeAllQuarantine() {
  WriterLock lock(&quarantine_mu_);
  rocksdb::WriteBatch batch;
  std::vector<std::string> keys;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), quarantine_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (!it->key().empty() && it->key()[0] == kQuarantineReason) {
      keys.emplace_back(it->key().data() + 1, it->key().size() - 1);
    }
    KVCOMP_RETURN_IF_ERROR(
        FromRocksDb(batch.Delete(quarantine_, it->key()), "rocksdb tier: batch"));
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "rocksdb tier: purge quarantine"));
  if (batch.Count() == 0) return keys;
  KVCOMP_RETURN_IF_ERROR(Write(&batch, /*sync=*/true, "purge quarantine"));
  return keys;
}

namespace {
absl::Status ValidateProjectionKey(const ProjectionKey& key) {
  if (key.model_id.empty() || key.model_id.size() > ProjectionKey::kMaxModelBytes) {
    return absl::InvalidArgumentError(absl::StrCat("projection: model id of ", key.model_id.size(),
                                                   " bytes, want 1..",
                                                   ProjectionKey::kMaxModelBytes));
  }
  if (key.version == 0) return absl::InvalidArgumentError("projection: version must be >= 1");
  return absl::OkStatus();
}
}  // namespace

absl::Status RocksDbTier::PutProjection(const ProjectionKey& key, absl::string_view bytes) {
  KVCOMP_RETURN_IF_ERROR(ValidateProjectionKey(key));
  const std::string k = EncodeProjectionKey(key);
  WriterLock lock(&calibration_mu_);
  std::string existing;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), calibration_, k, &existing);
  if (s.ok()) {
    if (existing == bytes) return absl::OkStatus();
    return absl::AlreadyExistsError(absl::StrCat("projection ", key.model_id, " layer ", key.layer,
                                                 " head ", key.kv_head, " version ", key.version,
                                                 " exists with other bytes"));
  }
  if (!s.IsNotFound()) return FromRocksDb(s, "projection: read");
  rocksdb::WriteBatch batch;
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(batch.Put(calibration_, k, ToSlice(bytes)), "projection"));
  return Write(&batch, /*sync=*/true, "put projection");
}

absl::StatusOr<std::string> RocksDbTier::GetProjection(const ProjectionKey& key) {
  KVCOMP_RETURN_IF_ERROR(ValidateProjectionKey(key));
  std::string value;
  rocksdb::Status s =
      db_->Get(rocksdb::ReadOptions(), calibration_, EncodeProjectionKey(key), &value);
  if (s.IsNotFound()) return absl::NotFoundError("projection: no such key");
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "projection: get"));
  return value;
}

absl::StatusOr<std::vector<ProjectionKey>> RocksDbTier::ListProjections(
    absl::string_view model_id) {
  std::vector<ProjectionKey> out;
  std::string prefix;
  if (!model_id.empty()) {
    PutBe(&prefix, model_id.size(), 2);
    prefix.append(model_id.data(), model_id.size());
  }
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), calibration_));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    KVCOMP_ASSIGN_OR_RETURN(ProjectionKey k, DecodeProjectionKey(absl::string_view(
                                                 it->key().data(), it->key().size())));
    out.push_back(std::move(k));
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "projection: list"));
  return out;
}

absl::Status RocksDbTier::DeleteProjection(const ProjectionKey& key) {
  KVCOMP_RETURN_IF_ERROR(ValidateProjectionKey(key));
  const std::string k = EncodeProjectionKey(key);
  WriterLock lock(&calibration_mu_);
  std::string existing;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), calibration_, k, &existing);
  if (s.IsNotFound()) return absl::NotFoundError("projection: no such key");
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "projection: read"));
  rocksdb::WriteBatch batch;
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(batch.Delete(calibration_, k), "projection"));
  return Write(&batch, /*sync=*/true, "delete projection");
}

}  // namespace storage
}  // namespace kvcomp
