#include "transport/src/ucx_util.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/protocol.h"

namespace kvcomp {
namespace transport {

absl::StatusOr<UcpContext> UcpContext::Create(const UcxConfig& config, bool wakeup) {
  ucp_config_t* cfg = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_config_read");
  for (const auto& [name, value] : config.overrides) {
    s = ucp_config_modify(cfg, name.c_str(), value.c_str());
    if (s != UCS_OK) {
      ucp_config_release(cfg);
      return UcsStatusToStatus(s, absl::StrCat("UCX setting ", name, "=", value));
    }
  }
  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | (wakeup ? UCP_FEATURE_WAKEUP : 0);
  params.name = "kvcomp";
  UcpContext ctx;
  s = ucp_init(&params, cfg, &ctx.h_);
  ucp_config_release(cfg);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_init");
  return ctx;
}

absl::Status BindDeviceContext(const void* device_ptr) {
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, GpuRuntime::Get());
  KVCOMP_ASSIGN_OR_RETURN(int device, rt->DeviceOf(device_ptr));
  return rt->SetDevice(device);
}

absl::StatusOr<std::unique_ptr<UcpMemReg>> UcpMemReg::Map(ucp_context_h context, void* data,
                                                           size_t size, ucs_memory_type_t type) {
  ucp_mem_map_params_t params = {};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = data;
  params.length = size;
  params.memory_type = type;
  ucp_mem_h h = nullptr;
  const ucs_status_t s = ucp_mem_map(context, &params, &h);
  if (s != UCS_OK) {
    return UcsStatusToStatus(s, absl::StrCat("ucp_mem_map of ", size, " bytes of ",
                                             type == UCS_MEMORY_TYPE_CUDA ? "CUDA" : "host",
                                             " memory"));
  }
  return std::unique_ptr<UcpMemReg>(new UcpMemReg(context, h));
}

absl::StatusOr<UcpWorker> UcpWorker::Create(ucp_context_h context, bool wakeup) {
  ucp_worker_params_t params = {};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (wakeup) {
    params.field_mask |= UCP_WORKER_PARAM_FIELD_EVENTS;
    params.events = UCP_WAKEUP_RMA | UCP_WAKEUP_AMO | UCP_WAKEUP_TAG_SEND | UCP_WAKEUP_TAG_RECV |
                    UCP_WAKEUP_TX | UCP_WAKEUP_RX;
  }
  UcpWorker w;
  ucs_status_t s = ucp_worker_create(context, &params, &w.h_);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_worker_create");
  return w;
}

absl::Status WorkerLoop::SetAmHandler(unsigned am_id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t am = {};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  am.id = am_id;
  am.cb = cb;
  am.arg = arg;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  const ucs_status_t s = ucp_worker_set_am_recv_handler(worker(), &am);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_worker_set_am_recv_handler");
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<WorkerLoop>> WorkerLoop::Create(const UcxConfig& config,
                                                              absl::Duration poll_spin) {
  std::shared_ptr<WorkerLoop> loop(new WorkerLoop());
  KVCOMP_ASSIGN_OR_RETURN(loop->context_, UcpContext::Create(config, /*wakeup=*/true));
  KVCOMP_ASSIGN_OR_RETURN(loop->worker_, UcpWorker::Create(loop->context_.get(), true));
  ucp_context_attr_t cattr = {};
  cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(loop->context_.get(), &cattr) == UCS_OK) {
    loop->cuda_memory_ = (cattr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  ucp_worker_attr_t attr = {};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  ucs_status_t s = ucp_worker_query(loop->worker_.get(), &attr);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_worker_query");
  if (attr.max_am_header < wire::kMaxFrameBytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "UCX allows active-message headers of ", attr.max_am_header,
        " bytes with these transports; the protocol needs ", wire::kMaxFrameBytes));
  }
  s = ucp_worker_get_efd(loop->worker_.get(), &loop->efd_);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_worker_get_efd");
  loop->poll_spin_ = poll_spin;
  return loop;
}

WorkerLoop::~WorkerLoop() {
  Shutdown([] {});
  // Drop anything queued without running it (the owners are gone).
  absl::MutexLock l(&mu_);
  posted_.clear();
}

void WorkerLoop::Start(absl::AnyInvocable<void()> tick, absl::Duration tick_period) {
  tick_ = std::move(tick);
  tick_period_ = tick_period;
  thread_ = std::thread([this] { Run(); });
}

bool WorkerLoop::Post(absl::AnyInvocable<void()> fn) {
  {
    absl::MutexLock l(&mu_);
    if (!accepting_) return false;
    posted_.push_back(std::move(fn));
    has_posted_.store(true);
  }
  // The loop thread checks has_posted_ after announcing it sleeps: with both sides seq_cst, one
  // of them sees the other, so the signal (a syscall) is needed only while it may sleep.
  if (sleeping_.load()) ucp_worker_signal(worker_.get());
  return true;
}

void WorkerLoop::Shutdown(absl::AnyInvocable<void()> fn) {
  {
    absl::MutexLock l(&mu_);
    if (!accepting_) return;
    accepting_ = false;
    if (thread_.joinable()) {
      posted_.push_back([this, fn = std::move(fn)]() mutable {
        fn();
        stop_.store(true);
      });
      has_posted_.store(true, std::memory_order_release);
    }
  }
  if (!thread_.joinable()) {
    fn();
    return;
  }
  ucp_worker_signal(worker_.get());
  if (InLoopThread()) {
    thread_.detach();  // cannot join ourselves; Run() ends after the posted function
  } else {
    thread_.join();
  }
}

bool WorkerLoop::RunPosted() {
  if (!has_posted_.load(std::memory_order_acquire)) return false;
  std::vector<absl::AnyInvocable<void()>> batch;
  {
    absl::MutexLock l(&mu_);
    batch.swap(posted_);
    has_posted_.store(false, std::memory_order_release);
  }
  for (auto& fn : batch) fn();
  return !batch.empty();
}

void WorkerLoop::Sleep(absl::Duration max_wait) {
  if (ucp_worker_arm(worker_.get()) == UCS_ERR_BUSY) return;
  sleeping_.store(true);
  if (!has_posted_.load()) {
    pollfd p = {efd_, POLLIN, 0};
    const int ms = static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(max_wait)));
    poll(&p, 1, ms);
  }
  sleeping_.store(false);
}

