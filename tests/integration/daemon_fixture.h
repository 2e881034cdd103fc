// A gtest fixture for tests that start their own kvcompd processes in a scratch directory and
// talk to them over UCX (TCP on loopback): start with flags, connect as a tenant, write the
// token file the daemon reloads on SIGHUP.
#ifndef KVCOMP_TESTS_INTEGRATION_DAEMON_FIXTURE_H_
#define KVCOMP_TESTS_INTEGRATION_DAEMON_FIXTURE_H_

#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"

namespace kvcomp {
namespace testing {

class DaemonFixture : public ::testing::Test {
 protected:
  // Starts kvcompd on <scratch>/data with `flags` after default_flags_.
  std::unique_ptr<KvcompdProcess> StartDaemon(std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), default_flags_.begin(), default_flags_.end());
    auto d = std::make_unique<KvcompdProcess>(KVCOMPD_PATH, dir_.path() + "/data", flags);
    EXPECT_TRUE(d->Start()) << d->Log();
    return d;
  }
  // A UCX client over TCP, or nullptr: the status goes to `error` when given, else the test
  // fails. `timeout`: the request timeout (the client's default when unset).
  std::unique_ptr<transport::UcxClient> Connect(
      const KvcompdProcess& d, const std::string& tenant = "", const std::string& token = "",
      absl::Status* error = nullptr, std::optional<absl::Duration> timeout = std::nullopt) {
    transport::ClientOptions o;
    o.ucx.overrides["TLS"] = "tcp";
    o.shared_memory = shared_memory_;
    if (timeout.has_value()) o.request_timeout = *timeout;
    auto c = transport::UcxClient::Connect(*transport::Endpoint::Parse(d.data_endpoint()), tenant,
                                           token, o);
    if (!c.ok()) {
      if (error != nullptr) {
        *error = c.status();
      } else {
        ADD_FAILURE() << "connect: " << c.status();
      }
      return nullptr;
    }
    return std::move(*c);
  }
  void WriteTokens(const std::string& text) {
    std::ofstream f(tokens_path(), std::ios::trunc);
    f << text;
  }
  std::string tokens_path() const { return dir_.path() + "/tokens.yaml"; }

  std::vector<std::string> default_flags_;
  // Connect's clients move payloads through same-host shared memory where the daemon offers it.
  bool shared_memory_ = true;
  TempDir dir_;
};

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_INTEGRATION_DAEMON_FIXTURE_H_
