#include "rocksdb_tier.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvcomp/core/byte_coder.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "rocksdb/cache.h"
#include "rocksdb/db.h"
#include "rocksdb/file_system.h"
#include "rocksdb/listener.h"
#include "rocksdb/options.h"
#include "rocksdb/sst_file_manager.h"
#include "rocksdb/sst_file_reader.h"
#include "rocksdb/table.h"
#include "rocksdb/utilities/debug.h"
#include "rocksdb/write_batch.h"

namespace kvcomp {
namespace storage {
namespace {

constexpr uint8_t kMetaVersion = 1;
constexpr size_t kMetaBytes = 52;
constexpr char kQuarantineReason = 'r';
constexpr char kQuarantineMeta = 'm';
constexpr char kQuarantinePayload = 'p';
constexpr char kQuarantineFile = 'f';  // the record of a quarantined direct payload
constexpr char kDirectSuffix[] = ".kvd";
constexpr uint8_t kDirectRecordVersion = 1;
constexpr uint64_t kDirectChunk = 8ull << 20;  // bytes per write of a direct file
constexpr int kDirectPoolBatch = 16;           // direct files made ahead per directory sync

// The "direct" family's record of a key: u8 version, u64 LE size, then the file's name.
std::string EncodeDirectRecord(const std::string& name, uint64_t size) {
  std::string out(1, static_cast<char>(kDirectRecordVersion));
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((size >> (8 * i)) & 0xff));
  out += name;
  return out;
}

bool DecodeDirectRecord(absl::string_view b, std::string* name, uint64_t* size) {
  if (b.size() < 10 || static_cast<uint8_t>(b[0]) != kDirectRecordVersion) return false;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(b[1 + i]);
  *size = n;
  *name = std::string(b.substr(9));
  return absl::EndsWith(*name, kDirectSuffix) && name->find('/') == std::string::npos;
}

// A write refused for lack of disk space: ResourceExhausted with the kDiskFull detail, which
// the tiered store counts as a write error (a full tier or a quota is neither).
absl::Status DiskFullError(absl::string_view message) {
  return WithDetail(absl::ResourceExhaustedError(message), ErrorDetail::kDiskFull);
}

absl::Status FromIo(const rocksdb::IOStatus& s, absl::string_view context) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsNoSpace())
    return DiskFullError(absl::StrCat("disk full: ", context, ": ", s.ToString()));
  if (s.IsNotFound() || s.IsPathNotFound())
    return absl::NotFoundError(absl::StrCat(context, ": ", s.ToString()));
  return absl::UnavailableError(absl::StrCat(context, ": ", s.ToString()));
}

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

// RocksDB's info log, passed through, with the reports of damaged write-ahead log records noted
// while watching (during the open's replay): "<dir>/<n>.log: dropping <bytes> bytes; <why>".
class LogDamageWatch : public rocksdb::Logger {
 public:
  explicit LogDamageWatch(std::shared_ptr<rocksdb::Logger> target)
      : rocksdb::Logger(target->GetInfoLogLevel()), target_(std::move(target)) {}
  ~LogDamageWatch() override { target_->Close().PermitUncheckedError(); }

  void Watch(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    watching_ = on;
  }
  RocksDbTier::LogDamage Damage() const {
    std::lock_guard<std::mutex> lock(mu_);
    return damage_;
  }
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    damage_ = RocksDbTier::LogDamage{};
  }

  void Logv(const char* format, va_list ap) override {
    Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (watching_) {
        char line[1024];
        va_list copy;
        va_copy(copy, ap);
        std::vsnprintf(line, sizeof(line), format, copy);
        va_end(copy);
        Note(line);
      }
    }
    target_->Logv(level, format, ap);
  }
  void LogHeader(const char* format, va_list ap) override { target_->LogHeader(format, ap); }
  size_t GetLogFileSize() const override { return target_->GetLogFileSize(); }
  void Flush() override { target_->Flush(); }
  void SetInfoLogLevel(const rocksdb::InfoLogLevel level) override {
    rocksdb::Logger::SetInfoLogLevel(level);
    target_->SetInfoLogLevel(level);
  }

 private:
  void Note(absl::string_view line) {
    const size_t at = line.find(".log: dropping ");
    if (at == absl::string_view::npos) return;
    damage_.regions += 1;
    damage_.bytes += std::strtoull(line.data() + at + 15, nullptr, 10);
    const size_t name = line.rfind('/', at);
    damage_.last = std::string(line.substr(name == absl::string_view::npos ? 0 : name + 1));
  }

  std::shared_ptr<rocksdb::Logger> target_;
  mutable std::mutex mu_;
  bool watching_ = false;
  RocksDbTier::LogDamage damage_;
};

// A compaction that reads damaged data (blob garbage collection relocating a blob whose CRC
// fails) ends with Corruption, which RocksDB makes an unrecoverable background error: every later
// write fails, and a reopen schedules the same compaction. With repairs enabled the error is kept
// from stopping writes (the compaction's output is discarded, its inputs stay as they were) and
// the tier's repair thread is woken to quarantine what is damaged.
class DamageListener : public rocksdb::EventListener {
 public:
  explicit DamageListener(std::shared_ptr<void> signal,
                          std::function<bool(const std::string&)> note)
      : signal_(std::move(signal)), note_(std::move(note)) {}
  const char* Name() const override { return "kvcomp.DamageListener"; }
  void OnBackgroundError(rocksdb::BackgroundErrorReason reason,
                         rocksdb::Status* bg_error) override {
    if (reason != rocksdb::BackgroundErrorReason::kCompaction || !bg_error->IsCorruption()) return;
    if (note_(bg_error->ToString())) *bg_error = rocksdb::Status::OK();
  }

 private:
  std::shared_ptr<void> signal_;  // keeps what note_ refers to alive
  std::function<bool(const std::string&)> note_;
};

using byte_coder::GetLe;
using byte_coder::PutLe;

rocksdb::Slice ToSlice(absl::string_view s) { return rocksdb::Slice(s.data(), s.size()); }


// A write-ahead log cut short at the start of its first damaged block, to work around RocksDB
// 7.8's log reader: when a damaged block interrupts a record made of several fragments (a
// record longer than what is left of a 32 KiB block), the reader drops the record but keeps its
// fragments in the running checksum it hands to the replay with the next record; the next
// record of several fragments then fails its batch checksum ("Write batch content corrupted")
// and the whole open with it, although every later fragment is intact. Cutting the log where
// the damage starts turns the damage into a torn tail (what follows in that log is lost, as
// point-in-time recovery would lose it; later logs are replayed).
struct LogCut {
  std::string file;     // the log's name in the directory
  uint64_t at = 0;      // the new length: the damaged block's start
  uint64_t size = 0;    // the length before
};

// The first log of `dir` (in log number order) with a record whose header or checksum is bad
// before its last block (the last block may end torn, which a crash leaves and RocksDB
// tolerates), or nothing. Reads the legacy log format only (7-byte headers: masked CRC32C of
// type and payload, length, type 1-4; type 0 with length 0 pads a block's end); a log holding
// any other record type is left alone.
std::optional<LogCut> FindDamagedLog(const std::string& dir) {
  constexpr uint64_t kBlock = 32768;
  constexpr uint32_t kMaskDelta = 0xa282ead8u;
  std::vector<std::pair<uint64_t, std::filesystem::path>> logs;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".log") continue;
    const std::string stem = e.path().stem().string();
    if (stem.empty() || stem.find_first_not_of("0123456789") != std::string::npos) continue;
    logs.emplace_back(std::strtoull(stem.c_str(), nullptr, 10), e.path());
  }
  std::sort(logs.begin(), logs.end());
  std::vector<unsigned char> block(kBlock);
  for (const auto& [number, path] : logs) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) continue;
    const uint64_t size = std::filesystem::file_size(path, ec);
    std::optional<LogCut> cut;
    bool foreign = false;
    for (uint64_t start = 0; !ec && start < size && !cut && !foreign; start += kBlock) {
      const size_t n = std::fread(block.data(), 1, kBlock, f);
      if (n == 0) break;
      const bool last = start + n >= size;
      size_t pos = 0;
      while (pos + 7 <= n) {
        const unsigned char* h = block.data() + pos;
        const uint32_t masked = uint32_t{h[0]} | uint32_t{h[1]} << 8 | uint32_t{h[2]} << 16 |
                                uint32_t{h[3]} << 24;
        const uint32_t length = uint32_t{h[4]} | uint32_t{h[5]} << 8;
        const unsigned char type = h[6];
        if (type == 0 && length == 0) break;  // padding to the block's end
        if (type > 4) {
          foreign = true;  // recyclable or compressed logs: not read here
          break;
        }
        if (pos + 7 + length > n) {
          if (!last) cut = LogCut{path.filename().string(), start, size};
          break;  // a record past the file's end is a torn tail
        }
        const uint32_t rot = masked - kMaskDelta;
        const uint32_t expected = (rot >> 17) | (rot << 15);
        const uint32_t actual = Crc32cExtend(Crc32c(&type, 1), h + 7, length);
        if (actual != expected) {
          cut = LogCut{path.filename().string(), start, size};
          break;
        }
        pos += 7 + length;
      }
    }
    std::fclose(f);
    if (cut) return cut;
  }
  return std::nullopt;
}

// The table file (".sst") the message of a RocksDB Corruption names ("... in /dir/000012.sst
// offset ...", "Sst file size mismatch: /dir/000012.sst. ..."), "" when it names none. Only
// Corruption is read so: a missing file or an I/O error that may pass never makes a table count
// as damaged.
std::string DamagedTableIn(const std::string& m) {
  for (size_t at = m.find(".sst"); at != std::string::npos; at = m.find(".sst", at + 1)) {
    size_t b = at;
    while (b > 0 && m[b - 1] >= '0' && m[b - 1] <= '9') --b;
    if (b < at && (b == 0 || m[b - 1] == '/')) return m.substr(b, at + 4 - b);
  }
  return "";
}

// Notes a damaged table that a RocksDB Corruption names (met by a get or a compaction while the
// database is open) in <dir>/damaged/pending, for the next open to take out.
void NoteDamagedTable(const std::string& dir, const std::string& message) {
  const std::string table = DamagedTableIn(message);
  if (table.empty()) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(dir) / "damaged", ec);
  std::ofstream out(dir + "/damaged/pending", std::ios::app);
  out << table << "\n";
}

