// Starts a real kvcompd process for tests: ephemeral loopback ports (port 0, read back from the
// daemon's ready file), a fresh data directory, optional extra flags and environment. Also a
// Thrift control client, a plain HTTP GET for /metrics and the probes, and a Prometheus text
// parser. Reusable by any test that needs a daemon (the SDK tests too).
#ifndef KVCOMP_TESTS_INTEGRATION_KVCOMPD_PROCESS_H_
#define KVCOMP_TESTS_INTEGRATION_KVCOMPD_PROCESS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thrift/TConfiguration.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TSocket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvcomp/rpc/KvcompControl.h"

namespace kvcomp {
namespace testing {

// What the daemons a test starts are configured to use where the environment chooses (the GPU
// machine's run sets KVCOMP_ENGINE_BACKEND=cuda and KVCOMP_STORAGE_PUT_TIER=device, which every
// daemon inherits): the backend name a daemon reports contains ExpectedBackend(), and its puts
// land in the tier ExpectedPutTier().
inline std::string EnvOr(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::string(v) : std::string(fallback);
}
inline std::string ExpectedBackend() {
  const std::string b = EnvOr("KVCOMP_ENGINE_BACKEND", "cpu");
  return b == "auto" ? "cpu" : b;
}
inline std::string ExpectedPutTier() { return EnvOr("KVCOMP_STORAGE_PUT_TIER", "host"); }

// A /proc/<pid>/status field in kB ("VmRSS", "VmHWM"); 0 when absent.
inline uint64_t ProcStatusKb(int pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::strtoull(line.c_str() + field.size() + 1, nullptr, 10);
    }
  }
  return 0;
}

// A temporary directory removed at destruction.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/kvcompd-test-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::string cmd = "rm -rf '" + path_ + "'";
    int rc = std::system(cmd.c_str());
    (void)rc;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct DaemonPorts {
  int data = 0;
  int control = 0;
  int metrics = 0;
  int pid = 0;
};

class KvcompdProcess {
 public:
  // `binary`: path of kvcompd. `data_dir` persists across Restart().
  KvcompdProcess(std::string binary, std::string data_dir, std::vector<std::string> flags = {})
      : binary_(std::move(binary)), data_dir_(std::move(data_dir)), flags_(std::move(flags)) {}
  ~KvcompdProcess() { Kill(SIGKILL); }
  // An environment variable ("NAME=value") for the daemon processes started after this.
  void SetEnv(std::string name_value) { env_.push_back(std::move(name_value)); }
  // The descriptor limit (soft and hard) the daemon processes started after this run under;
  // 0 (default): this process's.
  void SetFdLimit(uint64_t limit) { fd_limit_ = limit; }

