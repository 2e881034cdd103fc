// The long fault campaign against real kvcompd processes on loopback, driven through the C++ SDK
// (kvcomp::client::Client). Run outside `make test` by bench/reliability/run.sh; results go to
// bench/results/reliability-<date>.md.
//
//   --mode=kill  SIGKILLs the daemon at a random moment while `--writers` clients put caches
//                concurrently, each keeping at most `--window` of its caches (it deletes the
//                oldest as new ones are acknowledged: a bounded store), for `--cycles` cycles on
//                one data directory. After every restart each acknowledged cache must be served
//                whole (same stored size, the token count its key was put with, the format's
//                section checksums), each acknowledged delete must stay deleted; an operation
//                cut by the kill may have happened or not. Every intent and acknowledgement goes
//                to a journal in --dir first, so the campaign runs in chunks of --chunk cycles
//                (exit status 3: more to do) and a driver that dies resumes where it was.
//                With --flip_every=N, after every N-th kill one byte of a random RocksDB blob or
//                write-ahead log file is flipped before the restart (a media fault): a cache
//                may then be missing (a miss) or refused with an error, never served wrong;
//                what is missing or refused after such a fault is counted and no longer tracked.
//                With --tear_every=N, after every N-th kill a random RocksDB blob or write-ahead
//                log file, or a direct payload file, is cut short at a random length (a torn
//                write), counted and tracked the same way. (Tables, the manifest and the options
//                files are RocksDB's own metadata: a database whose metadata is torn does not
//                open, by design; not injected.)
//   --mode=soak  `--clients` clients for `--seconds` of mixed put/get/delete on one daemon:
//                every unexpected status is an error; latency per operation (p50/p99/max) and
//                the daemon's RSS (sampled each second) are reported.
//   --mode=restart  a write burst of `--burst_mb` MiB of lossless caches into the RocksDB tier
//                (4 writers), then a SIGTERM and a restart, then another burst, a SIGKILL and a
//                restart: the write-ahead log left and the time to ready are reported.
//   --mode=lockout  `--strangers` unauthenticated connections on the control plane, each
//                sending a credential-less Health every `--stranger_period` seconds and
//                reconnecting when closed, while a valid client opens a fresh connection and
//                calls Health every 0.5 s for `--seconds`: the time to serve it (connect to
//                answer; target <= 1 s) and how many attempts were served are reported.
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvcomp/client/client.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"
#include "thrift/protocol/TBinaryProtocol.h"
#include "thrift/transport/TBufferTransports.h"

