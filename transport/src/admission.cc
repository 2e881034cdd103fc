#include "transport/src/admission.h"

#include <dirent.h>
#include <sys/resource.h>
#include <ucs/debug/log_def.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcomp {
namespace transport {

uint64_t TenantBudget::ShareOf(uint64_t total, double share, uint64_t floor) {
  share = std::clamp(share, 0.0, 1.0);
  const uint64_t part = static_cast<uint64_t>(static_cast<long double>(total) * share);
  return std::min(total, std::max(part, floor));
}

TenantBudget::Refusal TenantBudget::TryReserve(absl::string_view tenant, uint64_t units) {
  absl::MutexLock lock(&mu_);
  if (units > total_ || used_ > total_ - units) return Refusal::kTotal;
  auto it = by_tenant_.find(tenant);
  const uint64_t held = it == by_tenant_.end() ? 0 : it->second;
  if (units > tenant_limit_ || held > tenant_limit_ - units) return Refusal::kTenant;
  used_ += units;
  if (it == by_tenant_.end()) {
    by_tenant_.emplace(std::string(tenant), units);
  } else {
    it->second += units;
  }
  return Refusal::kNone;
}

void TenantBudget::Release(absl::string_view tenant, uint64_t units) {
  absl::MutexLock lock(&mu_);
  used_ -= std::min(used_, units);
  auto it = by_tenant_.find(tenant);
  if (it == by_tenant_.end()) return;
  it->second -= std::min(it->second, units);
  if (it->second == 0) by_tenant_.erase(it);
}

uint64_t TenantBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

uint64_t TenantBudget::used_by(absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = by_tenant_.find(tenant);
  return it == by_tenant_.end() ? 0 : it->second;
}

FdUsage CurrentFdUsage() {
  FdUsage u;
  rlimit rl = {};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) u.limit = rl.rlim_cur;
  // Opened once and rewound for each count: when the descriptors run out, opening the
  // directory would fail exactly when the count matters.
  static absl::Mutex mu(absl::kConstInit);
  static DIR* dir = nullptr;
  absl::MutexLock lock(&mu);
  if (dir == nullptr) dir = opendir("/proc/self/fd");
  if (dir == nullptr) {
    u.open = u.limit;  // cannot even open a directory: none left
    return u;
  }
  rewinddir(dir);
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++u.open;
  }
  if (u.open > 0) --u.open;  // the directory's own descriptor
  return u;
}

bool LogRateLimiter::Allow(absl::string_view key, uint64_t* suppressed) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  Window& w = windows_[key];
  if (now - w.start >= period_) {
    w.start = now;
    w.count = 0;
  }
  if (w.count >= burst_) {
    ++w.suppressed;
    return false;
  }
  ++w.count;
  *suppressed = w.suppressed;
  w.suppressed = 0;
  return true;
}

namespace {

struct UcxLogState {
  LogRateLimiter limiter{5, absl::Seconds(1)};
  absl::Mutex mu;
  uint64_t next_hook = 1;
  std::map<uint64_t, absl::AnyInvocable<void()>> hooks ABSL_GUARDED_BY(mu);
};

UcxLogState& State() {
  static UcxLogState* state = new UcxLogState();
  return *state;
}

// UCX words it "accept() failed (client addr ...): the maximal number of files ..." through a
// helper that takes the call's name as an argument: the formatted line is what tells.
bool IsAcceptFailure(const char* format, va_list ap) {
  if (format == nullptr) return false;
  char line[256];
  va_list copy;
  va_copy(copy, ap);
  vsnprintf(line, sizeof(line), format, copy);
  va_end(copy);
  return std::strstr(line, "accept") != nullptr;
}

ucs_log_func_rc_t LimitUcxLog(const char* file, unsigned line, const char* function,
                              ucs_log_level_t level, const ucs_log_component_config_t* comp_conf,
                              const char* format, va_list ap) {
  UcxLogState& st = State();
  if (level <= UCS_LOG_LEVEL_WARN && IsAcceptFailure(format, ap)) {
    absl::MutexLock lock(&st.mu);
    for (auto& [id, hook] : st.hooks) hook();
  }
  uint64_t suppressed = 0;
  if (!st.limiter.Allow(absl::StrCat(file == nullptr ? "" : file, ":", line), &suppressed)) {
    return UCS_LOG_FUNC_RC_STOP;
  }
  if (suppressed > 0) {
    const std::string note =
        absl::StrFormat("[UCX] %s:%u: %u similar line(s) suppressed\n", file, line, suppressed);
    ssize_t ignored = write(STDERR_FILENO, note.data(), note.size());
    (void)ignored;
  }
  return UCS_LOG_FUNC_RC_CONTINUE;
}

}  // namespace

void InstallUcxLogLimiter() {
  static const bool installed = [] {
    ucs_log_push_handler(&LimitUcxLog);
    return true;
  }();
  (void)installed;
}

uint64_t AddAcceptFailureHook(absl::AnyInvocable<void()> hook) {
  UcxLogState& st = State();
  absl::MutexLock lock(&st.mu);
  const uint64_t id = st.next_hook++;
  st.hooks.emplace(id, std::move(hook));
  return id;
}

void RemoveAcceptFailureHook(uint64_t id) {
  UcxLogState& st = State();
  absl::MutexLock lock(&st.mu);
  st.hooks.erase(id);
}

}  // namespace transport
}  // namespace kvcomp