  // Starts the daemon and waits (up to `timeout_s`) for its ready file. False on failure; the
  // log is in log_path().
  bool Start(double timeout_s = 30) {
    ready_file_ = data_dir_ + ".ready.yaml";
    log_path_ = data_dir_ + ".log";
    std::remove(ready_file_.c_str());
    std::vector<std::string> args = {binary_,
                                     "--data_plane.port=0",
                                     "--control_plane.port=0",
                                     "--metrics.port=0",
                                     "--storage.data_dir=" + data_dir_,
                                     "--process.ready_file=" + ready_file_,
                                     "--engine.workers=2",
                                     "--engine.cpu_threads=1",
                                     "--auth.reload_interval_seconds=0.2"};
    args.insert(args.end(), flags_.begin(), flags_.end());
    pid_ = fork();
    if (pid_ == 0) {
      FILE* log = std::fopen(log_path_.c_str(), "a");
      if (log != nullptr) {
        dup2(fileno(log), STDOUT_FILENO);
        dup2(fileno(log), STDERR_FILENO);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      for (auto& e : env_) putenv(const_cast<char*>(e.c_str()));
      if (fd_limit_ > 0) {
        const rlimit lim{fd_limit_, fd_limit_};
        if (setrlimit(RLIMIT_NOFILE, &lim) != 0) _exit(126);
      }
      execv(binary_.c_str(), argv.data());
      _exit(127);
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        exit_status_ = status;
        return false;
      }
      if (ReadPorts()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // Sends `sig`; with wait, reaps the process and returns its wait status.
  int Kill(int sig, bool wait = true) {
    if (pid_ <= 0) return exit_status_;
    kill(pid_, sig);
    if (!wait) return 0;
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    exit_status_ = status;
    return status;
  }
  // Sends `sig`. SIGSTOP returns once every thread of the daemon is stopped (kill() returns
  // before a thread running on another CPU has stopped, which may still answer a request), or
  // after 5 s.
  void Signal(int sig) const {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    if (sig != SIGSTOP) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!AllThreadsStopped() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // Every thread of the daemon in state T (stopped), by /proc/<pid>/task/*/stat.
  bool AllThreadsStopped() const {
    const std::string tasks = "/proc/" + std::to_string(pid_) + "/task";
    std::error_code ec;
    bool any = false;
    for (const auto& t : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream f(t.path() / "stat");
      std::string line;
      std::getline(f, line);
      const size_t close = line.rfind(')');  // the name may hold spaces and parentheses
      if (close == std::string::npos || close + 2 >= line.size()) continue;
      const char state = line[close + 2];
      if (state != 'T' && state != 't') return false;
      any = true;
    }
    return any;
  }
  bool running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      exit_status_ = status;
      return false;
    }
    return true;
  }

  const DaemonPorts& ports() const { return ports_; }
  std::string data_endpoint() const { return "127.0.0.1:" + std::to_string(ports_.data); }
  // The endpoint the SDK connects to: "data,control" (both on 127.0.0.1).
  std::string client_endpoint() const {
    return data_endpoint() + ",127.0.0.1:" + std::to_string(ports_.control);
  }
  const std::string& log_path() const { return log_path_; }
  std::string Log() const {
    std::ifstream in(log_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  bool ReadPorts() {
    std::ifstream in(ready_file_);
    if (!in) return false;
    std::string key;
    int value = 0;
    DaemonPorts p;
    while (in >> key >> value) {
      if (key == "data_port:") p.data = value;
      if (key == "control_port:") p.control = value;
      if (key == "metrics_port:") p.metrics = value;
      if (key == "pid:") p.pid = value;
    }
    if (p.data == 0 || p.control == 0) return false;
    ports_ = p;
    return true;
  }

  std::string binary_, data_dir_;
  std::vector<std::string> flags_;
  std::string ready_file_, log_path_;
  pid_t pid_ = -1;
  int exit_status_ = 0;
  DaemonPorts ports_;
  std::vector<std::string> env_;
  uint64_t fd_limit_ = 0;
};

// A Thrift control-plane client (framed transport, binary protocol). max_message_bytes > 0
// raises Thrift's client-side message limit (16 MB by default) for tests that read large replies.
class ControlClient {
 public:
  explicit ControlClient(int port, int recv_timeout_ms = 20000, int max_message_bytes = 0) {
    auto config = max_message_bytes > 0
                      ? std::make_shared<apache::thrift::TConfiguration>(max_message_bytes,
                                                                         max_message_bytes)
                      : std::make_shared<apache::thrift::TConfiguration>();
    socket_ = std::make_shared<apache::thrift::transport::TSocket>("127.0.0.1", port, config);
    socket_->setRecvTimeout(recv_timeout_ms);
    transport_ = std::make_shared<apache::thrift::transport::TFramedTransport>(socket_, config);
    auto protocol = std::make_shared<apache::thrift::protocol::TBinaryProtocol>(transport_);
    client_ = std::make_unique<rpc::KvcompControlClient>(protocol);
    transport_->open();
  }
  ~ControlClient() {
    try {
      transport_->close();
    } catch (...) {
    }
  }
  rpc::KvcompControlClient* operator->() { return client_.get(); }

 private:
  std::shared_ptr<apache::thrift::transport::TSocket> socket_;
  std::shared_ptr<apache::thrift::transport::TTransport> transport_;
  std::unique_ptr<rpc::KvcompControlClient> client_;
};

inline rpc::Auth MakeAuth(const std::string& tenant, const std::string& token) {
  rpc::Auth a;
  a.tenant = tenant;
  a.token = token;
  return a;
}

struct HttpResponse {
  int code = 0;
  std::string body;
};

// A TCP connection to 127.0.0.1:port (a blocking socket), or -1.
inline int ConnectLoopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// A loopback TCP port free now (the kernel's pick), for a daemon that must get the same ports
// back when it is started again.
inline int FreeLoopbackPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// GET http://127.0.0.1:port/path (HTTP/1.0, whole response).
inline HttpResponse HttpGet(int port, const std::string& path) {
  HttpResponse r;
  const int fd = ConnectLoopback(port);
  if (fd < 0) return r;
  std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (send(fd, req.data(), req.size(), 0) < 0) {
    close(fd);
    return r;
  }
  std::string all;
  char buf[65536];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) all.append(buf, static_cast<size_t>(n));
  close(fd);
  if (all.size() > 12) r.code = std::atoi(all.c_str() + 9);
  size_t body = all.find("\r\n\r\n");
  if (body != std::string::npos) r.body = all.substr(body + 4);
  return r;
}

// Value of the sample `name{labels}` (labels exactly as exposed, e.g. `{tier="host"}`, or empty)
// in Prometheus text; -1 when absent.
inline double MetricValue(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line.compare(0, series.size(), series) == 0 && line.size() > series.size() &&
        line[series.size()] == ' ') {
      return std::atof(line.c_str() + series.size() + 1);
    }
  }
  return -1;
}

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_INTEGRATION_KVCOMPD_PROCESS_H_
