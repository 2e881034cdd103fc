// Minimal leveled logging to stderr (Debian's Abseil has no absl/log). Thread-safe: one write(2)
// per line.
#ifndef KVCOMP_SERVICE_SRC_LOG_H_
#define KVCOMP_SERVICE_SRC_LOG_H_

#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcomp {
namespace service {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

inline std::atomic<int>& LogThreshold() {
  static std::atomic<int> level{static_cast<int>(LogLevel::kInfo)};
  return level;
}

inline void SetLogLevel(const std::string& name) {
  LogLevel l = LogLevel::kInfo;
  if (name == "debug") l = LogLevel::kDebug;
  if (name == "warning") l = LogLevel::kWarning;
  if (name == "error") l = LogLevel::kError;
  LogThreshold().store(static_cast<int>(l));
}

template <typename... Args>
void Log(LogLevel level, const Args&... args) {
  if (static_cast<int>(level) < LogThreshold().load()) return;
  static const char* kNames[] = {"D", "I", "W", "E"};
  std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                   kNames[static_cast<int>(level)], " kvcompd: ", args..., "\n");
  ssize_t ignored = write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_LOG_H_