// Options for the read-only opens that find a damaged table's family and level: RocksDB's own
// info log is left alone (a read-only open would otherwise start a new LOG file each time).
class NoLogger : public rocksdb::Logger {
 public:
  NoLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::HEADER_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char*, va_list) override {}
};

rocksdb::DBOptions ProbeOptions() {
  rocksdb::DBOptions o;
  o.wal_recovery_mode = rocksdb::WALRecoveryMode::kSkipAnyCorruptedRecords;
  o.info_log = std::make_shared<NoLogger>();
  return o;
}

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// The database's MANIFEST (the log of version edits CURRENT names) read whole: every record
// checks (RocksDB's log format: 7-byte headers, masked CRC32C of type and payload, 32 KiB
// blocks). A record cut off by the file's end (a crash while it was written; RocksDB reads it
// as the end of the MANIFEST and ignores it) is allowed and reported in `torn_at`; any other
// defect is DataLoss naming the byte.
struct ManifestRead {
  std::string name;   // MANIFEST-<n>
  std::string path;
  std::string bytes;
  uint64_t torn_at = UINT64_MAX;  // where a record cut off by the file's end begins
};

absl::StatusOr<ManifestRead> ReadManifest(const std::string& dir) {
  constexpr uint64_t kBlock = 32768;
  constexpr uint32_t kMaskDelta = 0xa282ead8u;
  ManifestRead m;
  {
    std::ifstream in(dir + "/CURRENT");
    std::getline(in, m.name);
  }
  if (m.name.rfind("MANIFEST-", 0) != 0 || m.name.find('/') != std::string::npos) {
    return absl::DataLossError(absl::StrCat("rocksdb tier: CURRENT under ", dir,
                                            " does not name a MANIFEST"));
  }
  m.path = dir + "/" + m.name;
  {
    std::ifstream in(m.path, std::ios::binary);
    if (!in) return absl::UnavailableError(absl::StrCat("rocksdb tier: cannot read ", m.path));
    m.bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::string& bytes = m.bytes;
  auto damaged = [&](uint64_t at) {
    return absl::DataLossError(absl::StrCat("rocksdb tier: ", m.name, " is damaged at byte ", at));
  };
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  uint64_t pos = 0;
  uint64_t record_start = 0;  // where the record being read began (its first fragment)
  bool in_record = false;
  uint64_t torn_at = UINT64_MAX;
  while (pos < bytes.size()) {
    const uint64_t left_in_block = kBlock - pos % kBlock;
    if (left_in_block < 7) {  // the writer pads a block's last bytes with zeros
      for (uint64_t i = 0; i < left_in_block; ++i) {
        if (pos + i < bytes.size() && b[pos + i] != 0) return damaged(pos);
      }
      pos += left_in_block;
      continue;
    }
    if (pos + 7 > bytes.size()) {
      torn_at = in_record ? record_start : pos;
      break;
    }
    const unsigned char* h = b + pos;
    const uint32_t masked =
        uint32_t{h[0]} | uint32_t{h[1]} << 8 | uint32_t{h[2]} << 16 | uint32_t{h[3]} << 24;
    const uint32_t length = uint32_t{h[4]} | uint32_t{h[5]} << 8;
    const unsigned char type = h[6];
    if (type < 1 || type > 4 || 7 + length > left_in_block) return damaged(pos);
    if (pos + 7 + length > bytes.size()) {
      torn_at = in_record ? record_start : pos;
      break;
    }
    const uint32_t rot = masked - kMaskDelta;
    if (Crc32cExtend(Crc32c(&type, 1), h + 7, length) != ((rot >> 17) | (rot << 15))) {
      return damaged(pos);
    }
    // 1 full, 2 first, 3 middle, 4 last fragment
    if ((type == 1 || type == 2) == in_record) return damaged(pos);
    if (type == 1 || type == 2) record_start = pos;
    in_record = type == 2 || type == 3;
    pos += 7 + length;
  }
  if (torn_at == UINT64_MAX && in_record) torn_at = record_start;
  if (torn_at == 0) return damaged(0);
  m.torn_at = torn_at;
  return m;
}

// Appends one edit to the database's MANIFEST that removes table file `number` from `level` of
// column family `family_id`: a record of RocksDB's log format holding the edit's tags (200:
// column family, 6: deleted file). The MANIFEST must read whole first (ReadManifest; a record
// cut off by its end is removed first, as RocksDB would ignore it); otherwise nothing is
// written (a damaged MANIFEST is another fault, docs/storage.md). Synced before it returns.
absl::Status AppendTableDrop(const std::string& dir, uint32_t family_id, int level,
                             uint64_t number) {
  constexpr uint64_t kBlock = 32768;
  constexpr uint32_t kMaskDelta = 0xa282ead8u;
  auto read = ReadManifest(dir);
  if (!read.ok()) {
    return absl::Status(read.status().code(),
                        absl::StrCat(read.status().message(), "; no table dropped"));
  }
  std::string& bytes = read->bytes;
  const std::string& path = read->path;
  if (read->torn_at != UINT64_MAX) {
    std::error_code ec;
    std::filesystem::resize_file(path, read->torn_at, ec);
    if (ec) return absl::UnavailableError(absl::StrCat("rocksdb tier: cannot cut ", path));
    bytes.resize(read->torn_at);
  }

  std::string edit;
  PutVarint(&edit, 200);  // kColumnFamily
  PutVarint(&edit, family_id);
  PutVarint(&edit, 6);  // kDeletedFile: level, file number
  PutVarint(&edit, static_cast<uint64_t>(level));
  PutVarint(&edit, number);
  std::string out;
  uint64_t at = bytes.size();
  size_t done = 0;
  bool first = true;
  while (first || done < edit.size()) {
    const uint64_t left_in_block = kBlock - at % kBlock;
    if (left_in_block < 7) {
      out.append(left_in_block, '\0');
      at += left_in_block;
      continue;
    }
    const size_t n = std::min<size_t>(edit.size() - done, left_in_block - 7);
    const bool last = done + n == edit.size();
    const unsigned char type = first ? (last ? 1 : 2) : (last ? 4 : 3);
    const auto* fragment = reinterpret_cast<const unsigned char*>(edit.data()) + done;
    const uint32_t crc = Crc32cExtend(Crc32c(&type, 1), fragment, n);
    const uint32_t masked = ((crc >> 15) | (crc << 17)) + kMaskDelta;
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(masked >> (8 * i)));
    out.push_back(static_cast<char>(n & 0xff));
    out.push_back(static_cast<char>(n >> 8));
    out.push_back(static_cast<char>(type));
    out.append(edit, done, n);
    at += 7 + n;
    done += n;
    first = false;
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("rocksdb tier: cannot open ", path));
  const ssize_t w = ::write(fd, out.data(), out.size());
  const int synced = w == static_cast<ssize_t>(out.size()) ? ::fdatasync(fd) : -1;
  ::close(fd);
  if (synced != 0) {
    return absl::UnavailableError(absl::StrCat("rocksdb tier: cannot append to ", path));
  }
  return absl::OkStatus();
}

// The live tables of the (closed) database in `dir`, from a read-only open that does not check
// table files; empty when that open fails (a damaged MANIFEST, for one).
std::vector<rocksdb::LiveFileMetaData> LiveTables(const std::string& dir,
                                                  const rocksdb::DBOptions& options,
                                                  std::map<std::string, uint32_t>* family_ids) {
  rocksdb::DBOptions probe = options;
  probe.paranoid_checks = false;  // table files are not opened or checked
  probe.listeners.clear();
  probe.sst_file_manager = nullptr;
  std::vector<std::string> names;
  std::vector<rocksdb::LiveFileMetaData> live;
  if (!rocksdb::DB::ListColumnFamilies(probe, dir, &names).ok()) return live;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const auto& n : names) cfs.push_back({n, rocksdb::ColumnFamilyOptions()});
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  if (!rocksdb::DB::OpenForReadOnly(probe, dir, cfs, &handles, &raw).ok()) return live;
  std::unique_ptr<rocksdb::DB> db(raw);
  db->GetLiveFilesMetaData(&live);
  for (auto* h : handles) {
    if (family_ids != nullptr) (*family_ids)[h->GetName()] = h->GetID();
    db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
  }
  db->Close().PermitUncheckedError();
  return live;
}

// The first live table of the closed database in `dir` that does not read whole on its own
// (footer, index, properties, every block's checksum), "" when every one does. For a refused
// open whose error names no table ("properties unsorted in file .../MANIFEST-...").
std::string FindDamagedTable(const std::string& dir, const rocksdb::DBOptions& options) {
  for (const auto& f : LiveTables(dir, options, nullptr)) {
    rocksdb::SstFileReader reader{rocksdb::Options()};
    rocksdb::Status s = reader.Open(dir + "/" + f.relative_filename);
    if (s.ok()) s = reader.VerifyChecksum();
    if (s.IsCorruption()) return f.relative_filename;
  }
  return "";
}

// Takes a damaged table file out of the database while it is closed: finds its column family
// and level (a read-only open that does not check table files), appends an edit removing it to
// the MANIFEST, and moves the file to <dir>/damaged/ for inspection. What it did, for the log;
// NotFound when the file is not part of the database (any more).
absl::StatusOr<std::string> DropTable(const std::string& dir, const rocksdb::DBOptions& options,
                                      const std::string& file, const std::string& why,
                                      RocksDbTier::TableDamage* damage) {
  const uint64_t number = std::strtoull(file.c_str(), nullptr, 10);
  std::map<std::string, uint32_t> family_ids;
  std::optional<rocksdb::LiveFileMetaData> found;
  for (const auto& f : LiveTables(dir, options, &family_ids)) {
    if (f.file_number == number) found = f;
  }
  const uint32_t family_id = found ? family_ids[found->column_family_name] : 0;
  if (!found) {
    return absl::NotFoundError(absl::StrCat("rocksdb tier: ", file, " is not a live table"));
  }
  KVCOMP_RETURN_IF_ERROR(AppendTableDrop(dir, family_id, found->level, number));
  if (found->column_family_name == "payload") {
    damage->payload_ranges.emplace_back(found->smallestkey, found->largestkey);
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(dir) / "damaged", ec);
  std::filesystem::rename(std::filesystem::path(dir) / file,
                          std::filesystem::path(dir) / "damaged" / file, ec);
  const std::string entries =
      found->num_entries > 0 ? absl::StrCat(", ", found->num_entries, " entries") : "";
  return absl::StrCat(file, " (", found->column_family_name, ", level ", found->level, entries,
                      ") dropped", ec ? "" : " and kept in damaged/", ": ", why);
}
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

