#include "kvcomp/transport/shm_link.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/client.h"

namespace kvcomp {
namespace transport {
namespace {

// The attach request (client -> daemon, one SOCK_SEQPACKET message with the region's descriptor
// as SCM_RIGHTS) and its answer, little-endian on the one host both run on.
constexpr uint32_t kAttachMagic = 0x4853564B;  // "KVSH"
constexpr uint16_t kAttachVersion = 1;
struct AttachRequest {
  uint32_t magic;
  uint16_t version;
  uint8_t region;  // kShmPutRegion, kShmGetRegion, or kShmPeer
  uint8_t reserved;
  uint64_t bytes;
  uint64_t probe;  // kShmPeer: the address of 8 bytes of the sender the server reads back
  char token[wire::kShmTokenBytes];
};
struct AttachAnswer {
  uint32_t magic;
  uint16_t code;  // absl::StatusCode
  uint16_t message_bytes;
  uint64_t probe;  // kShmPeer: the 8 bytes read at the request's probe address
  char message[240];
};
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

// Through syscall(2): the C library's wrappers are not declared for C++ everywhere.
int PidfdOpen(int pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }
bool PidfdAlive(int pidfd) {
  return syscall(SYS_pidfd_send_signal, pidfd, 0, nullptr, 0) == 0;
}
constexpr absl::Duration kServeTimeout = absl::Seconds(1);  // per attaching peer

absl::Status Errno(const char* what) {
  const int e = errno;
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(e)));
}

sockaddr_un AbstractAddress(const std::string& name, socklen_t* len) {
  sockaddr_un a = {};
  a.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a.sun_path) - 1);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] = 0: the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

int PollMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60000));
}

}  // namespace

absl::Status CheckShmRange(uint64_t offset, uint64_t bytes, uint64_t size, const char* what) {
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": bytes [", offset, ", +", bytes, ") outside the shared region of ",
                     size, " bytes"));
  }
  return absl::OkStatus();
}

// ---- the copy threads of both ends ----

CopyPool::CopyPool(int threads) : max_threads_(std::max(threads, 1)) {}

CopyPool::~CopyPool() { Stop(); }

int CopyPool::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

void CopyPool::Run(absl::AnyInvocable<void() &&> work) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      // One thread more while the queued work (this piece included) outnumbers the idle ones.
      if (idle_ <= static_cast<int>(queue_.size()) &&
          static_cast<int>(threads_.size()) < max_threads_) {
        try {
          threads_.emplace_back([this] {
            pthread_setname_np(pthread_self(), kCopyThreadName);
            Loop();
          });
        } catch (const std::system_error&) {
          // none to be had now: the threads there are take it
        }
      }
      if (!threads_.empty()) {
        queue_.push_back(std::move(work));
        return;
      }
    }
  }
  std::move(work)();  // stopped, or no thread could be made: here
}

void CopyPool::Loop() {
  while (true) {
    absl::AnyInvocable<void() &&> work;
    {
      absl::MutexLock lock(&mu_);
      ++idle_;
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      --idle_;
      if (queue_.empty()) return;  // stopping, nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(work)();  // and what it holds is released here, outside the lock
  }
}

void CopyPool::ForEach(int parts, absl::FunctionRef<void(int)> fn) {
  if (parts <= 0) return;
  if (parts == 1) {
    fn(0);
    return;
  }
  // Parts go to whoever claims them first: the calling thread and the helpers queued here. A
  // helper that starts after every part was claimed returns without touching `fn` (which lives
  // until this call returns); the batch is shared so it outlives a late helper.
  struct Batch {
    std::atomic<int> next{0};
    absl::Mutex mu;
    int done ABSL_GUARDED_BY(mu) = 0;
  };
  auto batch = std::make_shared<Batch>();
  auto take = [parts](Batch& b, absl::FunctionRef<void(int)> f) {
    int ran = 0;
    for (int i = b.next.fetch_add(1); i < parts; i = b.next.fetch_add(1)) {
      f(i);
      ++ran;
    }
    if (ran > 0) {
      absl::MutexLock lock(&b.mu);
      b.done += ran;
    }
  };
  const int helpers = std::min(parts - 1, max_threads_);
  for (int h = 0; h < helpers; ++h) {
    Run([batch, fn, take] { take(*batch, fn); });
  }
  take(*batch, fn);
  absl::MutexLock lock(&batch->mu);
  Batch* b = batch.get();
  auto all = [b, parts]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(b->mu) { return b->done == parts; };
  batch->mu.Await(absl::Condition(&all));
}

void CopyPool::Stop() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    threads.swap(threads_);
  }
  for (std::thread& t : threads) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // misuse (Stop from the pool's own work): it ends when that work returns
    } else {
      t.join();
    }
  }
}

// ---- kvcompd's end ----

ShmMapping::~ShmMapping() {
  munmap(data_, size_);
  close(fd_);
}

absl::Status ShmMapping::Intact() const {
  struct stat st;
  if (fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_blocks) * 512 < size_) {
    return absl::FailedPreconditionError(
        "the shared region is no longer fully allocated by its owner (holes punched)");
  }
  return absl::OkStatus();
}

ShmGrant::~ShmGrant() {
  if (pidfd_ >= 0) close(pidfd_);
}

void ShmGrant::SetPeer(int pid, int pidfd) {
  absl::MutexLock lock(&mu_);
  if (pidfd_ >= 0) close(pidfd_);
  pid_ = pid;
  pidfd_ = pidfd;
}

bool ShmGrant::has_peer() const {
  absl::MutexLock lock(&mu_);
  return pidfd_ >= 0;
}

int ShmCopyLanes(uint32_t configured) {
  if (configured > 0) return static_cast<int>(std::min<uint32_t>(configured, 16));
  cpu_set_t set;
  const int cpus = sched_getaffinity(0, sizeof(set), &set) == 0
                       ? CPU_COUNT(&set)
                       : static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cpus / 4, 1, 4);
}