namespace kvcomp {
namespace {

using Clock = std::chrono::steady_clock;
using testing::KvcompdProcess;

struct Flags {
  std::string mode = "kill";
  std::string kvcompd = KVCOMPD_PATH;
  std::string dir;
  std::string out;
  int cycles = 1000;
  int chunk = 0;  // kill mode: cycles per process, 0 = all
  int writers = 4;
  int window = 16;
  int clients = 8;
  double seconds = 600;
  uint64_t seed = 1;
  bool dir_is_scratch = false;  // --dir not given: a fresh directory, removed after a clean run
  int flip_every = 0;  // kill mode: a byte flipped in a stored file after every n-th kill
  int tear_every = 0;  // kill mode: a stored file cut short after every n-th kill
  int strangers = 256;
  uint64_t burst_mb = 1024;
  double stranger_period = 20;
  std::vector<std::string> daemon_flags;
};

const KvLayout kLayout{4, 4, 8, 64, DType::kF16};

// The token count a key is put with: the cache read back must carry it.
uint64_t TokensOf(uint64_t id) { return 64 + id % 61; }

// K and V of one cache, [layer][kv_head][token][head_dim] f16, from `id`.
struct Kv {
  std::vector<uint16_t> k, v;
  std::vector<client::LayerData> layers;
};
Kv MakeKv(uint64_t id) {
  const uint64_t tokens = TokensOf(id);
  const size_t per_layer = uint64_t{kLayout.num_kv_heads} * tokens * kLayout.head_dim;
  Kv kv;
  kv.k.resize(per_layer * kLayout.num_layers);
  kv.v.resize(kv.k.size());
  std::mt19937_64 rng(id * 0x9E3779B97F4A7C15ull + 1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (size_t i = 0; i < kv.k.size(); ++i) {
    kv.k[i] = FloatToHalf(n(rng));
    kv.v[i] = FloatToHalf(n(rng));
  }
  for (uint32_t l = 0; l < kLayout.num_layers; ++l) {
    kv.layers.push_back({kv.k.data() + l * per_layer, kv.v.data() + l * per_layer});
  }
  return kv;
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(q * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

std::unique_ptr<client::Client> Connect(const KvcompdProcess& d, absl::Duration timeout,
                                        int attempts) {
  client::ClientOptions o;
  o.request_timeout = timeout;
  o.connect_timeout = absl::Seconds(5);
  o.attempts_per_endpoint = attempts;
  // A get may take every attempt's request timeout, as the campaign's figures assume.
  o.get_timeout = timeout * std::max(1, attempts) + absl::Seconds(5);
  o.ucx_overrides = {{"TLS", "tcp"}};
  const std::string ep = d.data_endpoint() + ",127.0.0.1:" + std::to_string(d.ports().control);
  auto c = client::Client::Connect({ep}, o, /*connect_now=*/true);
  if (!c.ok()) {
    std::fprintf(stderr, "connect %s: %s\n", ep.c_str(), c.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*c);
}

uint64_t RssKiB(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10);
  }
  return 0;
}

// The 1-minute load average.
std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return one;
}

// CPU seconds (user + system, every thread) the process has used so far.
double CpuSeconds(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

void Report(const Flags& f, const std::string& text) {
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
  if (!f.out.empty()) {
    std::ofstream out(f.out, std::ios::app);
    out << text;
  }
}

// Checks a cache read back against what its key was put with. Empty when it matches.
std::string CheckBytes(const std::string& bytes, uint64_t id, uint64_t stored_bytes) {
  if (stored_bytes != 0 && bytes.size() != stored_bytes) {
    return "size " + std::to_string(bytes.size()) + ", acknowledged " +
           std::to_string(stored_bytes);
  }
  auto cache = format::ParseCache(bytes);
  if (!cache.ok()) return "does not decode: " + cache.status().ToString();
  if (cache->original_tokens != TokensOf(id)) {
    return "holds " + std::to_string(cache->original_tokens) + " tokens, put with " +
           std::to_string(TokensOf(id));
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// kill mode

enum class KeyState { kPutInFlight, kLive, kDeleteInFlight, kDeleted };

struct KeyRecord {
  KeyState state = KeyState::kPutInFlight;
  uint64_t stored_bytes = 0;  // from the acknowledgement (0: not known)
};

struct KillCampaign {
  explicit KillCampaign(const Flags& flags) : f(flags) {}

  const Flags& f;
  std::mutex mu;
  std::map<uint64_t, KeyRecord> keys;  // guarded by mu
  std::deque<uint64_t> deleted;        // recent acknowledged deletes, checked after each kill
  std::atomic<uint64_t> next_id{0};
  std::atomic<bool> stop{false};
  uint64_t acked_puts = 0, acked_deletes = 0, cut_puts = 0, cut_deletes = 0;
  uint64_t lost = 0, corrupt = 0, resurrected = 0, op_errors_before_kill = 0;
  uint64_t driver_restarts = 0;  // processes before this one on the same journal
  uint64_t faults = 0, fault_misses = 0, fault_errors = 0, fault_back = 0, fault_refused_ops = 0;
  bool damaged = false;  // a fault was injected before the restart being verified
  int cycles_done = 0;
  std::vector<std::string> problems;
  FILE* journal = nullptr;

  // One line per event, flushed at once (a driver that dies keeps every line it wrote):
  //   P id / A id bytes   put intended / acknowledged     D id / X id   delete intended / acked
  //   L id bytes / G id   a cut operation found done / not done after the restart
  //   E kind text         a problem (lost, corrupt, back, error)   C n   cycle n done
  void Journal(const std::string& line) {
    std::fputs((line + "\n").c_str(), journal);
    std::fflush(journal);
  }

  // Rebuilds the state from the journal of an earlier driver on this directory.
  void Replay(const std::string& path) {
    std::ifstream in(path);
    std::string line;
    bool any = false;
    while (std::getline(in, line)) {
      if (line.size() < 3) continue;  // a line cut by the driver's death
      any = true;
      std::istringstream ls(line.substr(2));
      uint64_t id = 0, bytes = 0;
      switch (line[0]) {
        case 'P': ls >> id; keys[id] = {KeyState::kPutInFlight, 0}; break;
        case 'A': ls >> id >> bytes; keys[id] = {KeyState::kLive, bytes}; ++acked_puts; break;
        case 'D': ls >> id; keys[id].state = KeyState::kDeleteInFlight; break;
        case 'X': ls >> id; keys.erase(id); NoteDeleted(id); ++acked_deletes; break;
        case 'L': ls >> id >> bytes; keys[id] = {KeyState::kLive, bytes}; ++cut_puts; break;
        case 'G':
          ++cut_puts;
          ls >> id;
          if (keys.count(id) != 0 && keys[id].state == KeyState::kDeleteInFlight) NoteDeleted(id);
          keys.erase(id);
          break;
        case 'E': {
          std::string kind;
          ls >> kind;
          if (kind == "lost") ++lost;
          if (kind == "corrupt") ++corrupt;
          if (kind == "back") ++resurrected;
          if (kind == "error") ++op_errors_before_kill;
          if (kind == "refused") {
            ++fault_refused_ops;
            break;
          }
          if (problems.size() < 50) problems.push_back(line.substr(2));
          break;
        }
        case 'C': ls >> cycles_done; break;
        case 'F':
          ++faults;
          damaged = true;
          break;
        case 'M':
          ls >> id;
          keys.erase(id);
          ++fault_misses;
          break;
        case 'R':
          ls >> id;
          keys.erase(id);
          ++fault_errors;
          break;
        case 'S': ++driver_restarts; break;
      }
      if (line[0] == 'P' || line[0] == 'A' || line[0] == 'L') {
        next_id = std::max<uint64_t>(next_id.load(), id + 1);
      }
    }
    if (any) {
      Journal("S driver started again");
      ++driver_restarts;
    }
  }
  void NoteDeleted(uint64_t id) {
    deleted.push_back(id);
    if (deleted.size() > 512) deleted.pop_front();
  }

  static std::string Key(uint64_t id) { return "w-" + std::to_string(id); }

  void Writer(const KvcompdProcess& d, int w, std::atomic<bool>* killed) {
    auto c = Connect(d, absl::Seconds(10), 1);
    if (c == nullptr) {
      std::lock_guard<std::mutex> l(mu);
      if (!killed->load()) Problem("error", "writer " + std::to_string(w) + " could not connect");
      return;
    }
    std::deque<uint64_t> mine;
    {
      std::lock_guard<std::mutex> l(mu);
      for (auto& [id, r] : keys) {
        if (static_cast<int>(id % f.writers) == w && r.state == KeyState::kLive)
          mine.push_back(id);
      }
    }
    while (!stop.load()) {
      if (static_cast<int>(mine.size()) >= f.window) {
        const uint64_t old = mine.front();
        {
          std::lock_guard<std::mutex> l(mu);
          keys[old].state = KeyState::kDeleteInFlight;
          Journal("D " + std::to_string(old));
        }
        absl::Status st = c->Delete("m", Key(old));
        std::lock_guard<std::mutex> l(mu);
        if (!st.ok()) {
          if (!killed->load()) OpFailed("delete " + Key(old), st);
          return;
        }
        Journal("X " + std::to_string(old));
        keys[old].state = KeyState::kDeleted;
        NoteDeleted(old);
        ++acked_deletes;
        mine.pop_front();
        continue;
      }
      uint64_t id = next_id.fetch_add(1);
      while (static_cast<int>(id % f.writers) != w) id = next_id.fetch_add(1);
      Kv kv = MakeKv(id);
      {
        std::lock_guard<std::mutex> l(mu);
        keys[id].state = KeyState::kPutInFlight;
        Journal("P " + std::to_string(id));
      }
      auto r = c->Put("m", Key(id), kLayout, TokensOf(id), kv.layers);
      std::lock_guard<std::mutex> l(mu);
      if (!r.ok()) {
        if (!killed->load()) OpFailed("put " + Key(id), r.status());
        return;
      }
      Journal("A " + std::to_string(id) + " " + std::to_string(r->stored_bytes));
      keys[id] = {KeyState::kLive, r->stored_bytes};
      ++acked_puts;
      mine.push_back(id);
    }
  }

  // A put or delete refused while the daemon was up: after a fault a DATA_LOSS refusal is the
  // fault's (counted), anything else a problem. Called with mu held.
  void OpFailed(const std::string& what, const absl::Status& status) {
    if (faults > 0 && absl::IsDataLoss(status)) {
      ++fault_refused_ops;
      Journal("E refused " + what + ": " + status.ToString());
      return;
    }
    Problem("error", what + ": " + status.ToString());
  }

  // `kind`: lost, corrupt, back (deleted but served again) or error. Called with mu held.
  void Problem(const std::string& kind, const std::string& what) {
    if (kind == "lost") ++lost;
    if (kind == "corrupt") ++corrupt;
    if (kind == "back") ++resurrected;
    if (kind == "error") ++op_errors_before_kill;
    if (problems.size() < 50) problems.push_back(kind + " " + what);
    Journal("E " + kind + " " + what);
    std::fprintf(stderr, "PROBLEM: %s %s\n", kind.c_str(), what.c_str());
  }

  // After a restart: every acknowledged cache whole, every acknowledged delete gone; operations
  // cut by the kill resolved to whichever way they went.
  void Verify(client::Client& c, int cycle) {
    std::lock_guard<std::mutex> l(mu);
    for (auto it = keys.begin(); it != keys.end();) {
      const uint64_t id = it->first;
      KeyRecord& r = it->second;
      auto got = c.GetBytes("m", Key(id));
      const bool found = got.ok();
      if (!found && damaged && r.state != KeyState::kDeleteInFlight &&
          r.state != KeyState::kPutInFlight) {
        // After a media fault a cache may be gone or refused; never served wrong (checked below).
        const bool miss = absl::IsNotFound(got.status());
        miss ? ++fault_misses : ++fault_errors;
        Journal((miss ? "M " : "R ") + std::to_string(id));
        it = keys.erase(it);
        continue;
      }
      if (!found && !absl::IsNotFound(got.status())) {
        Problem("error", "cycle " + std::to_string(cycle) + ": get " + Key(id) + ": " +
                             got.status().ToString());
        ++it;
        continue;
      }
      switch (r.state) {
        case KeyState::kLive:
          if (!found) {
            Problem("lost", "cycle " + std::to_string(cycle) + ": acknowledged " + Key(id));
          } else if (auto bad = CheckBytes(*got, id, r.stored_bytes); !bad.empty()) {
            Problem("corrupt", "cycle " + std::to_string(cycle) + ": " + Key(id) + " " + bad);
          }
          break;
        case KeyState::kPutInFlight:
          ++cut_puts;
          if (found) {
            if (auto bad = CheckBytes(*got, id, 0); !bad.empty()) {
              Problem("corrupt", "cycle " + std::to_string(cycle) + ": cut put " + Key(id) + " " +
                                     bad);
            }
            r = {KeyState::kLive, got->size()};
            Journal("L " + std::to_string(id) + " " + std::to_string(got->size()));
          } else {
            Journal("G " + std::to_string(id));
            it = keys.erase(it);
            continue;
          }
          break;
        case KeyState::kDeleteInFlight:
          ++cut_deletes;
          if (found) {
            r.state = KeyState::kLive;
            Journal("L " + std::to_string(id) + " " + std::to_string(r.stored_bytes));
          } else {
            Journal("G " + std::to_string(id));
            r.state = KeyState::kDeleted;
            NoteDeleted(id);
          }
          break;
        case KeyState::kDeleted:
          break;
      }
      if (r.state == KeyState::kDeleted) {
        it = keys.erase(it);
      } else {
        ++it;
      }
    }
    for (uint64_t id : deleted) {
      if (keys.count(id) != 0) continue;
      auto got = c.GetBytes("m", Key(id));
      if (got.ok() && damaged) {
        // A damaged log may lose the delete's record with what followed it: the cache comes
        // back whole (its bytes are still checked), which a media fault allows.
        if (auto bad = CheckBytes(*got, id, 0); !bad.empty()) {
          Problem("corrupt", "cycle " + std::to_string(cycle) + ": " + Key(id) + " " + bad);
        }
        ++fault_back;
        keys[id] = {KeyState::kLive, got->size()};  // tracked again, as the store holds it
        Journal("L " + std::to_string(id) + " " + std::to_string(got->size()));
      } else if (got.ok()) {
        Problem("back", "cycle " + std::to_string(cycle) + ": deleted " + Key(id));
      }
    }
    damaged = false;
  }

  // Flips one byte of a random blob or write-ahead log file under the stopped daemon's RocksDB
  // directory; returns what it did ("" when there is no such file).
  std::string FlipAByte(const std::string& data, std::mt19937_64& rng) {
    std::vector<std::filesystem::path> files;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(data + "/rocksdb", ec)) {
      const std::string ext = e.path().extension().string();
      if ((ext == ".blob" || ext == ".log") && e.file_size(ec) > 0) files.push_back(e.path());
    }
    if (files.empty()) return "";
    const auto& path = files[rng() % files.size()];
    const uint64_t size = std::filesystem::file_size(path, ec);
    if (ec || size == 0) return "";
    const uint64_t at = rng() % size;
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(at));
    char b = 0;
    file.read(&b, 1);
    b = static_cast<char>(b ^ (1 << (rng() % 8)));
    file.seekp(static_cast<std::streamoff>(at));
    file.write(&b, 1);
    return path.filename().string() + " at " + std::to_string(at);
  }

  // Cuts a random blob, write-ahead log or direct payload file short: "" when there is none.
  std::string TearAFile(const std::string& data, std::mt19937_64& rng) {
    std::vector<std::filesystem::path> files;
    std::error_code ec;
    for (const char* dir : {"/rocksdb", "/rocksdb/direct"}) {
      for (const auto& e : std::filesystem::directory_iterator(data + dir, ec)) {
        const std::string ext = e.path().extension().string();
        if ((ext == ".blob" || ext == ".log" || ext == ".kvd") && e.file_size(ec) > 1) {
          files.push_back(e.path());
        }
      }
    }
    if (files.empty()) return "";
    const auto& path = files[rng() % files.size()];
    const uint64_t size = std::filesystem::file_size(path, ec);
    if (ec || size < 2) return "";
    const uint64_t keep = 1 + rng() % (size - 1);
    std::filesystem::resize_file(path, keep, ec);
    if (ec) return "";
    return path.filename().string() + " cut from " + std::to_string(size) + " to " +
           std::to_string(keep) + " bytes";
  }

  // A daemon left running by a driver that died holds the database's lock: it goes first.
  static void KillOrphan(const std::string& data) {
    std::ifstream in(data + ".ready.yaml");
    std::string key;
    long pid = 0;
    while (in >> key) {
      if (key == "pid:") in >> pid;
    }
    if (pid <= 0) return;
    const std::string proc = "/proc/" + std::to_string(pid);
    std::ifstream cmd(proc + "/cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(cmd)), std::istreambuf_iterator<char>());
    if (cmdline.find(data) == std::string::npos) return;
    kill(static_cast<pid_t>(pid), SIGKILL);
    for (int i = 0; i < 500 && access(proc.c_str(), F_OK) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  int Run() {
    const std::string data = f.dir + "/data";
    const std::string journal_path = f.dir + "/journal.log";
    journal = std::fopen(journal_path.c_str(), "a");
    if (journal == nullptr) {
      std::fprintf(stderr, "cannot open %s\n", journal_path.c_str());
      return 2;
    }
    Replay(journal_path);
    KillOrphan(data);
    std::vector<std::string> flags = {"--storage.rocksdb_capacity_bytes=512Mi",
                                      "--storage.host_capacity_bytes=64Mi",
                                      "--data_plane.max_block_bytes=1Mi"};
    flags.insert(flags.end(), f.daemon_flags.begin(), f.daemon_flags.end());
    KvcompdProcess d(f.kvcompd, data, flags);
    std::mt19937_64 rng(f.seed + static_cast<uint64_t>(cycles_done));
    std::uniform_int_distribution<int> run_ms(200, 1500);
    const auto t0 = Clock::now();
    std::vector<double> restart_ms;
    const int end = f.chunk > 0 ? std::min(f.cycles, cycles_done + f.chunk) : f.cycles;
    int cycle = cycles_done;
    bool failed = false;
    for (; cycle < end; ++cycle) {
      const auto s0 = Clock::now();
      if (!d.Start(60)) {
        std::lock_guard<std::mutex> l(mu);
        Problem("error", "cycle " + std::to_string(cycle) + ": kvcompd did not start");
        std::string log = d.Log();
        std::fprintf(stderr, "%s\n", log.substr(log.size() > 4000 ? log.size() - 4000 : 0).c_str());
        failed = true;
        break;
      }
      restart_ms.push_back(Ms(Clock::now() - s0));
      {
        auto c = Connect(d, absl::Seconds(30), 2);
        if (c == nullptr) {
          std::lock_guard<std::mutex> l(mu);
          Problem("error", "cycle " + std::to_string(cycle) + ": verifier could not connect");
          failed = true;
          break;
        }
        Verify(*c, cycle);
      }
      stop = false;
      std::atomic<bool> killed{false};
      std::vector<std::thread> threads;
      for (int w = 0; w < f.writers; ++w) {
        threads.emplace_back([&, w] { Writer(d, w, &killed); });
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(run_ms(rng)));
      killed = true;
      d.Kill(SIGKILL);
      stop = true;
      for (auto& t : threads) t.join();
      {
        std::lock_guard<std::mutex> l(mu);
        if (f.flip_every > 0 && (cycle + 1) % f.flip_every == 0) {
          const std::string what = FlipAByte(data, rng);
          if (!what.empty()) {
            Journal("F " + what);
            ++faults;
            damaged = true;
          }
        }
        if (f.tear_every > 0 && (cycle + 1) % f.tear_every == 0) {
          const std::string what = TearAFile(data, rng);
          if (!what.empty()) {
            Journal("F " + what);
            ++faults;
            damaged = true;
          }
        }
        Journal("C " + std::to_string(cycle + 1));
        cycles_done = cycle + 1;
      }
      if ((cycle + 1) % 50 == 0) Progress(cycle + 1, t0, restart_ms);
    }
    if (!failed && cycle == f.cycles) {  // a last restart checks what the last kill left
      if (d.Start(60)) {
        auto c = Connect(d, absl::Seconds(30), 2);
        if (c != nullptr) Verify(*c, cycle);
        d.Kill(SIGTERM);
      } else {
        std::lock_guard<std::mutex> l(mu);
        Problem("error", "final start failed");
      }
      Progress(cycle, t0, restart_ms, /*final=*/true);
      return lost + corrupt + resurrected + op_errors_before_kill == 0 ? 0 : 1;
    }
    if (failed) {
      Progress(cycle, t0, restart_ms, /*final=*/true);
      return 1;
    }
    return 3;  // more cycles to run, in a new process
  }

  void Progress(int cycles, Clock::time_point t0, const std::vector<double>& restart_ms,
                bool final = false) {
    std::lock_guard<std::mutex> l(mu);
    uint64_t live = 0;
    for (auto& [id, r] : keys) live += r.state == KeyState::kLive;
    const transport::UcxClientStats ucx = transport::GetUcxClientStats();
    std::ostringstream s;
    s << (final ? "| final" : "| progress") << " | cycles " << cycles << " | this driver "
      << static_cast<int>(Ms(Clock::now() - t0) / 1000) << " s | driver processes "
      << driver_restarts + 1 << " | acknowledged puts " << acked_puts << " | acknowledged deletes "
      << acked_deletes << " | operations cut by the kill " << cut_puts + cut_deletes
      << " | live caches " << live << " | lost " << lost << " | corrupt " << corrupt
      << " | deleted but back " << resurrected << " | errors while up " << op_errors_before_kill
      << " | faults (byte flips, torn files) " << faults << ", then missing " << fault_misses << ", refused "
      << fault_errors << ", deleted ones back " << fault_back
      << ", puts and deletes refused (DATA_LOSS) after " << fault_refused_ops
      << " | restart-to-ready p50 " << Percentile(restart_ms, 0.5) << " ms, p99 "
      << Percentile(restart_ms, 0.99) << " ms | this driver's UCX: " << ucx.workers_created
      << " workers, " << ucx.endpoints_created << " endpoints made |\n";
    if (final) {
      for (const auto& p : problems) s << "  - " << p << "\n";
    }
    Report(f, s.str());
  }
};

// ---------------------------------------------------------------------------------------------
// soak mode

struct OpStats {
  std::vector<double> put_ms, get_ms, delete_ms;
  uint64_t errors = 0;
  std::vector<std::string> samples;
};

int Soak(const Flags& f) {
  std::vector<std::string> flags = {"--data_plane.max_block_bytes=1Mi"};
  flags.insert(flags.end(), f.daemon_flags.begin(), f.daemon_flags.end());
  KvcompdProcess d(f.kvcompd, f.dir + "/data", flags);
  if (!d.Start(60)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", d.Log().c_str());
    return 1;
  }
  std::atomic<bool> stop{false};
  std::vector<std::pair<double, uint64_t>> rss;  // (seconds, KiB)
  const auto t0 = Clock::now();
  std::thread sampler([&] {
    while (!stop.load()) {
      rss.emplace_back(Ms(Clock::now() - t0) / 1000, RssKiB(d.ports().pid));
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  });
  std::vector<OpStats> stats(f.clients);
  std::vector<std::thread> threads;
  for (int ci = 0; ci < f.clients; ++ci) {
    threads.emplace_back([&, ci] {
      OpStats& st = stats[ci];
      auto c = Connect(d, absl::Seconds(60), 2);
      if (c == nullptr) {
        ++st.errors;
        st.samples.push_back("connect failed");
        return;
      }
      auto error = [&](const std::string& what) {
        ++st.errors;
        if (st.samples.size() < 10) st.samples.push_back(what);
      };
      std::mt19937_64 rng(f.seed * 1000 + ci);
      std::deque<std::pair<uint64_t, uint64_t>> live;  // (id, stored bytes)
      uint64_t n = 0;
      const auto end = t0 + std::chrono::duration<double>(f.seconds);
      while (Clock::now() < end) {
        const int dice = static_cast<int>(rng() % 100);
        if (live.empty() || dice < 40 || (live.size() < 32 && dice < 50)) {
          const uint64_t id = (uint64_t{static_cast<uint32_t>(ci)} << 40) | n++;
          Kv kv = MakeKv(id);
          const auto s0 = Clock::now();
          auto r = c->Put("m", "c" + std::to_string(id), kLayout, TokensOf(id), kv.layers);
          st.put_ms.push_back(Ms(Clock::now() - s0));
          if (!r.ok()) {
            error("put: " + r.status().ToString());
            continue;
          }
          live.emplace_back(id, r->stored_bytes);
          if (live.size() > 32) {  // bounded: the oldest goes
            const uint64_t old = live.front().first;
            live.pop_front();
            const auto d0 = Clock::now();
            absl::Status ds = c->Delete("m", "c" + std::to_string(old));
            st.delete_ms.push_back(Ms(Clock::now() - d0));
            if (!ds.ok()) error("delete: " + ds.ToString());
          }
        } else if (dice < 85) {
          const auto& [id, bytes] = live[rng() % live.size()];
          const auto s0 = Clock::now();
          auto g = c->GetBytes("m", "c" + std::to_string(id));
          st.get_ms.push_back(Ms(Clock::now() - s0));
          if (!g.ok()) {
            error("get: " + g.status().ToString());
          } else if (auto bad = CheckBytes(*g, id, bytes); !bad.empty()) {
            error("get c" + std::to_string(id) + ": " + bad);
          }
        } else {
          const size_t i = rng() % live.size();
          const uint64_t id = live[i].first;
          live.erase(live.begin() + static_cast<long>(i));
          const auto s0 = Clock::now();
          absl::Status ds = c->Delete("m", "c" + std::to_string(id));
          st.delete_ms.push_back(Ms(Clock::now() - s0));
          if (!ds.ok()) error("delete: " + ds.ToString());
          auto g = c->GetBytes("m", "c" + std::to_string(id));
          if (!absl::IsNotFound(g.status())) error("deleted cache still served");
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  sampler.join();
  const bool alive = d.running();
  d.Kill(SIGTERM);

  OpStats all;
  for (auto& s : stats) {
    all.put_ms.insert(all.put_ms.end(), s.put_ms.begin(), s.put_ms.end());
    all.get_ms.insert(all.get_ms.end(), s.get_ms.begin(), s.get_ms.end());
    all.delete_ms.insert(all.delete_ms.end(), s.delete_ms.begin(), s.delete_ms.end());
    all.errors += s.errors;
    for (auto& m : s.samples) all.samples.push_back(m);
  }
  uint64_t rss_max = 0, rss_first = 0, rss_last = 0;
  const double total = rss.empty() ? 0 : rss.back().first;
  for (auto& [t, kib] : rss) {
    rss_max = std::max(rss_max, kib);
    if (t <= 60) rss_first = std::max(rss_first, kib);
    if (t >= total - 60) rss_last = std::max(rss_last, kib);
  }
  std::ostringstream s;
  auto line = [&](const char* op, const std::vector<double>& v) {
    s << "| " << op << " | " << v.size() << " | " << Percentile(v, 0.5) << " | "
      << Percentile(v, 0.99) << " | " << (v.empty() ? 0 : *std::max_element(v.begin(), v.end()))
      << " |\n";
  };
  s << "clients " << f.clients << ", " << f.seconds << " s, errors " << all.errors
    << ", daemon alive at the end: " << (alive ? "yes" : "NO") << "\n\n";
  s << "| op | count | p50 ms | p99 ms | max ms |\n| --- | --- | --- | --- | --- |\n";
  line("put", all.put_ms);
  line("get", all.get_ms);
  line("delete", all.delete_ms);
  s << "\nRSS of kvcompd (KiB): max " << rss_max << ", max over the first 60 s " << rss_first
    << ", max over the last 60 s " << rss_last << ", samples " << rss.size() << "\n";
  for (auto& m : all.samples) s << "  - " << m << "\n";
  Report(f, s.str());
  return all.errors == 0 && alive ? 0 : 1;
}

// The bytes of one framed Health call with `auth`.
std::string HealthFrame(const rpc::Auth& auth) {
  auto memory = std::make_shared<apache::thrift::transport::TMemoryBuffer>();
  auto framed = std::make_shared<apache::thrift::transport::TFramedTransport>(memory);
  rpc::KvcompControlClient c(std::make_shared<apache::thrift::protocol::TBinaryProtocol>(framed));
  c.send_Health(auth);
  return memory->getBufferAsString();
}

int Lockout(const Flags& f) {
  {
    std::ofstream tokens(f.dir + "/tokens.yaml");
    tokens << "alpha: secret-a\n";
  }
  std::vector<std::string> flags = {"--auth.token_file=" + f.dir + "/tokens.yaml"};
  flags.insert(flags.end(), f.daemon_flags.begin(), f.daemon_flags.end());
  KvcompdProcess d(f.kvcompd, f.dir + "/data", flags);
  if (!d.Start(60)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", d.Log().c_str());
    return 1;
  }
  const int port = d.ports().control;
  const std::string frame = HealthFrame(testing::MakeAuth("", ""));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reconnects{0};
  std::atomic<int> connected{0};
  std::thread strangers([&] {
    std::vector<int> fds(static_cast<size_t>(f.strangers), -1);
    auto next_send = Clock::now();
    while (!stop.load()) {
      const bool send_now = Clock::now() >= next_send;
      if (send_now) {
        next_send = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(f.stranger_period));
      }
      int open = 0;
      for (int& fd : fds) {
        char buf[4096];
        if (fd >= 0) {
          ssize_t n;
          while ((n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0) {
          }
          if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
            close(fd);
            fd = -1;
          }
        }
        if (fd < 0) {
          fd = testing::ConnectLoopback(port);
          if (fd < 0) continue;
          ++reconnects;
          (void)send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
        } else if (send_now) {
          (void)send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
        }
        ++open;
      }
      connected = open;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (int fd : fds) {
      if (fd >= 0) close(fd);
    }
  });
  while (connected.load() < f.strangers && d.running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const uint64_t reconnects_at_start = reconnects.load();
  std::vector<double> serve_ms;
  int attempts = 0, served = 0, min_connected = f.strangers;
  std::vector<std::string> failures;
  const auto end = Clock::now() + std::chrono::duration<double>(f.seconds);
  while (Clock::now() < end) {
    ++attempts;
    min_connected = std::min(min_connected, connected.load());
    const auto s0 = Clock::now();
    std::string why;
    try {
      testing::ControlClient c(port);
      rpc::HealthResponse h;
      c->Health(h, testing::MakeAuth("alpha", "secret-a"));
      if (h.status.code != rpc::StatusCode::OK) why = h.status.message;
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (why.empty()) {
      ++served;
      serve_ms.push_back(Ms(Clock::now() - s0));
    } else if (failures.size() < 5) {
      failures.push_back(why);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  stop = true;
  strangers.join();
  const bool alive = d.running();
  d.Kill(SIGTERM);
  std::ostringstream s;
  s << "strangers " << f.strangers << " (a credential-less Health every " << f.stranger_period
    << " s, reconnecting when closed; at least " << min_connected << " connected at every attempt, "
    << reconnects.load() - reconnects_at_start << " reconnects), " << f.seconds
    << " s: valid client served " << served << " of " << attempts
    << " attempts; time to serve (fresh connection to answer) p50 " << Percentile(serve_ms, 0.5)
    << " ms, p99 " << Percentile(serve_ms, 0.99) << " ms, max "
    << (serve_ms.empty() ? 0 : *std::max_element(serve_ms.begin(), serve_ms.end()))
    << " ms (target <= 1000 ms); daemon alive at the end: " << (alive ? "yes" : "NO") << "\n";
  for (auto& m : failures) s << "  - " << m << "\n";
  Report(f, s.str());
  return served == attempts && alive ? 0 : 1;
}

uint64_t WalBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".log") total += e.file_size(ec);
  }
  return total;
}

int Restart(const Flags& f) {
  std::vector<std::string> flags = {"--storage.put_tier=rocksdb"};
  flags.insert(flags.end(), f.daemon_flags.begin(), f.daemon_flags.end());
  KvcompdProcess d(f.kvcompd, f.dir + "/data", flags);
  if (!d.Start(120)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", d.Log().c_str());
    return 1;
  }
  // One 2 MiB cache (512 tokens of kLayout), put under new keys.
  constexpr uint64_t kTokens = 512;
  const size_t per_layer = uint64_t{kLayout.num_kv_heads} * kTokens * kLayout.head_dim;
  std::vector<uint16_t> k(per_layer * kLayout.num_layers), v(k.size());
  std::mt19937_64 rng(f.seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = FloatToHalf(n(rng));
    v[i] = FloatToHalf(n(rng));
  }
  std::vector<client::LayerData> layers;
  for (uint32_t l = 0; l < kLayout.num_layers; ++l) {
    layers.push_back({k.data() + l * per_layer, v.data() + l * per_layer});
  }
  const uint64_t cache_bytes = kLayout.CacheBytes(kTokens);
  client::PutOptions lossless;
  lossless.policy = CompressionPolicy();
  lossless.policy->ratio = 0;
  lossless.policy->moments = false;
  const std::string wal_dir = f.dir + "/data/rocksdb";
  std::ostringstream s;
  int errors = 0;
  uint64_t next_key = 0;
  for (int sig : {SIGTERM, SIGKILL}) {
    const uint64_t caches = (f.burst_mb << 20) / cache_bytes;
    std::atomic<uint64_t> put{0};
    std::atomic<int> failed{0};
    const auto b0 = Clock::now();
    std::vector<std::thread> writers;
    const uint64_t base = next_key;
    for (int w = 0; w < 4; ++w) {
      writers.emplace_back([&, w] {
        auto c = Connect(d, absl::Seconds(120), 2);
        if (c == nullptr) {
          ++failed;
          return;
        }
        for (uint64_t i = static_cast<uint64_t>(w); i < caches; i += 4) {
          auto r = c->Put("m", "b" + std::to_string(base + i), kLayout, kTokens, layers, lossless);
          if (r.ok()) {
            ++put;
          } else {
            ++failed;
          }
        }
      });
    }
    for (auto& t : writers) t.join();
    next_key += caches;
    const double burst_s = Ms(Clock::now() - b0) / 1000;
    const uint64_t wal_before = WalBytes(wal_dir);
    const auto k0 = Clock::now();
    d.Kill(sig);
    const double stop_s = Ms(Clock::now() - k0) / 1000;
    const uint64_t wal_left = WalBytes(wal_dir);
    const auto r0 = Clock::now();
    const bool up = d.Start(600);
    const double restart_s = Ms(Clock::now() - r0) / 1000;
    // What the start cost the daemon, whatever else the machine runs (the wall time above
    // grows with the load average).
    const double restart_cpu_s = up ? CpuSeconds(d.ports().pid) : 0;
    errors += failed.load() + (up ? 0 : 1);
    s << "- " << (sig == SIGTERM ? "SIGTERM" : "SIGKILL") << " after a burst of " << put.load()
      << " caches of " << cache_bytes / 1024 << " KiB (" << (put.load() * cache_bytes >> 20)
      << " MiB, " << failed.load() << " failed) in " << burst_s << " s: write-ahead log "
      << (wal_before >> 20) << " MiB before the signal, " << (wal_left >> 20)
      << " MiB left after the process ended (stop took " << stop_s << " s); restart to ready "
      << restart_s << " s (" << restart_cpu_s << " s of CPU); load average "
      << LoadAverage() << (up ? "" : " (DID NOT START)") << "\n";
    if (!up) break;
  }
  d.Kill(SIGTERM);
  Report(f, s.str());
  return errors == 0 ? 0 : 1;
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* name) -> const char* {
      const std::string p = std::string("--") + name + "=";
      return a.rfind(p, 0) == 0 ? argv[i] + p.size() : nullptr;
    };
    if (const char* v = val("mode")) f.mode = v;
    else if (const char* v = val("kvcompd")) f.kvcompd = v;
    else if (const char* v = val("dir")) f.dir = v;
    else if (const char* v = val("out")) f.out = v;
    else if (const char* v = val("cycles")) f.cycles = std::atoi(v);
    else if (const char* v = val("chunk")) f.chunk = std::atoi(v);
    else if (const char* v = val("writers")) f.writers = std::atoi(v);
    else if (const char* v = val("window")) f.window = std::atoi(v);
    else if (const char* v = val("clients")) f.clients = std::atoi(v);
    else if (const char* v = val("seconds")) f.seconds = std::atof(v);
    else if (const char* v = val("seed")) f.seed = std::strtoull(v, nullptr, 10);
    // clang-format off
    else if (const char* v = val("strangers")) f.strangers = std::atoi(v);
    else if (const char* v = val("burst_mb")) f.burst_mb = std::strtoull(v, nullptr, 10);
    else if (const char* v = val("stranger_period")) f.stranger_period = std::atof(v);
    else if (const char* v = val("flip_every")) f.flip_every = std::atoi(v);
    else if (const char* v = val("tear_every")) f.tear_every = std::atoi(v);
    // clang-format on
    else if (const char* v = val("daemon_flag")) f.daemon_flags.push_back(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (f.mode != "kill" && f.mode != "soak" && f.mode != "lockout" && f.mode != "restart") {
    std::fprintf(stderr, "--mode must be kill, soak, lockout or restart\n");
    std::exit(2);
  }
  if (f.dir.empty()) {
    char tmpl[] = "/tmp/kvcomp-campaign-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::fprintf(stderr, "mkdtemp %s: %s\n", tmpl, std::strerror(errno));
      std::exit(2);
    }
    f.dir = tmpl;
    f.dir_is_scratch = true;
    std::fprintf(stderr, "scratch directory: %s\n", f.dir.c_str());
  }
  return f;
}

}  // namespace
}  // namespace kvcomp

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  kvcomp::Flags f = kvcomp::ParseFlags(argc, argv);
  int rc = 2;
  if (f.mode == "kill") {
    rc = kvcomp::KillCampaign(f).Run();
  } else if (f.mode == "soak") {
    rc = kvcomp::Soak(f);
  } else if (f.mode == "lockout") {
    rc = kvcomp::Lockout(f);
  } else if (f.mode == "restart") {
    rc = kvcomp::Restart(f);
  }
  // Without --dir the data went to a fresh scratch directory (the restart mode's holds GiBs):
  // removed after a clean run; kept after a failure (or a kill chunk with more to run), saying
  // where. Every mode's daemon has ended by now (its process object went out of scope).
  if (f.dir_is_scratch) {
    if (rc == 0) {
      std::error_code ec;
      std::filesystem::remove_all(f.dir, ec);
      if (ec) std::fprintf(stderr, "could not remove %s: %s\n", f.dir.c_str(), ec.message().c_str());
    } else {
      std::fprintf(stderr, "scratch directory kept for inspection (remove it when done): %s\n",
                   f.dir.c_str());
    }
  }
  return rc;
}