absl::Status FromRocksDb(const rocksdb::Status& s, absl::string_view context) {
  if (s.ok()) return absl::OkStatus();
  const std::string msg = absl::StrCat(context, ": ", s.ToString());
  if (s.IsNoSpace()) return DiskFullError(absl::StrCat("disk full: ", msg));
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsIOError()) return absl::UnavailableError(msg);
  if (s.IsInvalidArgument()) return absl::InvalidArgumentError(msg);
  return absl::InternalError(msg);
}

struct RocksDbTier::Db {
  std::unique_ptr<rocksdb::DB> db;
  std::shared_ptr<rocksdb::SstFileManager> sst_files;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;  // default, meta, payload, calib, quar.
  rocksdb::ColumnFamilyHandle* meta = nullptr;
  rocksdb::ColumnFamilyHandle* payload = nullptr;
  rocksdb::ColumnFamilyHandle* calibration = nullptr;
  rocksdb::ColumnFamilyHandle* quarantine = nullptr;
  rocksdb::ColumnFamilyHandle* direct = nullptr;  // null in a read-only open of a database
                                                  // made before the family existed
  bool read_only = false;

  ~Db() {
    if (db == nullptr) return;
    // RocksDB's close keeps unflushed memtables in the write-ahead log for the next open to
    // replay (seconds after a write burst): flush them, so a clean shutdown reopens at once.
    if (!read_only) {
      rocksdb::FlushOptions flush;
      flush.allow_write_stall = true;
      db->Flush(flush, handles).PermitUncheckedError();
    }
    for (auto* h : handles) db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    db->Close().PermitUncheckedError();
  }
};

namespace {

uint64_t FreeBytesUnder(const std::string& path) {
  struct statvfs sv;
  if (statvfs(path.c_str(), &sv) != 0) return UINT64_MAX;  // not measurable: RocksDB reports
  return uint64_t{sv.f_bavail} * sv.f_frsize;
}

// Bytes of the write-ahead log files under `path` (what a read-write open flushes).
uint64_t WalBytesUnder(const std::string& path) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(path, ec)) {
    if (f.path().extension() == ".log") {
      std::error_code size_ec;
      const uintmax_t n = f.file_size(size_ec);
      if (!size_ec) total += n;
    }
  }
  return total;
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

RocksDbTier::RocksDbTier(const RocksDbTierOptions& options)
    : options_(options),
      capacity_(options.capacity_bytes),
      reserve_(options.reserve_bytes),
      max_space_(options.max_space_bytes != 0 ? options.max_space_bytes
                                              : 2 * options.capacity_bytes + (1ull << 30)) {}

RocksDbTier::~RocksDbTier() { StopRepairs(); }

void RocksDbTier::EnableRepairs(DamageHandler handler) {
  if (repairer_.joinable()) return;
  damage_handler_ = std::move(handler);
  repairer_ = std::thread([this] { RepairLoop(); });
}

void RocksDbTier::StopRepairs() {
  {
    std::lock_guard<std::mutex> lock(damage_->mu);
    damage_->stop = true;
    damage_->cv.notify_all();
  }
  if (repairer_.joinable()) repairer_.join();
}

uint64_t RocksDbTier::background_corruptions() const {
  std::lock_guard<std::mutex> lock(damage_->mu);
  return damage_->events;
}

std::string RocksDbTier::last_repair() const {
  std::lock_guard<std::mutex> lock(repair_report_mu_);
  return last_repair_;
}

void RocksDbTier::RepairLoop() {
  // A compaction that still fails after a pass is retried by RocksDB about once a second; passes
  // that find nothing new back off (1 s doubling to 64 s) so a damage the pass cannot reach does
  // not turn into a read of every payload each second.
  int64_t backoff_ms = 1000;
  std::unique_lock<std::mutex> lock(damage_->mu);
  while (true) {
    damage_->cv.wait(lock, [this] { return damage_->stop || damage_->pending; });
    if (damage_->stop) return;
    damage_->pending = false;
    lock.unlock();
    const uint64_t before = repaired_quarantined_.load();
    RepairPass();
    const bool found = repaired_quarantined_.load() != before;
    backoff_ms = found ? 1000 : std::min<int64_t>(backoff_ms * 2, 64000);
    lock.lock();
    damage_->cv.wait_for(lock, std::chrono::milliseconds(backoff_ms),
                         [this] { return damage_->stop; });
    if (damage_->stop) return;
  }
}

void RocksDbTier::RepairPass() {
  std::shared_ptr<Db> db = this->db();
  if (db->read_only) return;
  struct Bad {
    std::string key, meta_bytes, reason;
    CacheMeta meta;
  };
  std::vector<Bad> bad;
  uint64_t checked = 0;
  {
    std::unique_ptr<rocksdb::Iterator> it(db->db->NewIterator(rocksdb::ReadOptions(), db->meta));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const absl::string_view key(it->key().data(), it->key().size());
      Bad b{std::string(key), it->value().ToString(), "", CacheMeta()};
      ++checked;
      auto meta = DecodeMeta(b.meta_bytes);
      if (!meta.ok()) {
        b.reason = meta.status().ToString();
      } else {
        b.meta = *meta;
        auto payload = GetFrom(*db, key);
        if (!payload.ok()) {
          b.reason = absl::StrCat("payload unreadable: ", payload.status().ToString());
        } else if (payload->size() != meta->stored_bytes ||
                   Crc32c(payload->data(), payload->size()) != meta->crc32c) {
          b.reason = "payload checksum mismatch";
        }
      }
      if (!b.reason.empty()) bad.push_back(std::move(b));
    }
  }
  uint64_t quarantined = 0;
  for (Bad& b : bad) {
    const std::string reason = absl::StrCat(b.reason, " (found after a compaction met damage)");
    if (damage_handler_ && damage_handler_(b.key, b.meta, reason)) {
      ++quarantined;
      continue;
    }
    Stripe& st = StripeOf(b.key);
    WriterLock lock(&st.mu);
    auto done = QuarantineLocked(*db, st, b.key, reason, &b.meta_bytes);
    if (done.ok() && *done) ++quarantined;
  }
  repaired_quarantined_ += quarantined;
  // The quarantine's deletes reach the damaged references only when a compaction takes both:
  // flush them and compact the whole payload family, level by level.
  rocksdb::FlushOptions flush;
  flush.allow_write_stall = true;
  rocksdb::Status s = db->db->Flush(flush, db->payload);
  rocksdb::CompactRangeOptions cro;
  cro.exclusive_manual_compaction = false;
  if (s.ok()) s = db->db->CompactRange(cro, db->payload, nullptr, nullptr);
  std::string error;
  {
    std::lock_guard<std::mutex> lock(damage_->mu);
    error = damage_->last_error;
  }
  std::lock_guard<std::mutex> lock(repair_report_mu_);
  last_repair_ = absl::StrCat("rocksdb tier: a compaction met damaged data (", error, "); ",
                              checked, " payloads read, ", quarantined,
                              " quarantined; compaction after the repair: ",
                              s.ok() ? "OK" : s.ToString());
  // Counted once the pass is done and reported: repairs() > n means last_repair() tells it.
  repairs_ += 1;
}

std::shared_ptr<RocksDbTier::Db> RocksDbTier::db() const { return std::atomic_load(&db_); }

bool RocksDbTier::read_only() const { return db()->read_only; }

std::string RocksDbTier::read_only_reason() const {
  ReaderLock lock(&reopen_mu_);
  return db()->read_only ? read_only_reason_ : std::string();
}

uint64_t RocksDbTier::free_bytes() const {
  const uint64_t free = FreeBytesUnder(options_.path);
  return free == UINT64_MAX ? 0 : free;
}

uint64_t RocksDbTier::BytesToOpenWritable() const {
  return reserve_ + WalBytesUnder(options_.path);
}