absl::Status ShmGrant::PeerAccess(bool write, uint64_t address, void* local, uint64_t bytes,
                                  int lanes) const {
  int pid, pidfd;
  {
    absl::MutexLock lock(&mu_);
    pid = pid_;
    pidfd = pidfd_;
  }
  if (pidfd < 0) {
    return absl::FailedPreconditionError("no peer registered on this connection");
  }
  if (address + bytes < address) {
    return absl::InvalidArgumentError("the peer's range wraps around the address space");
  }
  // [begin, end) of the range; the grant's pidfd stays open while this call runs (the caller
  // holds the grant).
  auto copy = [&](uint64_t begin, uint64_t end) -> absl::Status {
    uint64_t done = begin;
    while (done < end) {
      // The process the pidfd holds must still be alive: its pid is never another's.
      if (!PidfdAlive(pidfd)) {
        return absl::FailedPreconditionError("the peer process has exited");
      }
      const uint64_t n = std::min<uint64_t>(end - done, uint64_t{1} << 30);
      iovec mine = {static_cast<uint8_t*>(local) + done, n};
      iovec theirs = {reinterpret_cast<void*>(address + done), n};
      const ssize_t r = write ? process_vm_writev(pid, &mine, 1, &theirs, 1, 0)
                              : process_vm_readv(pid, &mine, 1, &theirs, 1, 0);
      if (r <= 0) {
        const int e = r < 0 ? errno : EFAULT;
        if (e == EFAULT) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the peer's ", write ? "destination" : "source", " [", address, ", +", bytes,
              ") is not ", write ? "writable" : "readable", " memory of its process"));
        }
        return absl::FailedPreconditionError(
            absl::StrCat("cannot ", write ? "write" : "read", " the peer's memory: ",
                         std::strerror(e)));
      }
      done += static_cast<uint64_t>(r);
    }
    return absl::OkStatus();
  };
  const uint64_t n_lanes =
      pool_ == nullptr ? 1
                       : std::clamp<uint64_t>(bytes / kShmMinLaneBytes, 1,
                                              static_cast<uint64_t>(std::max(lanes, 1)));
  if (n_lanes == 1) return copy(0, bytes);
  // Contiguous ranges on 64 KiB boundaries; the kernel pins and copies each lane's pages on its
  // own thread (one thread's copy is bound by its page pinning and its core's copy rate). The
  // calling thread takes ranges too, so a lane the pool cannot run now is copied here.
  const uint64_t per = (bytes / n_lanes + 0xffff) & ~uint64_t{0xffff};
  std::vector<absl::Status> status(n_lanes);
  pool_->ForEach(static_cast<int>(n_lanes), [&](int i) {
    const uint64_t begin = std::min(i * per, bytes), end = std::min((i + 1) * per, bytes);
    status[i] = copy(begin, end);
  });
  for (absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ShmGrant::ReadPeer(uint64_t address, void* to, uint64_t bytes, int lanes) const {
  return PeerAccess(false, address, to, bytes, lanes);
}

absl::Status ShmGrant::WritePeer(uint64_t address, const void* from, uint64_t bytes,
                                 int lanes) const {
  return PeerAccess(true, address, const_cast<void*>(from), bytes, lanes);
}

std::shared_ptr<ShmMapping> ShmGrant::Region(uint8_t id) const {
  if (id >= kShmRegions) return nullptr;
  absl::MutexLock lock(&mu_);
  return regions_[id];
}

void ShmGrant::Set(uint8_t id, std::shared_ptr<ShmMapping> mapping) {
  std::shared_ptr<ShmMapping> old;
  absl::MutexLock lock(&mu_);
  old = std::move(regions_[id]);
  regions_[id] = std::move(mapping);
}

absl::StatusOr<std::unique_ptr<ShmAcceptor>> ShmAcceptor::Start(
    uint64_t max_region_bytes, std::function<void(const std::string&)> report,
    std::shared_ptr<CopyPool> pool) {
  if (max_region_bytes < kShmMinRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory: the largest region (",
                                                   max_region_bytes, " bytes) is below ",
                                                   kShmMinRegionBytes));
  }
  char random[8];
  if (getrandom(random, sizeof(random), 0) != sizeof(random)) return Errno("getrandom");
  const std::string name = absl::StrCat("kvcompd-shm-", getpid(), "-",
                                        absl::BytesToHexString(absl::string_view(random, 8)));
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Errno("shared memory: socket");
  socklen_t len = 0;
  sockaddr_un addr = AbstractAddress(name, &len);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 64) != 0) {
    absl::Status s = Errno("shared memory: bind/listen");
    close(fd);
    return s;
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    absl::Status s = Errno("shared memory: eventfd");
    close(fd);
    return s;
  }
  std::unique_ptr<ShmAcceptor> a(
      new ShmAcceptor(fd, wake, name, max_region_bytes, std::move(report), std::move(pool)));
  a->thread_ = std::thread([p = a.get()] { p->Loop(); });
  return a;
}

ShmAcceptor::ShmAcceptor(int listen_fd, int wake_fd, std::string name, uint64_t max_region_bytes,
                         std::function<void(const std::string&)> report,
                         std::shared_ptr<CopyPool> pool)
    : listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      name_(std::move(name)),
      max_region_bytes_(max_region_bytes),
      report_(std::move(report)),
      pool_(pool != nullptr ? std::move(pool) : std::make_shared<CopyPool>(1)) {}

void ShmAcceptor::RunCopy(absl::AnyInvocable<void() &&> work) { pool_->Run(std::move(work)); }

ShmAcceptor::~ShmAcceptor() {
  pool_->Stop();  // queued copies first: they hold grants and mappings, not the socket
  const uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof(one));
  (void)ignored;
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_fd_);
}

