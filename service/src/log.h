// Minimal leveled logging to stderr (Debian's Abseil has no absl/log). Thread-safe: one write(2)
// per line. LogLimited bounds what a flood of bad requests can write.
#ifndef KVCOMP_SERVICE_SRC_LOG_H_
#define KVCOMP_SERVICE_SRC_LOG_H_

#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

// process.log_format: false = text lines ("<time> I kvcompd: ..."), true = one JSON object per
// line ({"ts": ..., "level": "info", "logger": "kvcompd", "msg": ...}).
inline std::atomic<bool>& LogJson() {
  static std::atomic<bool> json{false};
  return json;
}

inline void SetLogFormat(const std::string& name) { LogJson().store(name == "json"); }

// `text` as a JSON string's contents (quotes, backslashes and control characters escaped).
inline std::string JsonEscape(const std::string& text) {
  std::string out;
  out.reserve(text.size() + 8);
  for (unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          static const char kHex[] = "0123456789abcdef";
          out += "\\u00";
          out.push_back(kHex[c >> 4]);
          out.push_back(kHex[c & 15]);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out;
}

template <typename... Args>
void Log(LogLevel level, const Args&... args) {
  if (static_cast<int>(level) < LogThreshold().load()) return;
  static const char* kNames[] = {"D", "I", "W", "E"};
  static const char* kLevels[] = {"debug", "info", "warning", "error"};
  const std::string ts =
      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  std::string line;
  if (LogJson().load()) {
    line = absl::StrCat("{\"ts\":\"", ts, "\",\"level\":\"", kLevels[static_cast<int>(level)],
                        "\",\"logger\":\"kvcompd\",\"msg\":\"", JsonEscape(absl::StrCat(args...)),
                        "\"}\n");
  } else {
    line = absl::StrCat(ts, " ", kNames[static_cast<int>(level)], " kvcompd: ", args..., "\n");
  }
  ssize_t ignored = write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

// The lines of one call site that a flood (bad hellos, refused connections) may repeat: at most
// `burst` per `period`; the next line written says how many were dropped. Thread-safe; declare
// one per call site (a function-local static).
class LogRate {
 public:
  LogRate(int burst, absl::Duration period) : burst_(burst), period_(period) {}
  // True when a line may be written now; `dropped` gets the count suppressed before it.
  bool Allow(uint64_t* dropped) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu_);
    if (now - start_ >= period_) {
      start_ = now;
      count_ = 0;
    }
    if (count_ >= burst_) {
      ++dropped_;
      return false;
    }
    ++count_;
    *dropped = dropped_;
    dropped_ = 0;
    return true;
  }

 private:
  const int burst_;
  const absl::Duration period_;
  absl::Mutex mu_;
  absl::Time start_ = absl::InfinitePast();
  int count_ = 0;
  uint64_t dropped_ = 0;
};

// Log() through `rate`.
template <typename... Args>
void LogLimited(LogRate& rate, LogLevel level, const Args&... args) {
  if (static_cast<int>(level) < LogThreshold().load()) return;
  uint64_t dropped = 0;
  if (!rate.Allow(&dropped)) return;
  if (dropped > 0) {
    Log(level, args..., " (", dropped, " similar line(s) suppressed)");
  } else {
    Log(level, args...);
  }
}

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_LOG_H_