absl::StatusOr<std::shared_ptr<RocksDbTier::Db>> RocksDbTier::OpenDb(
    const RocksDbTierOptions& o, const std::shared_ptr<rocksdb::Cache>& block_cache,
    bool read_only, const std::shared_ptr<DamageSignal>& damage, LogDamage* log_damage,
    TableDamage* table_damage) {
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = o.create_if_missing;
  db_options.create_missing_column_families = o.create_if_missing;
  db_options.max_background_jobs = o.max_background_jobs;
  db_options.bgerror_resume_retry_interval = 100000;  // us: retry after a write error quickly
  // The log is kept until every column family with writes in it is flushed; the small ones
  // (meta, calibration) would keep the payloads' logs for gigabytes. Past this size RocksDB
  // flushes the families that hold the oldest log, which bounds what a crash leaves to replay.
  db_options.max_total_wal_size = o.max_wal_bytes;
  // Every flush takes all the families together, so the small ones (meta, direct) never keep a
  // log alive after the payload family's memtable that shares it is flushed: what a crash leaves
  // to replay is about one payload memtable, not max_wal_bytes.
  db_options.atomic_flush = true;
  // A restart after a crash replays the log into memtables and leaves them there (the log files
  // stay until a later flush retires them, so nothing acknowledged depends on the open's own
  // writes) instead of writing them out as table and blob files before the open returns: the
  // time to ready is the log's read, not a flush and sync of its bytes.
  db_options.avoid_flush_during_recovery = true;
  // A damaged record in the middle of a log (a media fault; a crash only tears the tail) is
  // skipped and the replay goes on. RocksDB's default, point-in-time recovery, stops there and
  // drops every later log, acknowledged writes included, and refuses the open outright ("SST file
  // is ahead of WALs") when a family has been flushed past the damaged log (the always-empty
  // quarantine family moves past every replayed log). Skipping is safe here: every write of the
  // tier is one WriteBatch (a put's meta, payload and direct-file name together; a quarantine's
  // move; a delete), so each is whole or absent, and a payload is served only after its CRC32C
  // matches its meta. What a skipped record held reads as absent: a put lost, or a delete or
  // overwrite undone (the older cache is served again, whole and checked).
  db_options.wal_recovery_mode = rocksdb::WALRecoveryMode::kSkipAnyCorruptedRecords;
  std::shared_ptr<LogDamageWatch> watch;
  if (log_damage != nullptr) {
    std::shared_ptr<rocksdb::Logger> info_log;
    if (rocksdb::CreateLoggerFromOptions(o.path, db_options, &info_log).ok() &&
        info_log != nullptr) {
      watch = std::make_shared<LogDamageWatch>(std::move(info_log));
      db_options.info_log = watch;
    }
  }
  // Space is admitted against statvfs; preallocated (fallocate'd) WAL and table files would make
  // the measured free space lie, and fail outright on a small volume.
  db_options.allow_fallocate = false;
  if (o.env != nullptr) db_options.env = o.env;
  db_options.listeners.push_back(std::make_shared<ManualRecovery>());
  DamageSignal* signal = damage.get();
  db_options.listeners.push_back(
      std::make_shared<DamageListener>(damage, [signal, o](const std::string& error) {
        if (o.env == nullptr) NoteDamagedTable(o.path, error);
        std::lock_guard<std::mutex> lock(signal->mu);
        if (!signal->enabled) return false;
        signal->events += 1;
        signal->last_error = error;
        signal->pending = true;
        signal->cv.notify_all();
        return true;
      }));
  auto db = std::make_shared<Db>();
  db->read_only = read_only;
  if (!read_only) {
    rocksdb::Status sfm_status;
    db->sst_files.reset(rocksdb::NewSstFileManager(db_options.env, nullptr, "", 0, true,
                                                   &sfm_status));
    if (!sfm_status.ok()) return FromRocksDb(sfm_status, "rocksdb tier: sst file manager");
    db->sst_files->SetMaxAllowedSpaceUsage(
        o.max_space_bytes != 0 ? o.max_space_bytes : 2 * o.capacity_bytes + (1ull << 30));
    db->sst_files->SetCompactionBufferSize(o.reserve_bytes);
    db_options.sst_file_manager = db->sst_files;
  }

  rocksdb::ColumnFamilyOptions base;
  base.compression = rocksdb::kNoCompression;
  base.write_buffer_size = o.write_buffer_bytes;
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = block_cache;
  base.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::ColumnFamilyOptions payload = base;
  payload.enable_blob_files = o.enable_blob_files;
  payload.min_blob_size = o.min_blob_size;
  payload.blob_compression_type = rocksdb::kNoCompression;
  payload.enable_blob_garbage_collection = true;
  // While the log is replayed the payload family's memtable may have to hold all the log holds
  // (up to max_wal_bytes): one that fills during the replay is flushed inside Open, and then
  // every family is. Opened with room for the whole log; the configured size is set once the
  // database is open, and the first write after it flushes what was replayed. (The other
  // families' records are small next to their memtables.)
  if (!read_only) payload.write_buffer_size = o.write_buffer_bytes + o.max_wal_bytes;

  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, base},
      {"meta", base},
      {"payload", payload},
      {"calibration", base},
      {"quarantine", base},
  };
  // The "direct" family, except in a read-only open of a database made without it.
  bool with_direct = true;
  if (read_only) {
    std::vector<std::string> names;
    if (rocksdb::DB::ListColumnFamilies(db_options, o.path, &names).ok()) {
      with_direct = std::find(names.begin(), names.end(), "direct") != names.end();
    }
  }
  if (with_direct) cfs.push_back({"direct", base});
  rocksdb::DB* raw = nullptr;
  if (watch != nullptr) watch->Watch(true);
  rocksdb::Status s =
      read_only ? rocksdb::DB::OpenForReadOnly(db_options, o.path, cfs, &db->handles, &raw)
                : rocksdb::DB::Open(db_options, o.path, cfs, &db->handles, &raw);
  // RocksDB 7.8 refuses the open after a damaged record of several fragments (FindDamagedLog
  // says why): the damaged log is cut where the damage starts, and the open tried again (once
  // per damaged log). Only on the real filesystem, and not by a read-only open.
  std::vector<LogCut> cuts;
  while (!s.ok() && s.IsCorruption() && !read_only && o.env == nullptr && cuts.size() < 16 &&
         absl::StrContains(s.ToString(), "Write batch content corrupted")) {
    std::optional<LogCut> cut = FindDamagedLog(o.path);
    if (!cut) break;
    std::error_code ec;
    std::filesystem::resize_file(std::filesystem::path(o.path) / cut->file, cut->at, ec);
    if (ec) break;
    cuts.push_back(*cut);
    if (watch != nullptr) watch->Reset();  // what the refused open reported is replayed again
    db->handles.clear();
    raw = nullptr;
    s = rocksdb::DB::Open(db_options, o.path, cfs, &db->handles, &raw);
  }
  // A table file the open cannot read (its footer, index or properties damaged, or the file cut
  // short: "Sst file size mismatch") is taken out of the database and the open tried again.
  while (!s.ok() && s.IsCorruption() && !read_only && o.env == nullptr &&
         table_damage != nullptr && table_damage->tables < 16) {
    std::string table = DamagedTableIn(s.ToString());
    if (table.empty()) table = FindDamagedTable(o.path, ProbeOptions());
    if (table.empty()) break;
    auto dropped = DropTable(o.path, ProbeOptions(), table, s.ToString(), table_damage);
    if (!dropped.ok()) {
      s = rocksdb::Status::Corruption(s.ToString(), std::string(dropped.status().message()));
      break;
    }
    table_damage->tables += 1;
    table_damage->last = *dropped;
    if (watch != nullptr) watch->Reset();
    db->handles.clear();
    raw = nullptr;
    s = rocksdb::DB::Open(db_options, o.path, cfs, &db->handles, &raw);
  }
  if (watch != nullptr) {
    watch->Watch(false);
    *log_damage = watch->Damage();
    for (const LogCut& cut : cuts) {
      log_damage->regions += 1;
      log_damage->bytes += cut.size - cut.at;
      log_damage->last = absl::StrCat(cut.file, ": cut from ", cut.size, " to ", cut.at,
                                      " bytes (a damaged record of several fragments)");
    }
  }
  if (!s.ok()) {
    return FromRocksDb(s, absl::StrCat("rocksdb tier: open ", o.path,
                                       read_only ? " read-only" : ""));
  }
  db->db.reset(raw);
  db->meta = db->handles[1];
  db->payload = db->handles[2];
  db->calibration = db->handles[3];
  db->quarantine = db->handles[4];
  if (with_direct) db->direct = db->handles[5];
  if (!read_only) {
    s = db->db->SetOptions(db->payload,
                           {{"write_buffer_size", std::to_string(o.write_buffer_bytes)}});
    if (!s.ok()) return FromRocksDb(s, "rocksdb tier: set the write buffer size after open");
    // The replay skipped damaged records: write out what it recovered now, so the damaged log
    // is retired (a later open neither meets nor reports it again). Rare; it costs this open a
    // flush.
    if (log_damage != nullptr && log_damage->regions > 0) {
      rocksdb::FlushOptions flush;
      flush.allow_write_stall = true;
      s = db->db->Flush(flush, db->handles);
      if (!s.ok()) return FromRocksDb(s, "rocksdb tier: flush after a damaged log");
    }
  }
  return db;
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
  std::unique_ptr<RocksDbTier> tier(new RocksDbTier(o));
  tier->block_cache_ = rocksdb::NewLRUCache(o.block_cache_bytes);
  tier->fs_ = (o.env != nullptr ? o.env : rocksdb::Env::Default())->GetFileSystem();
  tier->direct_dir_ = o.path + "/direct";
  // A read-write open replays the WAL into new table files and writes a new manifest, WAL and
  // options file: on a disk without room for them it would fail, or abort inside RocksDB. Then
  // the database opens read-only, and writes wait for space.
  const uint64_t free = FreeBytesUnder(o.path);
  const uint64_t needed = tier->BytesToOpenWritable();
  std::string reason;
  absl::StatusOr<std::shared_ptr<Db>> db = absl::UnavailableError("not opened");
  const bool exists = std::filesystem::exists(std::filesystem::path(o.path) / "CURRENT");
  if (exists && free < needed) {
    reason = absl::StrCat("disk full at open: ", free, " bytes free under ", o.path, ", ", needed,
                          " needed to open read-write (reserve ", o.reserve_bytes,
                          " plus the write-ahead log)");
  } else {
    if (exists && o.env == nullptr) {
      // A MANIFEST cut off inside its last record opens without that edit (RocksDB reads the
      // part record as a crash's torn tail): said, since a cut of a whole edit that had taken
      // effect loses the tables it added.
      auto manifest = ReadManifest(o.path);
      if (manifest.ok() && manifest->torn_at != UINT64_MAX) {
        tier->table_damage_.manifest_tails += 1;
        tier->table_damage_.last_manifest_tail = absl::StrCat(
            manifest->name, " ends in part of a record (", manifest->bytes.size() -
            manifest->torn_at, " bytes from byte ", manifest->torn_at,
            "): RocksDB ignores that edit; left by a crash while RocksDB wrote it this loses "
            "nothing, but if the file was cut short the tables the edit added are no longer "
            "served (their caches are misses)");
      }
    }
    db = OpenDb(o, tier->block_cache_, /*read_only=*/false, tier->damage_, &tier->log_damage_,
                &tier->table_damage_);
    // Only for lack of space: a database locked by another process must not be served stale.
    if (!db.ok() && exists && absl::IsResourceExhausted(db.status())) {
      reason = absl::StrCat("read-write open failed: ", db.status().message());
    }
  }
  if (!reason.empty()) {
    db = OpenDb(o, tier->block_cache_, /*read_only=*/true, tier->damage_);
    if (db.ok()) {
      WriterLock lock(&tier->reopen_mu_);
      tier->read_only_reason_ = reason;
      tier->last_reopen_ms_ = NowMs();
    }
  }
  // A table file that the open or the scans below find damaged (a media fault), or that a get or
  // a compaction met while the database was open (noted in <path>/damaged/pending), is taken out
  // of the database (DropTable) and the database opened again. What can still be read of it is
  // written again first (Salvage), so only the records in its damaged blocks are lost (misses; a
  // delete or overwrite recorded there is undone); every other table is served as before. Only
  // read-write opens on the real filesystem, at most 16 tables per start.
  std::vector<std::string> pending;
  if (db.ok() && !(*db)->read_only && o.env == nullptr) pending = tier->PendingTables();
  const size_t noted = pending.size();
  for (int drops = 0;; ++drops) {
    if (!db.ok()) return db.status();
    tier->db_ = *std::move(db);
    const bool writable = !tier->db_->read_only && o.env == nullptr && drops < 16;
    absl::Status scanned = tier->ScanAtOpen();
    std::string table, why;
    if (!scanned.ok()) {
      if (writable && absl::IsDataLoss(scanned)) {
        table = DamagedTableIn(std::string(scanned.message()));
        if (table.empty()) {
          tier->db_.reset();
          table = FindDamagedTable(o.path, ProbeOptions());
          if (table.empty()) return scanned;
          LogDamage more;
          db = OpenDb(o, tier->block_cache_, /*read_only=*/false, tier->damage_, &more,
                      &tier->table_damage_);
          if (!db.ok()) return db.status();
          tier->log_damage_.regions += more.regions;
          tier->log_damage_.bytes += more.bytes;
          tier->db_ = *std::move(db);
        }
      }
      if (table.empty()) return scanned;
      why = std::string(scanned.message());
    } else if (writable) {
      while (table.empty() && !pending.empty()) {
        if (tier->IsLiveTable(pending.back())) table = pending.back();
        pending.pop_back();
      }
      why = "a get or a compaction met its damage while the database was open";
    }
    if (table.empty()) break;
    auto salvaged = tier->Salvage(table);
    if (salvaged.ok()) tier->table_damage_.salvaged += *salvaged;
    tier->db_.reset();  // closed: the MANIFEST is edited while no instance has it open
    tier->ForgetAll();
    auto dropped = DropTable(o.path, ProbeOptions(), table, why, &tier->table_damage_);
    if (!dropped.ok()) {
      return absl::DataLossError(absl::StrCat(why, " (dropping the table: ",
                                              dropped.status().message(), ")"));
    }
    tier->table_damage_.tables += 1;
    tier->table_damage_.last = *dropped;
    if (salvaged.ok() && *salvaged > 0) {
      absl::StrAppend(&tier->table_damage_.last, " (", *salvaged,
                      " readable record(s) of it written again first)");
    }
    LogDamage more;
    db = OpenDb(o, tier->block_cache_, /*read_only=*/false, tier->damage_, &more,
                &tier->table_damage_);
    tier->log_damage_.regions += more.regions;
    tier->log_damage_.bytes += more.bytes;
    if (!more.last.empty()) tier->log_damage_.last = more.last;
  }
  if (noted > 0 && pending.empty()) {
    std::error_code ec;
    std::filesystem::remove(o.path + "/damaged/pending", ec);
  }
  if (tier->table_damage_.tables > 0 && !tier->db_->read_only) {
    tier->RemoveOrphans().IgnoreError();  // cleanup: what stays only takes space
  }
  if (!tier->db_->read_only) {
    KVCOMP_RETURN_IF_ERROR(tier->RemoveUnnamedDirectFiles(*tier->db_));
  }
  return tier;
}