void WorkerLoop::Run() {
  absl::Time now = absl::Now();
  absl::Time last_event = now;
  absl::Time next_tick = now + tick_period_;
  while (!stop_.load(std::memory_order_relaxed)) {
    const bool ran = RunPosted();
    const unsigned progressed = ucp_worker_progress(worker_.get());
    now = absl::Now();
    if (now >= next_tick) {
      if (tick_) tick_();
      next_tick = now + tick_period_;
    }
    if (ran || progressed > 0) {
      last_event = now;
      continue;
    }
    if (now - last_event < poll_spin_) {
      sched_yield();  // let the threads that have work run (matters when cores are few)
      continue;
    }
    Sleep(std::min(next_tick - now, absl::Milliseconds(100)));
    last_event = absl::Now();
  }
}

absl::Status CheckAddressFamilySupported(int family, absl::string_view what) {
  if (family != AF_INET6) return absl::OkStatus();
  unsigned major, minor, release;
  ucp_get_version(&major, &minor, &release);
  if (major > 1 || (major == 1 && minor > 13)) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      what, ": IPv6 is not supported with UCX ", major, ".", minor, ".", release,
      " (its tcp sockaddr connection manager overflows a buffer on IPv6); use IPv4"));
}

absl::Status CheckListenAddressServesDataLanes(const struct sockaddr* addr, absl::string_view what) {
  if (addr == nullptr || addr->sa_family != AF_INET) return absl::OkStatus();
  const in_addr want = reinterpret_cast<const sockaddr_in*>(addr)->sin_addr;
  if (want.s_addr == htonl(INADDR_ANY)) return absl::OkStatus();
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return absl::OkStatus();  // cannot tell: let UCX decide
  const ifaddrs* owner = nullptr;
  for (const ifaddrs* i = all; i != nullptr && owner == nullptr; i = i->ifa_next) {
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET &&
        reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == want.s_addr) {
      owner = i;
    }
  }
  const ifaddrs* first = nullptr;  // the address UCX's data lanes listen on for that interface
  for (const ifaddrs* i = all; owner != nullptr && i != nullptr && first == nullptr;
       i = i->ifa_next) {
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET &&
        std::string(i->ifa_name) == owner->ifa_name) {
      first = i;
    }
  }
  auto ip_of = [](const sockaddr* sa) {
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof(buf));
    return std::string(buf);
  };
  std::string error;
  const std::string ip = ip_of(addr);
  if (owner == nullptr) {
    error = absl::StrCat(ip, " is not an address of any network interface (add it to one, ",
                         "for example with ip addr add, or listen on 0.0.0.0)");
  } else if ((owner->ifa_flags & IFF_UP) == 0 || (owner->ifa_flags & IFF_RUNNING) == 0) {
    error = absl::StrCat("interface ", owner->ifa_name, " of ", ip, " is not up and running");
  } else if (first != owner) {
    error = absl::StrCat(ip, " is a secondary address of ", owner->ifa_name, ", whose first is ",
                         ip_of(first->ifa_addr),
                         ", where UCX listens for the data lanes (listen on that address, or "
                         "give each daemon an interface of its own)");
  }
  freeifaddrs(all);
  if (error.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": ", error, "; UCX clients could not complete a connection"));
}

namespace {
void DropDone(void* request, ucs_status_t status, size_t length, void* user_data) {
  ucp_request_free(request);
}
}  // namespace

void DropRendezvous(ucp_worker_h worker, void* data_desc) {
  static char sink[1];
  ucp_request_param_t p = {};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
  p.cb.recv_am = &DropDone;
  void* req = ucp_am_recv_data_nbx(worker, data_desc, sink, 0, &p);
  (void)req;
}

std::string SockaddrToString(const struct sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa == nullptr) return "?";
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    return absl::StrCat(buf, ":", ntohs(in->sin_port));
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
    return absl::StrCat("[", buf, "]:", ntohs(in6->sin6_port));
  }
  return "?";
}

}  // namespace transport
}  // namespace kvcomp
