// A real small filesystem for disk-full tests: a tmpfs of a given size mounted on a fresh
// directory, resizable while in use (mount -o remount,size=...). Needs root (CI runs as root);
// a refused mount is reported through ok()/error() so the test fails instead of skipping.
#ifndef KVCOMP_TESTS_STORAGE_TMPFS_MOUNT_H_
#define KVCOMP_TESTS_STORAGE_TMPFS_MOUNT_H_

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace kvcomp {
namespace testing {

class TmpfsMount {
 public:
  // Mounts on a new temporary directory.
  explicit TmpfsMount(uint64_t size_bytes) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvcomp_tmpfs_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) {
      error_ = std::string("mkdtemp: ") + std::strerror(errno);
      return;
    }
    MountOn(tmpl, size_bytes);
  }
  // Mounts on `path`, which this creates (and removes at the end).
  TmpfsMount(const std::string& path, uint64_t size_bytes) {
    if (mkdir(path.c_str(), 0755) != 0) {
      error_ = "mkdir " + path + ": " + std::strerror(errno);
      return;
    }
    MountOn(path, size_bytes);
  }
  ~TmpfsMount() {
    if (mounted_) umount2(path_.c_str(), MNT_DETACH);
    if (!path_.empty()) rmdir(path_.c_str());
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;

  bool ok() const { return mounted_; }
  const std::string& error() const { return error_; }
  const std::string& path() const { return path_; }

  // Grows (or shrinks) the filesystem in place. Empty on success, else the error.
  std::string Resize(uint64_t size_bytes) {
    const std::string opts = "size=" + std::to_string(size_bytes);
    if (mount(nullptr, path_.c_str(), nullptr, MS_REMOUNT, opts.c_str()) != 0) {
      return "remount " + path_ + " " + opts + ": " + std::strerror(errno);
    }
    return "";
  }

  uint64_t FreeBytes() const {
    struct statvfs sv;
    if (statvfs(path_.c_str(), &sv) != 0) return 0;
    return uint64_t{sv.f_bavail} * sv.f_frsize;
  }

  // Writes `name` until the filesystem has at most `leave` bytes free (or is full); returns the
  // bytes written.
  uint64_t Fill(const std::string& name, uint64_t leave = 0) {
    const std::string file = path_ + "/" + name;
    int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return 0;
    std::vector<char> chunk(64 * 1024, 'x');
    uint64_t written = 0;
    while (true) {
      const uint64_t free = FreeBytes();
      if (free <= leave) break;
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), free - leave));
      const ssize_t w = write(fd, chunk.data(), n);
      if (w <= 0) break;
      written += static_cast<uint64_t>(w);
    }
    fsync(fd);
    close(fd);
    return written;
  }

 private:
  void MountOn(const std::string& path, uint64_t size_bytes) {
    path_ = path;
    const std::string opts = "size=" + std::to_string(size_bytes) + ",mode=0755";
    if (mount("tmpfs", path_.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      error_ = "mount tmpfs on " + path_ + " (" + opts + "): " + std::strerror(errno) +
               " (the disk-full tests need root to mount a small filesystem)";
      return;
    }
    mounted_ = true;
  }

  std::string path_;
  std::string error_;
  bool mounted_ = false;
};

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_STORAGE_TMPFS_MOUNT_H_