absl::Status RocksDbTier::ScanAtOpen() {
  // Sizes for accounting come from the meta records (small); payloads are checked by Recover.
  const Db& d = *db_;
  std::unique_ptr<rocksdb::Iterator> it(d.db->NewIterator(rocksdb::ReadOptions(), d.meta));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto meta = DecodeMeta(absl::string_view(it->value().data(), it->value().size()));
    const uint64_t n = meta.ok() ? meta->stored_bytes : 0;
    const absl::string_view key(it->key().data(), it->key().size());
    Stripe& st = StripeOf(key);
    WriterLock lock(&st.mu);
    st.sizes[std::string(key)] = n;
    used_ += n;
    entries_ += 1;
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "rocksdb tier: scan meta"));
  if (d.direct != nullptr) {
    std::unique_ptr<rocksdb::Iterator> f(d.db->NewIterator(rocksdb::ReadOptions(), d.direct));
    for (f->SeekToFirst(); f->Valid(); f->Next()) {
      std::string name;
      uint64_t size = 0;
      if (!DecodeDirectRecord(absl::string_view(f->value().data(), f->value().size()), &name,
                              &size)) {
        continue;  // unreadable record: the key's Get fails and Recover quarantines it
      }
      const absl::string_view key(f->key().data(), f->key().size());
      Stripe& st = StripeOf(key);
      WriterLock lock(&st.mu);
      st.files[std::string(key)] = std::move(name);
    }
    KVCOMP_RETURN_IF_ERROR(FromRocksDb(f->status(), "rocksdb tier: scan direct"));
  }
  // The quarantine and calibration families are read through too, so a damaged table of theirs
  // is met here (and dropped) rather than by a later call.
  for (rocksdb::ColumnFamilyHandle* family : {d.quarantine, d.calibration}) {
    std::unique_ptr<rocksdb::Iterator> q(d.db->NewIterator(rocksdb::ReadOptions(), family));
    for (q->SeekToFirst(); q->Valid(); q->Next()) {
    }
    KVCOMP_RETURN_IF_ERROR(FromRocksDb(q->status(), "rocksdb tier: scan " + family->GetName()));
  }
  return absl::OkStatus();
}

std::vector<std::string> RocksDbTier::PendingTables() const {
  std::ifstream in(options_.path + "/damaged/pending");
  std::vector<std::string> tables;
  for (std::string t; std::getline(in, t);) {
    if (!t.empty() && std::find(tables.begin(), tables.end(), t) == tables.end()) {
      tables.push_back(t);
    }
  }
  return tables;
}

bool RocksDbTier::IsLiveTable(const std::string& table) const {
  const uint64_t number = std::strtoull(table.c_str(), nullptr, 10);
  std::vector<rocksdb::LiveFileMetaData> live;
  db_->db->GetLiveFilesMetaData(&live);
  for (const auto& f : live) {
    if (f.file_number == number) return true;
  }
  return false;
}

absl::StatusOr<uint64_t> RocksDbTier::Salvage(const std::string& table) {
  Db& d = *db_;
  if (d.read_only) return 0;
  const uint64_t number = std::strtoull(table.c_str(), nullptr, 10);
  std::vector<rocksdb::LiveFileMetaData> live;
  d.db->GetLiveFilesMetaData(&live);
  const rocksdb::LiveFileMetaData* file = nullptr;
  for (const auto& f : live) {
    if (f.file_number == number) file = &f;
  }
  if (file == nullptr) return 0;
  rocksdb::ColumnFamilyHandle* family = nullptr;
  for (auto* h : d.handles) {
    if (h->GetName() == file->column_family_name) family = h;
  }
  if (family == nullptr || (family != d.meta && family != d.payload && family != d.direct)) {
    return 0;  // the quarantine and calibration families are not salvaged
  }
  // The keys the table may hold: those of the other families in its key range (a cache's
  // meta, payload and direct-file records share its key).
  const rocksdb::Slice smallest(file->smallestkey), largest(file->largestkey);
  std::vector<std::string> keys;
  if (family == d.payload) {
    // Its records are mostly references to blob files, which a table read alone cannot
    // follow: the keys are the meta family's in its range (small records).
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(d.db->NewIterator(ro, d.meta));
    for (it->Seek(smallest); it->Valid() && it->key().compare(largest) <= 0; it->Next()) {
      keys.push_back(it->key().ToString());
    }
    it->status().PermitUncheckedError();  // a damaged meta block: fewer keys salvaged
  } else {
    // The table itself, read alone: forward up to its damaged block and backward down to it.
    rocksdb::SstFileReader reader{rocksdb::Options()};
    if (reader.Open(options_.path + "/" + file->relative_filename).ok()) {
      rocksdb::ReadOptions ro;
      ro.fill_cache = false;
      std::unique_ptr<rocksdb::Iterator> it(reader.NewIterator(ro));
      for (it->SeekToFirst(); it->Valid(); it->Next()) keys.push_back(it->key().ToString());
      it->status().PermitUncheckedError();
      it.reset(reader.NewIterator(ro));
      for (it->SeekToLast(); it->Valid(); it->Prev()) keys.push_back(it->key().ToString());
      it->status().PermitUncheckedError();
    }
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  rocksdb::WriteBatch batch;
  uint64_t n = 0;
  for (const std::string& key : keys) {
    std::string value;
    rocksdb::Status s = d.db->Get(rocksdb::ReadOptions(), family, key, &value);
    if (!s.ok()) continue;  // in a damaged block (lost) or not in this family
    if (!batch.Put(family, key, value).ok()) continue;
    ++n;
  }
  if (n == 0) return 0;
  KVCOMP_RETURN_IF_ERROR(Write(&batch, /*sync=*/true, "salvage", WriteKind::kAdds));
  // Written out as new tables, so the records no longer depend on the damaged one.
  rocksdb::FlushOptions flush;
  flush.allow_write_stall = true;
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(d.db->Flush(flush, d.handles), "rocksdb tier: flush"));
  return n;
}

void RocksDbTier::ForgetAll() {
  for (Stripe& st : stripes_) {
    WriterLock lock(&st.mu);
    st.sizes.clear();
    st.files.clear();
  }
  used_ = 0;
  entries_ = 0;
}

absl::Status RocksDbTier::RemoveOrphans() {
  Db& d = *db_;
  rocksdb::WriteBatch batch;
  std::vector<std::string> files;
  uint64_t orphans = 0;
  // The direct family (small records), and below the payload family only where a payload
  // table was taken out. Other payload records left without their meta (a meta table's loss)
  // stay: they are never served (the index comes from the meta family) and a later put or
  // delete of the key replaces them.
  for (rocksdb::ColumnFamilyHandle* family : {d.direct}) {
    if (family == nullptr) continue;
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(d.db->NewIterator(ro, family));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const absl::string_view key(it->key().data(), it->key().size());
      Stripe& st = StripeOf(key);
      {
        ReaderLock lock(&st.mu);
        if (st.sizes.contains(key)) continue;
      }
      if (family == d.direct) {
        std::string name;
        uint64_t size = 0;
        if (DecodeDirectRecord(absl::string_view(it->value().data(), it->value().size()), &name,
                               &size)) {
          files.push_back(std::move(name));
        }
      }
      batch.Delete(family, it->key()).PermitUncheckedError();
      ++orphans;
    }
    // Cleanup only: a damaged block or blob met here ends this family's list (the records
    // after it stay), never the open; a damaged table is noted for the next open.
    if (it->status().IsCorruption() && options_.env == nullptr) {
      NoteDamagedTable(options_.path, it->status().ToString());
    }
  }
  // Payload records in the key range of a payload table taken out: older records it hid (a
  // delete's tombstone was there) are back without their meta; removed, so a later fault that
  // takes out the meta family's tombstone cannot bring the deleted cache back. Read as internal
  // records (keys and blob references, never the blob files), 256 at a time.
  for (const auto& [smallest, largest] : table_damage_.payload_ranges) {
    std::string begin = smallest;
    while (true) {
      std::vector<rocksdb::KeyVersion> versions;
      rocksdb::Status s = rocksdb::GetAllKeyVersions(d.db.get(), d.payload, begin, largest, 256,
                                                     &versions);
      if (!s.ok() || versions.empty()) break;
      std::string previous;
      bool first = true;
      for (const rocksdb::KeyVersion& v : versions) {
        if (!first && v.user_key == previous) continue;  // an older record of the same key
        first = false;
        previous = v.user_key;
        // The newest record: a value (1) or a blob reference (17) with no meta is an orphan.
        if (v.type != 1 && v.type != 17) continue;
        Stripe& st = StripeOf(v.user_key);
        {
          ReaderLock lock(&st.mu);
          if (st.sizes.contains(v.user_key)) continue;
        }
        batch.Delete(d.payload, v.user_key).PermitUncheckedError();
        ++orphans;
      }
      if (versions.size() < 256) break;
      begin = versions.back().user_key + std::string(1, '\0');
    }
  }
  table_damage_.payload_ranges.clear();
  if (orphans == 0) return absl::OkStatus();
  KVCOMP_RETURN_IF_ERROR(Write(&batch, /*sync=*/true, "remove orphans", WriteKind::kRemoves));
  for (const std::string& f : files) RemoveDirectFile(f);
  table_damage_.orphans += orphans;
  return absl::OkStatus();
}