std::shared_ptr<ShmGrant> ShmAcceptor::Enroll() {
  std::string token(wire::kShmTokenBytes, '\0');
  while (true) {
    if (getrandom(token.data(), token.size(), 0) != static_cast<ssize_t>(token.size())) continue;
    auto grant = std::make_shared<ShmGrant>(token, pool_);
    absl::MutexLock lock(&mu_);
    if (grants_.emplace(token, grant).second) return grant;
  }
}

void ShmAcceptor::Withdraw(const ShmGrant& grant) {
  absl::MutexLock lock(&mu_);
  grants_.erase(grant.token());
}

ShmAcceptorStats ShmAcceptor::stats() const {
  return ShmAcceptorStats{attached_.load(), refused_.load()};
}

void ShmAcceptor::Loop() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) poll(nullptr, 0, 100);  // descriptors short
      continue;
    }
    Serve(fd);
    close(fd);
  }
}

void ShmAcceptor::Serve(int fd) {
  // One request per peer, within kServeTimeout: a peer that sends nothing holds the socket no
  // longer than that.
  pollfd p = {fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kServeTimeout))) <= 0) {
    refused_++;
    return;
  }
  AttachRequest req = {};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  iovec iov = {&req, sizeof(req)};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  // Every descriptor that came is closed here, whatever the outcome; only a mapping stays.
  std::vector<int> fds;
  if (n >= 0) {
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int v;
        std::memcpy(&v, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.push_back(v);
      }
    }
  }
  absl::Status s;
  uint64_t probe = 0;
  const size_t want = req.region == kShmPeer ? 0 : 1;
  if (n < 0) {
    s = Errno("receive");
  } else if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0 || fds.size() != want) {
    s = absl::InvalidArgumentError(
        want == 1 ? "an attach request carries exactly one descriptor"
                  : "a peer registration carries no descriptor");
  } else {
    s = Attach(fd, &req, static_cast<size_t>(n), want == 1 ? fds[0] : -1, &probe);
  }
  for (int d : fds) close(d);
  if (s.ok()) {
    attached_++;
  } else {
    refused_++;
    if (report_) report_(absl::StrCat("shared memory: attach refused: ", s.message()));
  }
  AttachAnswer a = {};
  a.magic = kAttachMagic;
  a.code = static_cast<uint16_t>(s.code());
  const size_t m = std::min(s.message().size(), sizeof(a.message));
  if (m > 0) std::memcpy(a.message, s.message().data(), m);  // an OK status has no text
  a.message_bytes = static_cast<uint16_t>(m);
  a.probe = probe;
  ssize_t ignored = send(fd, &a, sizeof(a), MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)ignored;
}

absl::Status ShmAcceptor::Attach(int fd, const void* message, size_t length, int region_fd,
                                 uint64_t* probe) {
  AttachRequest req;
  if (length != sizeof(req)) return absl::InvalidArgumentError("malformed attach request");
  std::memcpy(&req, message, sizeof(req));
  if (req.magic != kAttachMagic || req.version != kAttachVersion || req.reserved != 0) {
    return absl::InvalidArgumentError("malformed attach request");
  }
  std::shared_ptr<ShmGrant> grant;
  {
    absl::MutexLock lock(&mu_);
    auto it = grants_.find(absl::string_view(req.token, sizeof(req.token)));
    if (it != grants_.end()) grant = it->second.lock();
  }
  if (grant == nullptr) {
    return absl::PermissionDeniedError("unknown attach token (no such authenticated connection)");
  }
  if (req.region == kShmPeer) {
    // The sender as the kernel knows it (never a pid it names), held by a pidfd.
    ucred cred = {};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) {
      return Errno("peer credentials");
    }
    int pidfd = -1;
    len = sizeof(pidfd);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) != 0 || pidfd < 0) {
      pidfd = PidfdOpen(cred.pid);  // kernels before 6.5
    }
    if (pidfd < 0) return Errno("pidfd");
    uint64_t word = 0;
    iovec mine = {&word, sizeof(word)};
    iovec theirs = {reinterpret_cast<void*>(req.probe), sizeof(word)};
    if (process_vm_readv(cred.pid, &mine, 1, &theirs, 1, 0) != sizeof(word)) {
      absl::Status st = absl::FailedPreconditionError(absl::StrCat(
          "the daemon may not read the peer's memory (", std::strerror(errno), ")"));
      close(pidfd);
      return st;
    }
    *probe = word;
    grant->SetPeer(cred.pid, pidfd);
    return absl::OkStatus();
  }
  if (req.region >= kShmRegions) {
    return absl::InvalidArgumentError(absl::StrCat("region id ", req.region, " out of range"));
  }
  if (req.bytes < kShmMinRegionBytes || req.bytes > max_region_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("region of ", req.bytes, " bytes outside [",
                                                   kShmMinRegionBytes, ", ", max_region_bytes_,
                                                   "]"));
  }
  struct stat st;
  if (fstat(region_fd, &st) != 0) return Errno("fstat");
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != req.bytes) {
    return absl::InvalidArgumentError("the descriptor is not a memory file of the stated size");
  }
  // A memfd sealed against shrinking: no page of the mapping can disappear under the daemon.
  const int seals = fcntl(region_fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || (seals & F_SEAL_WRITE) != 0) {
    return absl::InvalidArgumentError(
        "the descriptor is not a memfd sealed against shrinking (and writable)");
  }
  // Fully allocated by its owner: the daemon's accesses never allocate (or get charged) pages.
  if (static_cast<uint64_t>(st.st_blocks) * 512 < req.bytes) {
    return absl::InvalidArgumentError("the region is not fully allocated by its owner");
  }
  void* p = mmap(nullptr, req.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, region_fd, 0);
  if (p == MAP_FAILED) return Errno("mmap");
  const int kept = fcntl(region_fd, F_DUPFD_CLOEXEC, 0);  // for Intact()
  if (kept < 0) {
    absl::Status st = Errno("dup");
    munmap(p, req.bytes);
    return st;
  }
  grant->Set(req.region,
             std::make_shared<ShmMapping>(static_cast<uint8_t*>(p), req.bytes, kept));
  (void)fd;
  return absl::OkStatus();
}

