// Helpers of the storage tests: temporary directories, encoded caches of a chosen seed, and a
// RocksDB file system that can be told the disk is full.
#ifndef KVCOMP_TESTS_STORAGE_STORAGE_TEST_UTIL_H_
#define KVCOMP_TESTS_STORAGE_STORAGE_TEST_UTIL_H_

#include <stdlib.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include "common/random_cache.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/format.h"
#include "rocksdb/env.h"
#include "rocksdb/file_system.h"

namespace kvcomp {
namespace storage {
namespace testing {

// The metadata a tier stores beside `p`: its size, its CRC32C and a fixed creation time.
inline CacheMeta MetaFor(const Payload& p) {
  CacheMeta m;
  m.stored_bytes = p.size();
  m.crc32c = Crc32c(p.data(), p.size());
  m.created_unix_ms = 1234;
  return m;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvcomp_storage_XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) != nullptr ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The encoded bytes of a random valid cache; `tokens` scales its size (about 1 KiB per 4).
inline std::string EncodedCache(uint64_t seed, uint64_t tokens = 37) {
  kvcomp::testing::RandomCacheOptions o;
  o.original_tokens = tokens;
  return *format::EncodeCache(kvcomp::testing::RandomCache(o, seed));
}

// A file system whose writes fail with NoSpace while `full` is set.
class DiskFullFileSystem : public rocksdb::FileSystemWrapper {
 public:
  explicit DiskFullFileSystem(std::shared_ptr<rocksdb::FileSystem> target)
      : FileSystemWrapper(std::move(target)) {}
  const char* Name() const override { return "DiskFullFileSystem"; }

  void SetFull(bool full) { full_->store(full); }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    if (full_->load()) return rocksdb::IOStatus::NoSpace("injected: disk full");
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus s = target()->NewWritableFile(f, o, &file, dbg);
    if (s.ok()) r->reset(new File(std::move(file), full_));
    return s;
  }

 private:
  class File : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    File(std::unique_ptr<rocksdb::FSWritableFile> f, std::shared_ptr<std::atomic<bool>> full)
        : FSWritableFileOwnerWrapper(std::move(f)), full_(std::move(full)) {}
    rocksdb::IOStatus Append(const rocksdb::Slice& d, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override {
      if (full_->load()) return rocksdb::IOStatus::NoSpace("injected: disk full");
      return FSWritableFileOwnerWrapper::Append(d, o, dbg);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& d, const rocksdb::IOOptions& o,
                             const rocksdb::DataVerificationInfo& v,
                             rocksdb::IODebugContext* dbg) override {
      if (full_->load()) return rocksdb::IOStatus::NoSpace("injected: disk full");
      return FSWritableFileOwnerWrapper::Append(d, o, v, dbg);
    }
    rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      if (full_->load()) return rocksdb::IOStatus::NoSpace("injected: disk full");
      return FSWritableFileOwnerWrapper::Sync(o, dbg);
    }

   private:
    std::shared_ptr<std::atomic<bool>> full_;
  };

  std::shared_ptr<std::atomic<bool>> full_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace testing
}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_STORAGE_STORAGE_TEST_UTIL_H_