bool RocksDbTier::TryReopenWritable() {
  if (!db()->read_only) return true;
  const int64_t now = NowMs();
  int64_t last = last_reopen_ms_.load();
  if (now - last < 1000 || !last_reopen_ms_.compare_exchange_strong(last, now)) return false;
  WriterLock lock(&reopen_mu_);
  if (!db()->read_only) return true;
  const uint64_t free = FreeBytesUnder(options_.path);
  const uint64_t needed = BytesToOpenWritable();
  if (free < needed) {
    read_only_reason_ = absl::StrCat("disk full: ", free, " bytes free under ", options_.path,
                                     ", ", needed, " needed to reopen read-write");
    return false;
  }
  auto writable = OpenDb(options_, block_cache_, /*read_only=*/false, damage_);
  if (!writable.ok()) {
    read_only_reason_ = absl::StrCat("reopen read-write failed: ", writable.status().message());
    return false;
  }
  std::atomic_store(&db_, *std::move(writable));
  read_only_reason_.clear();
  needs_resume_.store(false);
  return true;
}

RocksDbTier::Stripe& RocksDbTier::StripeOf(absl::string_view key) {
  return stripes_[absl::Hash<absl::string_view>()(key) % kStripes];
}

void RocksDbTier::ForgetSize(Stripe& st, absl::string_view key) {
  auto it = st.sizes.find(key);
  if (it != st.sizes.end()) {
    used_ -= it->second;
    entries_ -= 1;
    st.sizes.erase(it);
  }
}

absl::Status RocksDbTier::AdmitWrite(Db& db, uint64_t bytes, WriteKind kind) const {
  const uint64_t free = FreeBytesUnder(options_.path);
  if (free == UINT64_MAX) return absl::OkStatus();
  uint64_t unflushed = 0;
  if (kind == WriteKind::kAdds) {
    db.db->GetAggregatedIntProperty(rocksdb::DB::Properties::kCurSizeAllMemTables, &unflushed);
  }
  // Adds: the bytes go to the WAL now and to table or blob files at the flush, which also writes
  // what the memtables hold already. Removes need little; they keep half the reserve.
  const uint64_t needed =
      kind == WriteKind::kAdds ? 2 * bytes + unflushed + reserve_ : bytes + reserve_ / 2;
  if (free < needed) {
    return DiskFullError(absl::StrCat(
        "disk full: ", free, " bytes free under ", options_.path, ", ", needed,
        " needed (write of ", bytes, ", unflushed ", unflushed, ", reserve ", reserve_,
        "); writes resume when space returns"));
  }
  if (kind == WriteKind::kAdds && db.sst_files != nullptr &&
      db.sst_files->GetTotalSize() + 2 * bytes + unflushed > max_space_) {
    return DiskFullError(absl::StrCat(
        "disk full: RocksDB files hold ", db.sst_files->GetTotalSize(), " bytes of their bound ",
        max_space_, "; writes resume once compaction reclaims space"));
  }
  return absl::OkStatus();
}

absl::Status RocksDbTier::Write(void* batch_ptr, bool sync, absl::string_view what,
                                WriteKind kind) {
  auto* batch = static_cast<rocksdb::WriteBatch*>(batch_ptr);
  std::shared_ptr<Db> db = this->db();
  if (db->read_only) {
    if (!TryReopenWritable()) {
      return DiskFullError(
          absl::StrCat("disk full: rocksdb tier: ", what, " refused, the database is open "
                       "read-only (", read_only_reason(), "); writes resume when space returns"));
    }
    db = this->db();
  }
  KVCOMP_RETURN_IF_ERROR(AdmitWrite(*db, batch->GetDataSize(), kind));
  if (needs_resume_.load()) {
    // A write failed earlier (e.g. disk full) and RocksDB stopped writes. Ask it to go on; Busy
    // means its own recovery is running, and the write below tells whether it is done.
    if (db->db->Resume().ok()) needs_resume_.store(false);
  }
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  rocksdb::Status s = db->db->Write(wo, batch);
  if (!s.ok()) {
    needs_resume_.store(true);
    return FromRocksDb(s, absl::StrCat("rocksdb tier: ", what));
  }
  return absl::OkStatus();
}

absl::Status RocksDbTier::Put(absl::string_view key, const CacheMeta& meta, const Payload& payload,
                              bool sync) {
  if (payload.on_device()) {
    return absl::InvalidArgumentError("rocksdb tier: payload in device memory");
  }
  Stripe& st = StripeOf(key);
  WriterLock lock(&st.mu);
  auto it = st.sizes.find(key);
  const uint64_t old = it == st.sizes.end() ? 0 : it->second;
  const uint64_t n = payload.size();
  const uint64_t used = used_.load();
  if (used - old + n > capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat("rocksdb tier: ", n, " bytes do not fit (",
                                                     used, " of ", capacity_, " used)"));
  }
  std::shared_ptr<Db> db = this->db();
  const bool direct = options_.direct_min_bytes != 0 && n >= options_.direct_min_bytes;
  std::string file;  // the new direct file, if any
  if (direct) {
    if (db->read_only && !TryReopenWritable()) {
      return DiskFullError(
          absl::StrCat("disk full: rocksdb tier: put refused, the database is open read-only (",
                       read_only_reason(), "); writes resume when space returns"));
    }
    db = this->db();
    // The payload is written once (no WAL copy, no flush copy): its bytes plus the reserve.
    const uint64_t free = FreeBytesUnder(options_.path);
    if (free != UINT64_MAX && free < n + reserve_) {
      return DiskFullError(
          absl::StrCat("disk full: ", free, " bytes free under ", options_.path, ", ", n + reserve_,
                       " needed (direct write of ", n, ", reserve ", reserve_,
                       "); writes resume when space returns"));
    }
    KVCOMP_ASSIGN_OR_RETURN(file, WriteDirectFile(payload));
  }
  auto old_file = st.files.find(key);
  CacheMeta m = meta;
  m.tier = TierKind::kRocksDb;
  m.stored_bytes = n;
  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Put(db->meta, ToSlice(key), EncodeMeta(m));
  if (direct) {
    if (s.ok()) s = batch.Put(db->direct, ToSlice(key), EncodeDirectRecord(file, n));
    if (s.ok()) s = batch.Delete(db->payload, ToSlice(key));
  } else {
    if (s.ok()) s = batch.Put(db->payload, ToSlice(key), ToSlice(payload.view()));
    if (s.ok() && old_file != st.files.end() && db->direct != nullptr) {
      s = batch.Delete(db->direct, ToSlice(key));
    }
  }
  absl::Status written = FromRocksDb(s, "rocksdb tier: batch");
  // A direct put's record is synced whatever `sync` asks: its file is durable already, and a
  // record lost in a crash would only leave the file to be removed at the next Open.
  if (written.ok()) written = Write(&batch, sync || direct, "put", WriteKind::kAdds);
  if (!written.ok()) {
    if (direct) RemoveDirectFile(file);
    return written;
  }
  if (old_file != st.files.end()) {
    RemoveDirectFile(old_file->second);
    st.files.erase(old_file);
  }
  if (direct) st.files[std::string(key)] = std::move(file);
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

absl::StatusOr<std::string> RocksDbTier::TakeDirectName() {
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (direct_pool_.empty()) {
    const rocksdb::IOOptions io;
    KVCOMP_RETURN_IF_ERROR(
        FromIo(fs_->CreateDirIfMissing(direct_dir_, io, nullptr), "rocksdb tier: direct dir"));
    std::vector<std::string> made;
    auto drop = [&] {
      for (const std::string& n : made) RemoveDirectFile(n);
    };
    for (int i = 0; i < kDirectPoolBatch; ++i) {
      const std::string name = absl::StrFormat(
          "%016x-%06x%s",
          static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()),
          direct_seq_.fetch_add(1) & 0xffffff, kDirectSuffix);
      std::unique_ptr<rocksdb::FSWritableFile> f;
      rocksdb::IOStatus s =
          fs_->NewWritableFile(direct_dir_ + "/" + name, rocksdb::FileOptions(), &f, nullptr);
      if (s.ok()) s = f->Close(io, nullptr);
      if (!s.ok()) {
        drop();
        return FromIo(s, "rocksdb tier: direct file");
      }
      made.push_back(name);
    }
    // The names in their directory, durably, once for the batch.
    std::unique_ptr<rocksdb::FSDirectory> dir;
    rocksdb::IOStatus s = fs_->NewDirectory(direct_dir_, io, &dir, nullptr);
    if (s.ok()) s = dir->Fsync(io, nullptr);
    if (!s.ok()) {
      drop();
      return FromIo(s, "rocksdb tier: sync direct dir");
    }
    direct_pool_.assign(made.rbegin(), made.rend());  // taken oldest first
  }
  std::string name = std::move(direct_pool_.back());
  direct_pool_.pop_back();
  return name;
}

