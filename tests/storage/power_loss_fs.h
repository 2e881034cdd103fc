// A RocksDB file system that makes a SIGKILL look like a power cut to the write-ahead log: bytes
// appended to a WAL file (*.log) stay in this process's memory until the file is synced, so a
// killed process loses every WAL write it had not synced, as a machine losing power would lose
// them from the page cache. Everything else passes straight through (RocksDB syncs its SST, blob
// and MANIFEST files before it relies on them). Used by the crash writer in its "stale" mode, and
// in-process through SimulatePowerLoss().
#ifndef KVCOMP_TESTS_STORAGE_POWER_LOSS_FS_H_
#define KVCOMP_TESTS_STORAGE_POWER_LOSS_FS_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "rocksdb/file_system.h"

namespace kvcomp {
namespace storage {
namespace testing {

class PowerLossFileSystem : public rocksdb::FileSystemWrapper {
 public:
  explicit PowerLossFileSystem(std::shared_ptr<rocksdb::FileSystem> target)
      : FileSystemWrapper(std::move(target)) {}
  const char* Name() const override { return "PowerLossFileSystem"; }

  // From now on every unsynced WAL byte is dropped instead of written, and no file can be
  // created or synced: what is on disk stays as a power cut at this moment would leave it. Close
  // the store afterwards and reopen it without this file system.
  void SimulatePowerLoss() { lost_->store(true); }
  // Syncs of WAL files so far.
  uint64_t wal_syncs() const { return syncs_->load(); }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    if (lost_->load()) return rocksdb::IOStatus::IOError("simulated power loss");
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus s = target()->NewWritableFile(f, o, &file, dbg);
    if (!s.ok()) return s;
    if (absl::EndsWith(f, ".log")) {
      r->reset(new UnsyncedTail(std::move(file), lost_, syncs_));
    } else {
      *r = std::move(file);
    }
    return s;
  }

 private:
  // Appends go to `tail_`; Sync/Fsync write the tail through and sync it. Close writes it
  // through without a sync (the bytes reach the page cache, which a SIGKILL does not lose).
  class UnsyncedTail : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    UnsyncedTail(std::unique_ptr<rocksdb::FSWritableFile> f,
                 std::shared_ptr<std::atomic<bool>> lost,
                 std::shared_ptr<std::atomic<uint64_t>> syncs)
        : FSWritableFileOwnerWrapper(std::move(f)),
          lost_(std::move(lost)),
          syncs_(std::move(syncs)) {}
    ~UnsyncedTail() override { WriteThrough().PermitUncheckedError(); }

    rocksdb::IOStatus Append(const rocksdb::Slice& d, const rocksdb::IOOptions&,
                             rocksdb::IODebugContext*) override {
      std::lock_guard<std::mutex> lock(mu_);
      tail_.append(d.data(), d.size());
      return rocksdb::IOStatus::OK();
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& d, const rocksdb::IOOptions& o,
                             const rocksdb::DataVerificationInfo&,
                             rocksdb::IODebugContext* dbg) override {
      return Append(d, o, dbg);
    }
    rocksdb::IOStatus Flush(const rocksdb::IOOptions&, rocksdb::IODebugContext*) override {
      return rocksdb::IOStatus::OK();  // stays in memory: only a sync makes it durable
    }
    rocksdb::IOStatus RangeSync(uint64_t, uint64_t, const rocksdb::IOOptions&,
                                rocksdb::IODebugContext*) override {
      return rocksdb::IOStatus::OK();
    }
    rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      *syncs_ += 1;
      rocksdb::IOStatus s = WriteThrough();
      return s.ok() ? target()->Sync(o, dbg) : s;
    }
    rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      *syncs_ += 1;
      rocksdb::IOStatus s = WriteThrough();
      return s.ok() ? target()->Fsync(o, dbg) : s;
    }
    rocksdb::IOStatus Close(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      rocksdb::IOStatus s = WriteThrough();
      return s.ok() ? target()->Close(o, dbg) : s;
    }
    bool IsSyncThreadSafe() const override { return false; }
    uint64_t GetFileSize(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      std::lock_guard<std::mutex> lock(mu_);
      return target()->GetFileSize(o, dbg) + tail_.size();
    }

   private:
    rocksdb::IOStatus WriteThrough() {
      std::lock_guard<std::mutex> lock(mu_);
      if (lost_->load()) {
        tail_.clear();
        return rocksdb::IOStatus::IOError("simulated power loss");
      }
      if (tail_.empty()) return rocksdb::IOStatus::OK();
      rocksdb::IOStatus s = target()->Append(tail_, rocksdb::IOOptions(), nullptr);
      if (s.ok()) s = target()->Flush(rocksdb::IOOptions(), nullptr);
      if (s.ok()) tail_.clear();
      return s;
    }

    std::shared_ptr<std::atomic<bool>> lost_;
    std::shared_ptr<std::atomic<uint64_t>> syncs_;
    std::mutex mu_;
    std::string tail_;
  };

  std::shared_ptr<std::atomic<bool>> lost_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<uint64_t>> syncs_ = std::make_shared<std::atomic<uint64_t>>(0);
};

}  // namespace testing
}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_STORAGE_POWER_LOSS_FS_H_