// ---- the client's end ----

ShmRegion::~ShmRegion() { munmap(data_, size_); }

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Attach(const wire::HelloOk& hello,
                                                             uint8_t id, uint64_t bytes,
                                                             absl::Time deadline) {
  if (!(hello.server_flags & wire::kServerSharedMemory)) {
    return absl::FailedPreconditionError("the server offers no shared memory");
  }
  bytes = AlignUp(std::max(bytes, kShmMinRegionBytes), 4096);
  if (bytes > hello.shm_max_region_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("a region of ", bytes,
                                                      " bytes is above the server's bound of ",
                                                      hello.shm_max_region_bytes));
  }
  const int fd = memfd_create("kvcomp-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno("memfd_create");
  auto fail = [fd](absl::Status s) {
    close(fd);
    return s;
  };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail(Errno("ftruncate"));
  if (fallocate(fd, 0, 0, static_cast<off_t>(bytes)) != 0) return fail(Errno("fallocate"));
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail(Errno("seal"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return fail(Errno("mmap"));
  std::unique_ptr<ShmRegion> region(new ShmRegion(static_cast<uint8_t*>(p), bytes));
  // An attach is local and quick: a server that takes longer is not worth waiting for.
  deadline = std::min(deadline, absl::Now() + absl::Seconds(5));

  absl::Status attached = SendShmAttach(hello.shm_socket, hello.shm_token, id, bytes, fd,
                                        deadline);
  close(fd);  // the mapping holds the memory; the daemon has its own descriptor, or none
  if (!attached.ok()) return attached;
  return region;
}

absl::Status SendShmAttach(const std::string& socket_name, absl::string_view token, uint8_t id,
                           uint64_t bytes, int fd, absl::Time deadline, uint64_t probe,
                           uint64_t* probe_read) {
  const int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return Errno("socket");
  auto done = [s](absl::Status st) {
    close(s);
    return st;
  };
  socklen_t len = 0;
  sockaddr_un addr = AbstractAddress(socket_name, &len);
  if (connect(s, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return done(Errno("connect to the server's shared-memory socket (another host?)"));
  }
  AttachRequest req = {};
  req.magic = kAttachMagic;
  req.version = kAttachVersion;
  req.region = id;
  req.bytes = bytes;
  req.probe = probe;
  if (!token.empty()) {
    std::memcpy(req.token, token.data(), std::min(token.size(), sizeof(req.token)));
  }
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov = {&req, sizeof(req)};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  if (sendmsg(s, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(req))) {
    return done(Errno("send the attach request"));
  }
  pollfd pf = {s, POLLIN, 0};
  if (poll(&pf, 1, PollMs(deadline)) <= 0) {
    return done(
        absl::DeadlineExceededError("the server did not answer the attach request in time"));
  }
  AttachAnswer a = {};
  const ssize_t n = recv(s, &a, sizeof(a), MSG_DONTWAIT);
  if (n != static_cast<ssize_t>(sizeof(a)) || a.magic != kAttachMagic) {
    return done(absl::UnavailableError("malformed or missing answer to the attach request"));
  }
  if (a.code != 0) {
    const absl::string_view why(a.message, std::min<size_t>(a.message_bytes, sizeof(a.message)));
    return done(absl::Status(static_cast<absl::StatusCode>(a.code),
                             absl::StrCat("the server refused the shared region: ", why)));
  }
  if (probe_read != nullptr) *probe_read = a.probe;
  return done(absl::OkStatus());
}

namespace {
// Bytes [lo, hi) of s0[0..n0) followed by s1 into dst + lo.
void CopyRange(uint8_t* dst, const uint8_t* s0, uint64_t n0, const uint8_t* s1, uint64_t lo,
               uint64_t hi) {
  if (lo < n0) {
    const uint64_t e = std::min(hi, n0);
    std::memcpy(dst + lo, s0 + lo, e - lo);
    lo = e;
  }
  if (lo < hi) std::memcpy(dst + lo, s1 + (lo - n0), hi - lo);
}
}  // namespace

// A block whose copy into the put region was started; posted (in SendBlock's order) once every
// range of it is in place.
struct ShmChannel::Outgoing {
  wire::Block block;
  std::shared_ptr<Completion> done;
  std::atomic<int> ranges_left{0};
  bool copied = false;  // guarded by the channel's put_mu_
};

ShmChannel::ShmChannel(UcxClient* client, ShmChannelOptions options)
    : lanes_(ShmCopyLanes(options.copy_lanes)), client_(client), options_(options) {
  if (lanes_ > 1) pool_ = std::make_unique<CopyPool>(lanes_);
}

int ShmChannel::copy_lanes() const { return lanes_; }

ShmChannel::~ShmChannel() {
  // Copies still queued run and their blocks are posted; blocks in flight reference the put
  // region: wait for their acknowledgement (or the connection's failure, which completes them).
  if (pool_ != nullptr) pool_->Stop();
  absl::MutexLock lock(&put_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(put_mu_) { return slots_.empty(); };
  put_mu_.Await(absl::Condition(&idle));
}

bool ShmChannel::usable() const {
  absl::MutexLock lock(&state_mu_);
  return broken_.ok();
}

ShmChannel::Stats ShmChannel::stats() const {
  return Stats{gets_shared_.load(), gets_as_payload_.load(), blocks_copied_.load(),
               blocks_split_.load()};
}

std::string ShmChannel::why() const {
  absl::MutexLock lock(&state_mu_);
  return std::string(broken_.message());
}

bool ShmChannel::direct() {
  absl::StatusOr<bool> d = Direct(absl::Now() + absl::Seconds(5));
  return d.ok() && *d;
}

absl::StatusOr<bool> ShmChannel::Direct(absl::Time deadline) {
  {
    absl::MutexLock lock(&state_mu_);
    if (!options_.direct) direct_ = DirectMode::kNo;
    if (direct_ != DirectMode::kUntried) return direct_ == DirectMode::kYes;
  }
  // Register as the connection's peer; the daemon proves it reads this process by answering
  // the probe word back.
  static const uint64_t kProbe = 0x6b76636f6d707368;  // "kvcompsh"
  uint64_t read = 0;
  const wire::HelloOk& hello = client_->server_info();
  const absl::Status s = SendShmAttach(hello.shm_socket, hello.shm_token, kShmPeer, 0, -1,
                                       std::min(deadline, absl::Now() + absl::Seconds(5)),
                                       reinterpret_cast<uint64_t>(&kProbe), &read);
  // No answer in time (a stopped daemon, the caller's deadline): undecided, try again later.
  if (absl::IsDeadlineExceeded(s)) return s;
  absl::MutexLock lock(&state_mu_);
  if (direct_ == DirectMode::kUntried) {
    direct_ = s.ok() && read == kProbe ? DirectMode::kYes : DirectMode::kNo;
  }
  return direct_ == DirectMode::kYes;
}

void ShmChannel::Unusable(const absl::Status& why) {
  absl::MutexLock lock(&state_mu_);
  if (broken_.ok()) broken_ = why;
}

absl::Status ShmChannel::EnsurePutRegion(absl::Time deadline) {
  if (put_ != nullptr) return absl::OkStatus();
  const uint64_t bytes =
      std::min(options_.put_region_bytes, client_->server_info().shm_max_region_bytes);
  absl::StatusOr<std::unique_ptr<ShmRegion>> r =
      ShmRegion::Attach(client_->server_info(), kShmPutRegion, bytes, deadline);
  if (!r.ok()) {
    if (!absl::IsDeadlineExceeded(r.status())) Unusable(r.status());
    return r.status();
  }
  put_ = *std::move(r);
  return absl::OkStatus();
}

void ShmChannel::Release(uint64_t offset) {
  absl::MutexLock lock(&put_mu_);
  for (Slot& s : slots_) {
    if (s.offset == offset && !s.done) {
      s.done = true;
      break;
    }
  }
  while (!slots_.empty() && slots_.front().done) slots_.pop_front();
}

absl::StatusOr<std::shared_ptr<Completion>> ShmChannel::SendBlock(const wire::Block& block,
                                                                  const MemoryRegion& keys,
                                                                  const MemoryRegion& values,
                                                                  absl::Time deadline) {
  const uint64_t bytes = block.payload_bytes();
  if (keys.bytes != block.key_bytes || values.bytes != block.value_bytes ||
      (keys.bytes > 0 && keys.data == nullptr) || (values.bytes > 0 && values.data == nullptr)) {
    return absl::InvalidArgumentError("a shm send's regions disagree with its block's sizes");
  }
  KVCOMP_ASSIGN_OR_RETURN(const bool direct, Direct(deadline));
  if (direct) return SendDirect(block, keys, values);
  uint64_t offset = 0;
  uint8_t* base = nullptr;
  auto out = std::make_shared<Outgoing>();
  {
    absl::MutexLock lock(&put_mu_);
    if (absl::Status s = EnsurePutRegion(deadline); !s.ok()) {
      if (absl::IsDeadlineExceeded(s)) return s;
      return MemoryNotServed(LinkKind::kShm, MemoryKind::kHost, s.message());
    }
    const uint64_t size = put_->size();
    const uint64_t need = AlignUp(std::max<uint64_t>(bytes, 1), 4096);
    if (need > size) {
      return MemoryNotServed(LinkKind::kShm, MemoryKind::kHost,
                             absl::StrCat("a block of ", bytes, " bytes exceeds the put region (",
                                          size, ")"));
    }
    // The ring: blocks are acknowledged about in order, their space freed from the front.
    auto place = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(put_mu_) -> bool {
      if (slots_.empty()) {
        offset = 0;
        return true;
      }
      const uint64_t tail = slots_.front().offset;
      const uint64_t head = slots_.back().offset + slots_.back().bytes;
      if (head > tail) {  // not wrapped: [tail, head) in use
        if (head + need <= size) {
          offset = head;
          return true;
        }
        if (need <= tail) {
          offset = 0;
          return true;
        }
        return false;
      }
      if (head + need <= tail) {
        offset = head;
        return true;
      }
      return false;
    };
    if (!put_mu_.AwaitWithDeadline(absl::Condition(&place), deadline)) {
      return absl::DeadlineExceededError("no room in the shared put region in time");
    }
    slots_.push_back(Slot{offset, need, false});
    base = put_->data();
    out->block = block;
    out->block.flags = wire::kBlockSharedMemory;
    out->block.key_crc = 0;
    out->block.value_crc = 0;
    out->block.shm_offset = offset;
    out->done = Completion::Pending();
    outgoing_.push_back(out);
  }
  // The block's copy: on the calling thread with one lane; else on the copy threads, a block of
  // two or more kShmMinClientLaneBytes split into up to `lanes_` contiguous 64 KiB-aligned
  // ranges, several blocks at once. The block is posted when all its ranges are in place and
  // every block before it was posted, so blocks go out in the caller's order and the daemon
  // never reads a slot still being written.
  uint8_t* const dst = base + offset;
  const auto* s0 = static_cast<const uint8_t*>(keys.data);
  const auto* s1 = static_cast<const uint8_t*>(values.data);
  const uint64_t n0 = keys.bytes;
  std::shared_ptr<Completion> done = out->done;
  blocks_copied_++;
  if (pool_ == nullptr) {
    CopyRange(dst, s0, n0, s1, 0, bytes);
    Copied(out);
    return done;
  }
  const uint64_t ranges =
      std::min<uint64_t>(lanes_, std::max<uint64_t>(bytes / kShmMinClientLaneBytes, 1));
  const uint64_t share = AlignUp((bytes + ranges - 1) / ranges, uint64_t{64} << 10);
  uint64_t n = 1;
  while (n < ranges && share * n < bytes) ++n;
  if (n > 1) blocks_split_++;
  out->ranges_left.store(static_cast<int>(n));
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t lo = share * i, hi = std::min(bytes, share * (i + 1));
    pool_->Run([this, out, dst, s0, n0, s1, lo, hi] {
      CopyRange(dst, s0, n0, s1, lo, hi);
      if (out->ranges_left.fetch_sub(1) == 1) Copied(out);
    });
  }
  return done;
}

void ShmChannel::Copied(const std::shared_ptr<Outgoing>& block) {
  // One thread posts at a time, front to back, outside the lock (a completion's callback may
  // send the next block).
  std::vector<std::shared_ptr<Outgoing>> ready;
  {
    absl::MutexLock lock(&put_mu_);
    block->copied = true;
    if (posting_) return;  // the thread posting now takes it
    posting_ = true;
  }
  while (true) {
    {
      absl::MutexLock lock(&put_mu_);
      while (!outgoing_.empty() && outgoing_.front()->copied) {
        ready.push_back(std::move(outgoing_.front()));
        outgoing_.pop_front();
      }
      if (ready.empty()) {
        posting_ = false;
        return;
      }
    }
    for (std::shared_ptr<Outgoing>& o : ready) {
      client_->SendSharedBlockAsync(
          o->block, [this, offset = o->block.shm_offset, done = o->done](absl::Status s) {
            Release(offset);
            done->Finish(std::move(s));
          });
    }
    ready.clear();
  }
}

absl::StatusOr<std::shared_ptr<Completion>> ShmChannel::SendDirect(const wire::Block& block,
                                                                   const MemoryRegion& keys,
                                                                   const MemoryRegion& values) {
  wire::Block b = block;
  b.flags = wire::kBlockPeerMemory;
  b.key_crc = 0;
  b.value_crc = 0;
  b.shm_offset = reinterpret_cast<uint64_t>(keys.data);
  b.peer_values = reinterpret_cast<uint64_t>(values.data);
  std::shared_ptr<Completion> done = Completion::Pending();
  client_->SendSharedBlockAsync(b, [done](absl::Status s) { done->Finish(std::move(s)); });
  return done;
}

// Waits for a get posted with GetSharedAsync.
namespace {
struct GetOutcome {
  absl::Mutex mu;
  bool done = false;
  absl::StatusOr<SharedGet> result = absl::UnknownError("unset");
};

// Follows a get the daemon writes into the get region until its reply: calls `copy_behind()`
// whenever the region's progress names request `rid` (the caller copies what was written so
// far), then returns the reply.
template <typename CopyBehind>
absl::StatusOr<SharedGet> FollowSharedGet(GetOutcome& out, const ShmProgress& progress,
                                          uint64_t rid, CopyBehind&& copy_behind) {
  while (true) {
    {
      absl::MutexLock l(&out.mu);
      if (out.done) return std::move(out.result);
      out.mu.AwaitWithTimeout(absl::Condition(&out.done), absl::Microseconds(200));
      if (out.done) return std::move(out.result);
    }
    if (progress.request_id.load(std::memory_order_acquire) == rid) copy_behind();
  }
}
}  // namespace

absl::StatusOr<uint64_t> ShmChannel::GetInto(const GetRequest& request, void* dst,
                                             uint64_t capacity, absl::Time deadline) {
  if (dst == nullptr && capacity > 0) return absl::InvalidArgumentError("GetInto: null buffer");
  KVCOMP_ASSIGN_OR_RETURN(const bool direct, Direct(deadline));
  if (direct) {
    // One copy: the daemon writes the cache into `dst` itself.
    wire::Get get{request.representation, request.model_id, request.key, false,
                  reinterpret_cast<uint64_t>(dst), capacity, true};
    auto out = std::make_shared<GetOutcome>();
    client_->GetSharedAsync(get, dst, capacity, deadline, [out](absl::StatusOr<SharedGet> r) {
      absl::MutexLock l(&out->mu);
      out->result = std::move(r);
      out->done = true;
    });
    absl::MutexLock l(&out->mu);
    out->mu.Await(absl::Condition(&out->done));
    if (out->result.ok()) {
      (out->result->in_region ? gets_shared_ : gets_as_payload_)++;
      return out->result->bytes;
    }
    // The daemon could not reach this process's memory after all: the get region from now on.
    if (!absl::IsFailedPrecondition(out->result.status())) return out->result.status();
    absl::MutexLock s(&state_mu_);
    direct_ = DirectMode::kNo;
  }
  absl::MutexLock lock(&get_mu_);
  KVCOMP_RETURN_IF_ERROR(EnsureGetRegion(kShmGetDataOffset + capacity, deadline));
  const uint64_t room = get_->size() - kShmGetDataOffset;
  const uint64_t asked = std::min<uint64_t>(capacity, room);
  auto* progress = reinterpret_cast<ShmProgress*>(get_->data());
  progress->request_id.store(0, std::memory_order_relaxed);
  progress->written.store(0, std::memory_order_release);

  wire::Get get{request.representation, request.model_id, request.key, true, kShmGetDataOffset,
                asked};
  // A cache larger than the region but within the caller's capacity comes as the reply's
  // payload straight into `dst`, in this request (a daemon of minor >= 3).
  get.or_payload = asked < capacity && client_->server_info().server_minor >= 3;
  auto out = std::make_shared<GetOutcome>();
  const uint64_t rid = client_->GetSharedAsync(get, dst, capacity, deadline,
                                               [out](absl::StatusOr<SharedGet> r) {
                                                 absl::MutexLock l(&out->mu);
                                                 out->result = std::move(r);
                                                 out->done = true;
                                               });
  // Copy behind the daemon while it writes (it stamps the request's id first).
  const uint8_t* src = get_->data() + kShmGetDataOffset;
  uint8_t* to = static_cast<uint8_t*>(dst);
  uint64_t copied = 0;
  absl::StatusOr<SharedGet> r = FollowSharedGet(*out, *progress, rid, [&] {
    const uint64_t w = std::min(progress->written.load(std::memory_order_acquire), asked);
    if (w > copied) {
      std::memcpy(to + copied, src + copied, w - copied);
      copied = w;
    }
  });
  if (!r.ok()) {
    // A get given up on may still be written by the daemon: the next get takes a fresh region.
    if (absl::IsDeadlineExceeded(r.status()) || absl::IsUnavailable(r.status())) get_.reset();
    // Larger than the region could be made but within the caller's capacity: over UCX.
    if (absl::IsOutOfRange(r.status()) && asked < capacity) {
      return MemoryNotServed(LinkKind::kShm, MemoryKind::kHost, r.status().message());
    }
    return r.status();
  }
  if (!r->in_region) {  // sent as a payload, already in dst
    gets_as_payload_++;
    return r->bytes;
  }
  gets_shared_++;
  if (r->bytes > asked) {
    return absl::InternalError("the server wrote more than the get region's capacity");
  }
  if (r->bytes > copied) std::memcpy(to + copied, src + copied, r->bytes - copied);
  return r->bytes;
}

absl::Status ShmChannel::EnsureGetRegion(uint64_t want, absl::Time deadline) {
  const uint64_t bound = std::min(options_.max_get_region_bytes,
                                  client_->server_info().shm_max_region_bytes);
  want = std::min(AlignUp(want, 2 << 20), bound);
  if (get_ != nullptr && get_->size() >= want) return absl::OkStatus();
  get_.reset();
  absl::StatusOr<std::unique_ptr<ShmRegion>> r =
      ShmRegion::Attach(client_->server_info(), kShmGetRegion, want, deadline);
  if (!r.ok()) {
    if (absl::IsDeadlineExceeded(r.status())) return r.status();
    Unusable(r.status());
    return MemoryNotServed(LinkKind::kShm, MemoryKind::kHost, r.status().message());
  }
  get_ = *std::move(r);
  return absl::OkStatus();
}

namespace {
// The get region Get makes before it has seen a cache: grown to the largest cache sent as a
// payload since (kept within the bounds).
constexpr uint64_t kFirstGetRegionBytes = uint64_t{64} << 20;
constexpr uint64_t kHugePage = uint64_t{2} << 20;

// Waits for a get posted with GetSharedAsync until it is answered.
absl::StatusOr<SharedGet> AwaitGet(const std::shared_ptr<GetOutcome>& out) {
  absl::MutexLock l(&out->mu);
  out->mu.Await(absl::Condition(&out->done));
  return std::move(out->result);
}

// A new host buffer of `bytes` for a get's cache: anonymous memory advised for huge pages, so a
// buffer of hundreds of MiB is made of far fewer page faults as it is written; unmapped when
// the buffer goes. Empty on failure.
Buffer NewGetBuffer(uint64_t bytes) {
  if (bytes == 0) return Buffer::Allocate(0);
  const uint64_t span = AlignUp(bytes, kHugePage) + kHugePage;
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return Buffer();
  uint8_t* const raw = static_cast<uint8_t*>(m);
  uint8_t* const base =
      reinterpret_cast<uint8_t*>(AlignUp(reinterpret_cast<uint64_t>(raw), kHugePage));
  const uint64_t len = AlignUp(bytes, kHugePage);
  if (base > raw) munmap(raw, base - raw);
  if (raw + span > base + len) munmap(base + len, (raw + span) - (base + len));
  madvise(base, len, MADV_HUGEPAGE);  // a hint; ignored where huge pages are off
  return Buffer::Wrap(base, bytes, MemoryType::kHost, [base, len] { munmap(base, len); });
}
}  // namespace

absl::StatusOr<FetchedCache> ShmChannel::Get(const GetRequest& request, absl::Time deadline) {
  if (client_->server_info().server_minor < 3) {
    return MemoryNotServed(LinkKind::kShm, MemoryKind::kHost,
                           "the daemon's protocol has no gets of unknown size over shared memory");
  }
  KVCOMP_ASSIGN_OR_RETURN(const bool direct, Direct(deadline));
  if (direct) {
    absl::StatusOr<FetchedCache> r = GetDirect(request, deadline);
    // The daemon could not reach this process's memory after all: the get region from now on.
    if (!absl::IsFailedPrecondition(r.status())) return r;
    absl::MutexLock s(&state_mu_);
    direct_ = DirectMode::kNo;
  }
  absl::MutexLock lock(&get_mu_);
  KVCOMP_RETURN_IF_ERROR(EnsureGetRegion(
      kShmGetDataOffset + std::max(get_hint_, get_ != nullptr ? uint64_t{0} : kFirstGetRegionBytes),
      deadline));
  const uint64_t room = get_->size() - kShmGetDataOffset;
  wire::Get get{request.representation, request.model_id, request.key, true, kShmGetDataOffset,
                room};
  get.or_payload = true;
  auto* progress = reinterpret_cast<ShmProgress*>(get_->data());
  progress->request_id.store(0, std::memory_order_relaxed);
  progress->total.store(0, std::memory_order_relaxed);
  progress->written.store(0, std::memory_order_release);
  auto out = std::make_shared<GetOutcome>();
  const uint64_t rid =
      client_->GetSharedAsync(get, nullptr, 0, deadline, [out](absl::StatusOr<SharedGet> r) {
        absl::MutexLock l(&out->mu);
        out->result = std::move(r);
        out->done = true;
      });
  // Copy behind the daemon into a buffer of the size it published (as GetInto does).
  const uint8_t* src = get_->data() + kShmGetDataOffset;
  Buffer bytes;
  uint64_t copied = 0;
  absl::StatusOr<SharedGet> r = FollowSharedGet(*out, *progress, rid, [&] {
    const uint64_t total = progress->total.load(std::memory_order_relaxed);
    if (total == 0 || total > room) return;  // not said (an older daemon): after the reply
    if (bytes.data() == nullptr) bytes = NewGetBuffer(total);
    if (bytes.data() == nullptr) return;
    const uint64_t w = std::min(progress->written.load(std::memory_order_acquire), total);
    if (w > copied) {
      std::memcpy(bytes.bytes() + copied, src + copied, w - copied);
      copied = w;
    }
  });
  if (!r.ok()) {
    // A get given up on may still be written by the daemon: the next get takes a fresh region.
    if (absl::IsDeadlineExceeded(r.status()) || absl::IsUnavailable(r.status())) get_.reset();
    return r.status();
  }
  if (!r->in_region) {
    // Larger than the region: it came as the payload. The next get's region holds such a cache.
    gets_as_payload_++;
    get_hint_ = std::max(get_hint_, r->bytes);
    return FetchedCache{std::move(r->payload), request.representation};
  }
  gets_shared_++;
  if (r->bytes > room) {
    return absl::InternalError("the server wrote more than the get region's capacity");
  }
  if (bytes.data() == nullptr || bytes.size() != r->bytes) {
    bytes = NewGetBuffer(r->bytes);
    copied = 0;
    if (r->bytes > 0 && bytes.data() == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("no memory for a cache of ", r->bytes, " bytes"));
    }
  }
  if (r->bytes > copied) std::memcpy(bytes.bytes() + copied, src + copied, r->bytes - copied);
  return FetchedCache{std::move(bytes), request.representation};
}

absl::StatusOr<FetchedCache> ShmChannel::GetDirect(const GetRequest& request,
                                                   absl::Time deadline) {
  // Address space for the largest cache taken this way (no memory until written: the daemon's
  // write makes the pages, huge pages where the kernel gives them), 2 MiB aligned.
  const uint64_t room = AlignUp(std::max<uint64_t>(options_.max_get_region_bytes, 4096), 4096);
  const uint64_t span = room + kHugePage;
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    return MemoryNotServed(LinkKind::kShm, MemoryKind::kHost,
                           absl::StrCat("no address space for a get of up to ", room,
                                        " bytes: ", std::strerror(errno)));
  }
  uint8_t* const raw = static_cast<uint8_t*>(m);
  uint8_t* const base =
      reinterpret_cast<uint8_t*>(AlignUp(reinterpret_cast<uint64_t>(raw), kHugePage));
  if (base > raw) munmap(raw, base - raw);
  uint8_t* const end = raw + span;
  if (end > base + room) munmap(base + room, end - (base + room));
  madvise(base, room, MADV_HUGEPAGE);  // a hint; ignored where huge pages are off

  wire::Get get{request.representation, request.model_id, request.key, false,
                reinterpret_cast<uint64_t>(base), room, true};
  get.or_payload = true;
  auto out = std::make_shared<GetOutcome>();
  client_->GetSharedAsync(get, nullptr, 0, deadline, [out](absl::StatusOr<SharedGet> r) {
    absl::MutexLock l(&out->mu);
    out->result = std::move(r);
    out->done = true;
  });
  absl::StatusOr<SharedGet> r = AwaitGet(out);
  if (!r.ok() || !r->in_region) {
    if (!r.ok() && (absl::IsDeadlineExceeded(r.status()) || absl::IsUnavailable(r.status()))) {
      // The daemon may still be writing there: the range stays reserved, inaccessible (a late
      // write fails) and without memory, never reused by another mapping.
      mprotect(base, room, PROT_NONE);
      madvise(base, room, MADV_DONTNEED);
    } else {
      munmap(base, room);
    }
    if (!r.ok()) return r.status();
    gets_as_payload_++;
    return FetchedCache{std::move(r->payload), request.representation};
  }
  gets_shared_++;
  if (r->bytes > room) {
    munmap(base, room);
    return absl::InternalError("the server wrote more than the get's capacity");
  }
  // What the cache did not use goes back; the buffer owns the rest.
  const uint64_t keep = std::min(room, AlignUp(std::max<uint64_t>(r->bytes, 1), kHugePage));
  if (keep < room) munmap(base + keep, room - keep);
  return FetchedCache{Buffer::Wrap(base, r->bytes, MemoryType::kHost,
                                   [base, keep] { munmap(base, keep); }),
                      request.representation};
}

absl::StatusOr<Registration> ShmLink::Register(const MemoryRegion& region) {
  if (region.kind != MemoryKind::kHost) {
    return MemoryNotServed(LinkKind::kShm, region.kind, "it moves host memory");
  }
  if (!channel_->usable()) {
    return MemoryNotServed(LinkKind::kShm, region.kind, channel_->why());
  }
  return Registration{region, ""};
}

absl::StatusOr<std::shared_ptr<Completion>> ShmLink::Post(const Transfer& t) {
  for (const MemoryRegion& r : t.regions) {
    if (r.kind != MemoryKind::kHost) {
      return MemoryNotServed(LinkKind::kShm, r.kind, "it moves host memory");
    }
  }
  if (t.direction == Direction::kSend) {
    if (t.block == nullptr || t.regions.size() != 2) {
      return absl::InvalidArgumentError("a shm send is one put block: its keys and values");
    }
    return channel_->SendBlock(*t.block, t.regions[0], t.regions[1], t.deadline);
  }
  if (t.get == nullptr || t.regions.size() != 1) {
    return absl::InvalidArgumentError("a shm receive is one get into one region");
  }
  absl::StatusOr<uint64_t> n =
      channel_->GetInto(*t.get, t.regions[0].data, t.regions[0].bytes, t.deadline);
  if (!n.ok()) {
    if (AfterLinkFailure(n.status()) == LinkVerdict::kNextLink) return n.status();
    return Completion::Done(n.status());
  }
  return Completion::Done(absl::OkStatus(), *n);
}

}  // namespace transport
}  // namespace kvcomp