absl::StatusOr<std::string> RocksDbTier::WriteDirectFile(const Payload& payload) {
  KVCOMP_ASSIGN_OR_RETURN(const std::string name, TakeDirectName());
  const std::string path = direct_dir_ + "/" + name;
  const rocksdb::IOOptions io;
  rocksdb::FileOptions fo;
  fo.allow_fallocate = false;  // space is admitted against statvfs
  fo.use_direct_writes = true;
  std::unique_ptr<rocksdb::FSWritableFile> f;
  if (!fs_->NewWritableFile(path, fo, &f, nullptr).ok()) {
    fo.use_direct_writes = false;  // a filesystem without direct I/O (tmpfs): buffered
    KVCOMP_RETURN_IF_ERROR(
        FromIo(fs_->NewWritableFile(path, fo, &f, nullptr), "rocksdb tier: direct file"));
  }
  auto fail = [&](const rocksdb::IOStatus& s) {
    f->Close(io, nullptr).PermitUncheckedError();
    fs_->DeleteFile(path, io, nullptr).PermitUncheckedError();
    return FromIo(s, "rocksdb tier: write direct file");
  };
  const uint64_t n = payload.size();
  const uint8_t* src = payload.data();
  if (fo.use_direct_writes) {
    // A payload whose bytes are aligned (kvcompd's encodings are page-aligned) is written from
    // its own memory, whole aligned chunks; the rest (all of an unaligned payload, else its last
    // partial block) through an aligned bounce buffer, padded with zeros, then the file cut back
    // to the payload's size.
    const size_t align = std::max<size_t>(f->GetRequiredBufferAlignment(), 4096);
    uint64_t first = 0;  // bytes written from the payload's own memory
    if (reinterpret_cast<uintptr_t>(src) % align == 0) {
      const uint64_t whole = n / align * align;
      while (first < whole) {
        const uint64_t len = std::min(kDirectChunk, whole - first);
        rocksdb::IOStatus s = f->Append(
            rocksdb::Slice(reinterpret_cast<const char*>(src) + first, len), io, nullptr);
        if (!s.ok()) return fail(s);
        first += len;
      }
    }
    const uint64_t rest = n - first;
    const uint64_t chunk = std::max<uint64_t>(
        align, std::min<uint64_t>(kDirectChunk, (rest + align - 1) / align * align));
    void* raw = nullptr;
    if (rest > 0 && posix_memalign(&raw, align, chunk) != 0) {
      return fail(rocksdb::IOStatus::IOError("out of memory for the direct write buffer"));
    }
    std::unique_ptr<void, decltype(&std::free)> buf(raw, &std::free);
    for (uint64_t off = first; off < n; off += chunk) {
      const uint64_t len = std::min(chunk, n - off);
      const uint64_t padded = (len + align - 1) / align * align;
      std::memcpy(buf.get(), src + off, len);
      if (padded > len) std::memset(static_cast<char*>(buf.get()) + len, 0, padded - len);
      rocksdb::IOStatus s =
          f->Append(rocksdb::Slice(static_cast<const char*>(buf.get()), padded), io, nullptr);
      if (!s.ok()) return fail(s);
    }
    if (n % align != 0) {
      rocksdb::IOStatus s = f->Truncate(n, io, nullptr);
      if (!s.ok()) return fail(s);
    }
  } else {
    for (uint64_t off = 0; off < n; off += kDirectChunk) {
      const uint64_t len = std::min(kDirectChunk, n - off);
      rocksdb::IOStatus s =
          f->Append(rocksdb::Slice(reinterpret_cast<const char*>(src) + off, len), io, nullptr);
      if (!s.ok()) return fail(s);
    }
  }
  // The data and the size (fdatasync); the name's directory entry is durable already.
  rocksdb::IOStatus s = f->Sync(io, nullptr);
  if (s.ok()) s = f->Close(io, nullptr);
  if (!s.ok()) return fail(s);
  return name;
}

absl::StatusOr<Payload> RocksDbTier::ReadDirectFile(rocksdb::FSRandomAccessFile& f,
                                                    const std::string& name, uint64_t size) {
  std::shared_ptr<uint8_t[]> bytes(new uint8_t[std::max<uint64_t>(size, 1)]);
  uint64_t got = 0;
  while (got < size) {
    const uint64_t want = std::min(kDirectChunk, size - got);
    rocksdb::Slice result;
    KVCOMP_RETURN_IF_ERROR(FromIo(f.Read(got, want, rocksdb::IOOptions(), &result,
                                         reinterpret_cast<char*>(bytes.get()) + got, nullptr),
                                  "rocksdb tier: read direct file"));
    if (result.size() == 0) break;
    if (result.data() != reinterpret_cast<char*>(bytes.get()) + got) {
      std::memmove(bytes.get() + got, result.data(), result.size());
    }
    got += result.size();
  }
  if (got != size) {
    return absl::DataLossError(absl::StrCat("rocksdb tier: direct file ", name, " holds ", got,
                                            " bytes, its record says ", size));
  }
  const uint8_t* data = bytes.get();
  return Payload(std::shared_ptr<const uint8_t>(std::move(bytes), data), size);
}

void RocksDbTier::RemoveDirectFile(const std::string& name) {
  // Absent is fine; one left behind by a failure here is removed at the next Open.
  fs_->DeleteFile(direct_dir_ + "/" + name, rocksdb::IOOptions(), nullptr).PermitUncheckedError();
}

absl::Status RocksDbTier::RemoveUnnamedDirectFiles(Db& db) {
  std::vector<std::string> children;
  rocksdb::IOStatus ls = fs_->GetChildren(direct_dir_, rocksdb::IOOptions(), &children, nullptr);
  if (!ls.ok()) return absl::OkStatus();  // no directory yet
  absl::flat_hash_map<std::string, bool> named;
  for (Stripe& st : stripes_) {
    ReaderLock lock(&st.mu);
    for (const auto& [key, name] : st.files) named[name] = true;
  }
  std::unique_ptr<rocksdb::Iterator> it(db.db->NewIterator(rocksdb::ReadOptions(), db.quarantine));
  const std::string prefix(1, kQuarantineFile);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    std::string name;
    uint64_t size = 0;
    if (DecodeDirectRecord(absl::string_view(it->value().data(), it->value().size()), &name,
                           &size)) {
      named[name] = true;
    }
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "rocksdb tier: scan quarantine"));
  for (const std::string& c : children) {
    if (absl::EndsWith(c, kDirectSuffix) && !named.contains(c)) RemoveDirectFile(c);
  }
  return absl::OkStatus();
}

absl::StatusOr<Payload> RocksDbTier::Get(absl::string_view key) { return GetFrom(*db(), key); }

absl::StatusOr<Payload> RocksDbTier::GetFrom(Db& db, absl::string_view key) {
  // The payload shares RocksDB's pinned buffer (block cache or blob read) instead of copying it.
  // A pinned block-cache entry is released into the cache, which the holder keeps alive, so the
  // payload may outlive the store.
  struct Pinned {
    std::shared_ptr<rocksdb::Cache> cache;  // destroyed after `slice` releases into it
    rocksdb::PinnableSlice slice;
  };
  {
    // A direct payload: its file is opened under the stripe's lock (an overwrite or delete
    // removes the file under the writer lock) and read after it, from the open file.
    std::unique_ptr<rocksdb::FSRandomAccessFile> file;
    std::string name;
    uint64_t size = 0;
    {
      Stripe& st = StripeOf(key);
      ReaderLock lock(&st.mu);
      auto f = st.files.find(key);
      if (f != st.files.end()) {
        auto n = st.sizes.find(key);
        if (n == st.sizes.end()) return absl::NotFoundError("rocksdb tier: no such key");
        name = f->second;
        size = n->second;
        KVCOMP_RETURN_IF_ERROR(
            FromIo(fs_->NewRandomAccessFile(direct_dir_ + "/" + name, rocksdb::FileOptions(), &file,
                                            nullptr),
                   "rocksdb tier: open direct file"));
      }
    }
    if (file != nullptr) return ReadDirectFile(*file, name, size);
  }
  auto value = std::make_shared<Pinned>();
  value->cache = block_cache_;
  rocksdb::Status s = db.db->Get(rocksdb::ReadOptions(), db.payload, ToSlice(key), &value->slice);
  if (s.IsNotFound()) return absl::NotFoundError("rocksdb tier: no such key");
  if (s.IsCorruption() && options_.env == nullptr) NoteDamagedTable(options_.path, s.ToString());
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: get"));
  const size_t n = value->slice.size();
  const auto* data = reinterpret_cast<const uint8_t*>(value->slice.data());
  return Payload(std::shared_ptr<const uint8_t>(std::move(value), data), n);
}

absl::StatusOr<CacheMeta> RocksDbTier::GetMeta(absl::string_view key) {
  std::shared_ptr<Db> db = this->db();
  std::string value;
  rocksdb::Status s = db->db->Get(rocksdb::ReadOptions(), db->meta, ToSlice(key), &value);
  if (s.IsNotFound()) return absl::NotFoundError("rocksdb tier: no such key");
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: get meta"));
  return DecodeMeta(value);
}

absl::Status RocksDbTier::Delete(absl::string_view key, bool sync) {
  Stripe& st = StripeOf(key);
  WriterLock lock(&st.mu);
  std::shared_ptr<Db> db = this->db();
  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Delete(db->meta, ToSlice(key));
  if (s.ok()) s = batch.Delete(db->payload, ToSlice(key));
  auto file = st.files.find(key);
  if (s.ok() && file != st.files.end() && db->direct != nullptr) {
    s = batch.Delete(db->direct, ToSlice(key));
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: batch"));
  KVCOMP_RETURN_IF_ERROR(Write(&batch, sync, "delete", WriteKind::kRemoves));
  if (file != st.files.end()) {
    RemoveDirectFile(file->second);
    st.files.erase(file);
  }
  ForgetSize(st, key);
  return absl::OkStatus();
}

absl::Status RocksDbTier::DeleteMany(const std::vector<std::string>& keys, bool sync) {
  if (keys.empty()) return absl::OkStatus();
  std::shared_ptr<Db> db = this->db();
  rocksdb::WriteBatch batch;
  for (const std::string& key : keys) {
    rocksdb::Status s = batch.Delete(db->meta, ToSlice(key));
    if (s.ok()) s = batch.Delete(db->payload, ToSlice(key));
    if (s.ok() && db->direct != nullptr) s = batch.Delete(db->direct, ToSlice(key));
    KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: batch"));
  }
  KVCOMP_RETURN_IF_ERROR(Write(&batch, sync, "delete", WriteKind::kRemoves));
  for (const std::string& key : keys) {
    Stripe& st = StripeOf(key);
    WriterLock lock(&st.mu);
    auto file = st.files.find(key);
    if (file != st.files.end()) {
      RemoveDirectFile(file->second);
      st.files.erase(file);
    }
    ForgetSize(st, key);
  }
  return absl::OkStatus();
}

absl::Status RocksDbTier::Recover(
    bool verify, const std::function<void(absl::string_view, const CacheMeta&)>& fn,
    std::vector<QuarantinedCache>* quarantined) {
  std::shared_ptr<Db> db = this->db();
  std::vector<std::pair<std::string, std::string>> bad;
  {
    std::unique_ptr<rocksdb::Iterator> it(db->db->NewIterator(rocksdb::ReadOptions(), db->meta));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const absl::string_view key(it->key().data(), it->key().size());
      auto meta = DecodeMeta(absl::string_view(it->value().data(), it->value().size()));
      if (!meta.ok()) {
        bad.emplace_back(std::string(key), meta.status().ToString());
        continue;
      }
      if (verify) {
        auto payload = GetFrom(*db, key);
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
    // Read-only: the entry stays where it is (never served) until a writable open moves it.
    if (!db->read_only) KVCOMP_RETURN_IF_ERROR(Quarantine(key, reason));
    if (quarantined != nullptr) quarantined->push_back({key, reason});
  }
  return absl::OkStatus();
}

absl::Status RocksDbTier::Quarantine(absl::string_view key, absl::string_view reason) {
  std::shared_ptr<Db> db = this->db();
  Stripe& st = StripeOf(key);
  WriterLock lock(&st.mu);
  return QuarantineLocked(*db, st, key, reason, nullptr).status();
}

absl::StatusOr<bool> RocksDbTier::QuarantineLocked(Db& d, Stripe& st, absl::string_view key,
                                                   absl::string_view reason,
                                                   const std::string* expect_meta) {
  Db* db = &d;
  WriterLock quarantine_lock(&quarantine_mu_);
  std::string meta, payload;
  rocksdb::Status s = db->db->Get(rocksdb::ReadOptions(), db->meta, ToSlice(key), &meta);
  if (!s.ok() && !s.IsNotFound()) return FromRocksDb(s, "rocksdb tier: quarantine");
  if (expect_meta != nullptr && (!s.ok() || meta != *expect_meta)) return false;
  s = db->db->Get(rocksdb::ReadOptions(), db->payload, ToSlice(key), &payload);
  // A payload that cannot be read (a damaged blob) is quarantined without its bytes.
  if (s.IsCorruption()) payload.clear();
  else if (!s.ok() && !s.IsNotFound()) return FromRocksDb(s, "rocksdb tier: quarantine");
  rocksdb::WriteBatch batch;
  auto qkey = [&](char tag) { return std::string(1, tag) + std::string(key); };
  s = batch.Put(db->quarantine, qkey(kQuarantineReason), ToSlice(reason));
  if (s.ok()) s = batch.Put(db->quarantine, qkey(kQuarantineMeta), meta);
  if (s.ok()) s = batch.Put(db->quarantine, qkey(kQuarantinePayload), payload);
  if (s.ok()) s = batch.Delete(db->meta, ToSlice(key));
  if (s.ok()) s = batch.Delete(db->payload, ToSlice(key));
  // A direct payload's file stays, named by the quarantine's record, until it is purged.
  auto file = st.files.find(key);
  if (s.ok() && file != st.files.end() && db->direct != nullptr) {
    auto size = st.sizes.find(key);
    s = batch.Put(db->quarantine, qkey(kQuarantineFile),
                  EncodeDirectRecord(file->second, size == st.sizes.end() ? 0 : size->second));
    if (s.ok()) s = batch.Delete(db->direct, ToSlice(key));
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: batch"));
  KVCOMP_RETURN_IF_ERROR(Write(&batch, /*sync=*/true, "quarantine", WriteKind::kAdds));
  if (file != st.files.end()) st.files.erase(file);
  ForgetSize(st, key);
  return true;
}

absl::StatusOr<std::vector<QuarantinedCache>> RocksDbTier::ListQuarantine() {
  std::shared_ptr<Db> db = this->db();
  std::vector<QuarantinedCache> out;
  std::unique_ptr<rocksdb::Iterator> it(db->db->NewIterator(rocksdb::ReadOptions(), db->quarantine));
  const std::string prefix(1, kQuarantineReason);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    out.push_back(
        {std::string(it->key().data() + 1, it->key().size() - 1), it->value().ToString()});
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "rocksdb tier: list quarantine"));
  return out;
}

absl::StatusOr<bool> RocksDbTier::PurgeQuarantine(absl::string_view key) {
  std::shared_ptr<Db> db = this->db();
  WriterLock lock(&quarantine_mu_);
  const std::string reason_key = std::string(1, kQuarantineReason) + std::string(key);
  std::string reason;
  rocksdb::Status s = db->db->Get(rocksdb::ReadOptions(), db->quarantine, reason_key, &reason);
  if (s.IsNotFound()) return false;
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "rocksdb tier: purge quarantine"));
  std::string record, file;
  uint64_t size = 0;
  s = db->db->Get(rocksdb::ReadOptions(), db->quarantine,
                  std::string(1, kQuarantineFile) + std::string(key), &record);
  if (s.ok() && !DecodeDirectRecord(record, &file, &size)) file.clear();
  rocksdb::WriteBatch batch;
  for (char tag : {kQuarantineReason, kQuarantineMeta, kQuarantinePayload, kQuarantineFile}) {
    KVCOMP_RETURN_IF_ERROR(FromRocksDb(
        batch.Delete(db->quarantine, std::string(1, tag) + std::string(key)), "rocksdb tier: batch"));
  }
  KVCOMP_RETURN_IF_ERROR(Write(&batch, /*sync=*/true, "purge quarantine", WriteKind::kRemoves));
  if (!file.empty()) RemoveDirectFile(file);
  return true;
}

absl::StatusOr<std::vector<std::string>> RocksDbTier::PurgeAllQuarantine() {
  std::shared_ptr<Db> db = this->db();
  WriterLock lock(&quarantine_mu_);
  rocksdb::WriteBatch batch;
  std::vector<std::string> keys;
  std::unique_ptr<rocksdb::Iterator> it(db->db->NewIterator(rocksdb::ReadOptions(), db->quarantine));
  std::vector<std::string> files;
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (!it->key().empty() && it->key()[0] == kQuarantineReason) {
      keys.emplace_back(it->key().data() + 1, it->key().size() - 1);
    }
    std::string file;
    uint64_t size = 0;
    if (!it->key().empty() && it->key()[0] == kQuarantineFile &&
        DecodeDirectRecord(absl::string_view(it->value().data(), it->value().size()), &file,
                           &size)) {
      files.push_back(std::move(file));
    }
    KVCOMP_RETURN_IF_ERROR(
        FromRocksDb(batch.Delete(db->quarantine, it->key()), "rocksdb tier: batch"));
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "rocksdb tier: purge quarantine"));
  if (batch.Count() == 0) return keys;
  KVCOMP_RETURN_IF_ERROR(Write(&batch, /*sync=*/true, "purge quarantine", WriteKind::kRemoves));
  for (const std::string& f : files) RemoveDirectFile(f);
  return keys;
}

namespace {
absl::Status ValidateCalibrationKey(absl::string_view key) {
  if (key.empty() || key.size() > kMaxCalibrationKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("calibration: key of ", key.size(),
                                                   " bytes, want 1..", kMaxCalibrationKeyBytes));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status RocksDbTier::PutCalibration(absl::string_view key, absl::string_view bytes) {
  std::shared_ptr<Db> db = this->db();
  KVCOMP_RETURN_IF_ERROR(ValidateCalibrationKey(key));
  WriterLock lock(&calibration_mu_);
  std::string existing;
  rocksdb::Status s = db->db->Get(rocksdb::ReadOptions(), db->calibration, ToSlice(key), &existing);
  if (s.ok()) {
    if (existing == bytes) return absl::OkStatus();
    return absl::AlreadyExistsError("calibration: the key exists with other bytes");
  }
  if (!s.IsNotFound()) return FromRocksDb(s, "calibration: read");
  rocksdb::WriteBatch batch;
  KVCOMP_RETURN_IF_ERROR(
      FromRocksDb(batch.Put(db->calibration, ToSlice(key), ToSlice(bytes)), "calibration"));
  return Write(&batch, /*sync=*/true, "put calibration", WriteKind::kAdds);
}

absl::StatusOr<std::string> RocksDbTier::GetCalibration(absl::string_view key) {
  std::shared_ptr<Db> db = this->db();
  KVCOMP_RETURN_IF_ERROR(ValidateCalibrationKey(key));
  std::string value;
  rocksdb::Status s = db->db->Get(rocksdb::ReadOptions(), db->calibration, ToSlice(key), &value);
  if (s.IsNotFound()) return absl::NotFoundError("calibration: no such key");
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "calibration: get"));
  return value;
}

absl::StatusOr<std::vector<std::string>> RocksDbTier::ListCalibration(absl::string_view prefix) {
  std::shared_ptr<Db> db = this->db();
  std::vector<std::string> out;
  std::unique_ptr<rocksdb::Iterator> it(
      db->db->NewIterator(rocksdb::ReadOptions(), db->calibration));
  const rocksdb::Slice p = ToSlice(prefix);
  for (it->Seek(p); it->Valid() && it->key().starts_with(p); it->Next()) {
    out.emplace_back(it->key().data(), it->key().size());
  }
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(it->status(), "calibration: list"));
  return out;
}

absl::Status RocksDbTier::DeleteCalibration(absl::string_view key) {
  std::shared_ptr<Db> db = this->db();
  KVCOMP_RETURN_IF_ERROR(ValidateCalibrationKey(key));
  WriterLock lock(&calibration_mu_);
  std::string existing;
  rocksdb::Status s = db->db->Get(rocksdb::ReadOptions(), db->calibration, ToSlice(key), &existing);
  if (s.IsNotFound()) return absl::NotFoundError("calibration: no such key");
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(s, "calibration: read"));
  rocksdb::WriteBatch batch;
  KVCOMP_RETURN_IF_ERROR(FromRocksDb(batch.Delete(db->calibration, ToSlice(key)), "calibration"));
  return Write(&batch, /*sync=*/true, "delete calibration", WriteKind::kRemoves);
}

}  // namespace storage
}  // namespace kvcomp
