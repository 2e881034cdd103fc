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
//                write), counted and tracked the same way. With --manifest_every=N, after every
//                N-th kill RocksDB's MANIFEST has a byte flipped or is cut short (alternately):
//                the RocksDB tier then refuses to open (docs/storage.md), so disk-durable puts
//                are refused until an operator acts; it measures a repair. With --sst_every=N,
//                every N-th cycle ends with a clean stop (SIGTERM: RocksDB writes its memtables
//                out as table files) instead of a kill, and one random table file (.sst) is then
//                damaged: a byte flipped in its first part (data blocks), a byte flipped in its
//                last 512 bytes (index, properties, footer) or the file cut short, in turn.
//                (Options files are not injected.)
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
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
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
#include "kvcomp/core/policy_presets.h"
#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/transport/client.h"
#include "block_put.h"
#include "kvcompd_process.h"
#include "storage/tmpfs_mount.h"
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
  int manifest_every = 0;  // kill mode: the MANIFEST damaged after every n-th kill
  int sst_every = 0;  // kill mode: a table file damaged after every n-th (clean) stop
  int strangers = 256;
  uint64_t burst_mb = 1024;
  double stranger_period = 20;
  std::vector<std::string> daemon_flags;
  // kill mode: small lossless caches compared byte for byte, each read back once acknowledged
  // (a round trip); readers getting live caches throughout, across the kills and restarts; the
  // time the writers run between kills.
  bool lossless = false;
  int readers = 0;
  int run_min_ms = 200, run_max_ms = 1500;
  // diskfull mode: bytes of room given to the puts in each cycle.
  uint64_t room_mb = 24;
  // put_child (peer mode's child process): where to put, what, how many blocks before waiting.
  std::string child_endpoint, child_key;
  int child_blocks = 0;
  int rss_every = 0;  // peer mode: every n cycles a line (RSS, open puts, caches) on stderr
  bool no_round_trips = false;  // peer mode: only the cut puts (no cache kept between cycles)
  bool stalls = false;  // peer mode: a fourth way, the put's client process stopped (SIGSTOP)
};

const KvLayout kLayout{4, 4, 8, 64, DType::kF16};

// The token count a key is put with: the cache read back must carry it.
uint64_t TokensOf(uint64_t id) { return 64 + id % 61; }

// K and V of one cache, [layer][kv_head][token][head_dim] f16, from `id`.
struct Kv {
  std::vector<uint16_t> k, v;
  std::vector<client::LayerData> layers;
};
// `tokens` of K and V in `layout`, each element pair from fill(&k, &v) in order, with the
// per-layer views the SDK puts.
template <typename Fill>
Kv MakeKvWith(const KvLayout& layout, uint64_t tokens, Fill fill) {
  const size_t per_layer = uint64_t{layout.num_kv_heads} * tokens * layout.head_dim;
  Kv kv;
  kv.k.resize(per_layer * layout.num_layers);
  kv.v.resize(kv.k.size());
  for (size_t i = 0; i < kv.k.size(); ++i) fill(&kv.k[i], &kv.v[i]);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    kv.layers.push_back({kv.k.data() + l * per_layer, kv.v.data() + l * per_layer});
  }
  return kv;
}

Kv MakeKv(uint64_t id) {
  std::mt19937_64 rng(id * 0x9E3779B97F4A7C15ull + 1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  return MakeKvWith(kLayout, TokensOf(id), [&](uint16_t* k, uint16_t* v) {
    *k = FloatToHalf(n(rng));
    *v = FloatToHalf(n(rng));
  });
}

// Small lossless caches for the round trips: 2 layers, 2 kv heads, head_dim 64, f16 (1 KiB of
// K and V per token), 16-63 tokens: 16-63 KiB of K and V each.
const KvLayout kSmallLayout{2, 2, 4, 64, DType::kF16};
uint64_t SmallTokensOf(uint64_t id) { return 16 + id % 48; }

// K and V of small cache `id`: finite f16 of both signs, random mantissas, magnitudes 2^-10 to
// 2^5 (every mantissa bit exercised; nothing a lossless codec may round).
Kv MakeSmallKv(uint64_t id) {
  std::mt19937_64 rng(id * 0x9E3779B97F4A7C15ull + 7);
  auto half = [](uint64_t bits) {
    const uint16_t exponent = static_cast<uint16_t>(5 + (bits >> 11) % 16);  // 2^-10 .. 2^5
    return static_cast<uint16_t>((bits & 0x83FF) | (exponent << 10));
  };
  return MakeKvWith(kSmallLayout, SmallTokensOf(id), [&](uint16_t* k, uint16_t* v) {
    const uint64_t r = rng();
    *k = half(r);
    *v = half(r >> 32);
  });
}

client::PutOptions Lossless() {
  client::PutOptions o;
  o.policy = *PolicyPreset("lossless");
  return o;
}

// A small lossless cache read back against the K and V its key was put with, byte for byte.
// Empty when it matches.
std::string CheckExact(const std::string& bytes, uint64_t id, uint64_t stored_bytes) {
  if (stored_bytes != 0 && bytes.size() != stored_bytes) {
    return "size " + std::to_string(bytes.size()) + ", acknowledged " +
           std::to_string(stored_bytes);
  }
  auto cache = format::ParseCache(bytes);
  if (!cache.ok()) return "does not decode: " + cache.status().ToString();
  if (cache->layout != kSmallLayout || cache->original_tokens != SmallTokensOf(id)) {
    return "holds " + cache->layout.DebugString() + " x " +
           std::to_string(cache->original_tokens) + " tokens";
  }
  const Kv kv = MakeSmallKv(id);
  const size_t half = kv.k.size() * sizeof(uint16_t);
  std::vector<uint8_t> dense(2 * half);
  if (absl::Status st = cache->WriteDenseKv(dense.data()); !st.ok()) {
    return "not every token raw: " + st.ToString();
  }
  for (int part = 0; part < 2; ++part) {
    const auto* want = reinterpret_cast<const uint8_t*>(part == 0 ? kv.k.data() : kv.v.data());
    const uint8_t* got = dense.data() + part * half;
    if (std::memcmp(want, got, half) != 0) {
      size_t at = 0;
      while (want[at] == got[at]) ++at;
      return std::string(part == 0 ? "K" : "V") + " differs at byte " + std::to_string(at);
    }
  }
  return "";
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

// A TCP port of 127.0.0.1 free right now (the kernel's pick), or 0.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
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
  std::map<std::string, uint64_t> fault_kinds;  // faults by kind (FaultKind)
  std::map<std::string, uint64_t> fault_error_codes;  // refused gets after a fault, by code

  // The kind of a fault from its journal line ("<file> ..."): file type and byte flip or cut.
  static std::string FaultKind(const std::string& what) {
    const bool cut = what.find(" cut from ") != std::string::npos;
    if (what.rfind("MANIFEST-", 0) == 0) return cut ? "manifest cut" : "manifest flip";
    if (what.find(".sst") != std::string::npos) {
      if (cut) return "table cut";
      return what.find("(tail)") != std::string::npos ? "table tail flip" : "table data flip";
    }
    const size_t dot = what.find('.');
    const std::string ext = dot == std::string::npos ? "" : what.substr(dot + 1, 4);
    const std::string file = ext.rfind("blob", 0) == 0  ? "blob"
                             : ext.rfind("log", 0) == 0 ? "log"
                             : ext.rfind("kvd", 0) == 0 ? "direct file"
                                                        : "file";
    return file + (cut ? " cut" : " flip");
  }
  void NoteFault(const std::string& what) {
    Journal("F " + what);
    ++faults;
    ++fault_kinds[FaultKind(what)];
    damaged = true;
  }
  bool damaged = false;  // a fault was injected before the restart being verified
  // --lossless: acknowledged puts read straight back byte-exact (round trips); gets of live
  // caches by the readers (byte-exact, misses, clean errors while the daemon was down or
  // restarting) and by the verification after each restart.
  std::atomic<uint64_t> round_trips{0}, reader_gets{0}, reader_misses{0}, verify_gets{0};
  std::atomic<uint64_t> clean_errors{0};  // gets and puts cut by a kill, each a clean error
  std::atomic<uint64_t> kills{0};         // daemon kills so far (readers compare before/after)
  std::atomic<bool> down{true};           // no daemon serving (killed, not yet restarted)
  std::atomic<int64_t> up_at_ns{0};       // when the daemon last became ready (steady clock)
  std::map<std::string, uint64_t> clean_error_codes;  // guarded by mu
  int cycles_done = 0;
  std::vector<std::string> problems;
  FILE* journal = nullptr;

  // One line per event, flushed at once (a driver that dies keeps every line it wrote):
  //   P id / A id bytes   put intended / acknowledged     D id / X id   delete intended / acked
  //   L id bytes / G id   a cut operation found done / not done after the restart
  //   E kind text         a problem (lost, corrupt, back, error)   C n   cycle n done
  //   T rt gets misses verified errors   the running totals of round trips and gets
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
        case 'T': {
          uint64_t rt = 0, g = 0, m = 0, v = 0, e = 0;
          ls >> rt >> g >> m >> v >> e;
          round_trips = rt;
          reader_gets = g;
          reader_misses = m;
          verify_gets = v;
          clean_errors = e;
          break;
        }
        case 'F':
          ++faults;
          ++fault_kinds[FaultKind(line.substr(2))];
          damaged = true;
          break;
        case 'M':
          ls >> id;
          keys.erase(id);
          ++fault_misses;
          break;
        case 'R': {
          std::string code;
          ls >> id >> code;
          keys.erase(id);
          ++fault_errors;
          if (!code.empty()) ++fault_error_codes[code];
          break;
        }
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

  // A cache read back against what `id` was put with (byte for byte with --lossless).
  std::string Check(const std::string& bytes, uint64_t id, uint64_t stored_bytes) const {
    return f.lossless ? CheckExact(bytes, id, stored_bytes) : CheckBytes(bytes, id, stored_bytes);
  }

  // A get that failed with the daemon killed or restarting in between: a clean error if it is
  // one of the codes a gone daemon gives (counted by code), else a problem. Called with mu held.
  void CleanOrProblem(const std::string& what, const absl::Status& st) {
    if (absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st) || absl::IsAborted(st) ||
        absl::IsCancelled(st) || absl::IsNotFound(st) || (faults > 0 && absl::IsDataLoss(st))) {
      ++clean_errors;
      ++clean_error_codes[absl::StatusCodeToString(st.code())];
      return;
    }
    Problem("error", what + " (daemon restarted meanwhile): " + st.ToString());
  }

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
      Kv kv = f.lossless ? MakeSmallKv(id) : MakeKv(id);
      {
        std::lock_guard<std::mutex> l(mu);
        keys[id].state = KeyState::kPutInFlight;
        Journal("P " + std::to_string(id));
      }
      auto r = f.lossless ? c->Put("m", Key(id), kSmallLayout, SmallTokensOf(id), kv.layers,
                                   Lossless())
                          : c->Put("m", Key(id), kLayout, TokensOf(id), kv.layers);
      {
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
      if (!f.lossless) continue;
      // The round trip: the acknowledged cache read straight back, byte for byte. Only this
      // writer deletes it, so a miss while the daemon is up is a lost cache.
      auto got = c->GetBytes("m", Key(id));
      std::lock_guard<std::mutex> l(mu);
      if (got.ok()) {
        if (auto bad = CheckExact(*got, id, r->stored_bytes); !bad.empty()) {
          Problem("corrupt", "read back " + Key(id) + ": " + bad);
        } else {
          ++round_trips;
        }
      } else if (killed->load()) {
        ++clean_errors;
        ++clean_error_codes[absl::StatusCodeToString(got.status().code())];
        return;
      } else if (absl::IsNotFound(got.status())) {
        Problem("lost", "read back " + Key(id) + " right after its acknowledgement");
      } else {
        Problem("error", "read back " + Key(id) + ": " + got.status().ToString());
      }
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
      if (!found && damaged && r.state == KeyState::kLive) {
        // After a media fault a cache may be gone or refused; never served wrong (checked below).
        const bool miss = absl::IsNotFound(got.status());
        miss ? ++fault_misses : ++fault_errors;
        const std::string code = absl::StatusCodeToString(got.status().code());
        if (!miss) ++fault_error_codes[code];
        Journal((miss ? "M " : "R ") + std::to_string(id) + (miss ? "" : " " + code));
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
          } else if (auto bad = Check(*got, id, r.stored_bytes); !bad.empty()) {
            Problem("corrupt", "cycle " + std::to_string(cycle) + ": " + Key(id) + " " + bad);
          } else {
            ++verify_gets;
          }
          break;
        case KeyState::kPutInFlight:
          ++cut_puts;
          if (found) {
            if (auto bad = Check(*got, id, 0); !bad.empty()) {
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
            if (auto bad = Check(*got, id, r.stored_bytes); !bad.empty()) {
              Problem("corrupt", "cycle " + std::to_string(cycle) + ": cut delete " + Key(id) +
                                     " " + bad);
            }
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
        if (auto bad = Check(*got, id, 0); !bad.empty()) {
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

  // --readers: gets of random live caches for the whole run, across every kill and restart
  // (the endpoints stay the same: the daemon restarts on fixed ports). A cache served must be
  // the one put (byte for byte with --lossless); a miss of a cache acknowledged and live
  // throughout, with no kill or fault in between, is a lost cache; a failed get is a clean
  // error only when the daemon was killed or restarting meanwhile.
  void Reader(const std::string& endpoints, int r, const std::atomic<bool>* done) {
    client::ClientOptions o;
    o.request_timeout = absl::Seconds(5);
    o.connect_timeout = absl::Seconds(2);
    o.attempts_per_endpoint = 1;
    o.get_timeout = absl::Seconds(8);
    o.down_for = kReaderDownFor;
    o.ucx_overrides = {{"TLS", "tcp"}};
    auto c = client::Client::Connect({endpoints}, o, /*connect_now=*/false);
    if (!c.ok()) {
      std::lock_guard<std::mutex> l(mu);
      Problem("error", "reader " + std::to_string(r) + ": " + c.status().ToString());
      return;
    }
    std::mt19937_64 rng(f.seed * 7919 + static_cast<uint64_t>(r) + 1);
    while (!done->load()) {
      uint64_t id = 0;
      bool have = false;
      const uint64_t kills_before = kills.load();
      uint64_t faults_before = 0;
      {
        std::lock_guard<std::mutex> l(mu);
        faults_before = faults;
        const uint64_t top = next_id.load();
        if (top > 0) {
          auto it = keys.lower_bound(rng() % top);
          for (int step = 0; step < 64 && it != keys.end(); ++step, ++it) {
            if (it->second.state == KeyState::kLive) {
              id = it->first;
              have = true;
              break;
            }
          }
        }
      }
      if (!have) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      auto got = (*c)->GetBytes("m", Key(id));
      bool pause = false;
      ReaderOutcome(id, got, kills_before, faults_before, &pause);
      if (pause) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // The client skips an endpoint that dropped for this long (ClientOptions::down_for): after
  // a restart its gets may fail UNAVAILABLE that long although the daemon is back.
  static constexpr absl::Duration kReaderDownFor = absl::Milliseconds(500);

  void ReaderOutcome(uint64_t id, const absl::StatusOr<std::string>& got, uint64_t kills_before,
                     uint64_t faults_before, bool* pause) {
    {
      std::lock_guard<std::mutex> l(mu);
      const auto since_up = Clock::now() - Clock::time_point(Clock::duration(up_at_ns.load()));
      const bool restarted = kills.load() != kills_before || down.load() ||
                             since_up < absl::ToChronoNanoseconds(kReaderDownFor) +
                                            std::chrono::seconds(2);
      if (got.ok()) {
        if (auto bad = Check(*got, id, 0); !bad.empty()) {
          Problem("corrupt", "reader got " + Key(id) + ": " + bad);
        } else {
          ++reader_gets;
        }
        return;
      }
      auto it = keys.find(id);
      const bool still_live = it != keys.end() && it->second.state == KeyState::kLive;
      if (absl::IsNotFound(got.status())) {
        ++reader_misses;
        if (still_live && !restarted && faults == faults_before && !damaged) {
          Problem("lost", "reader missed live " + Key(id));
        }
      } else if (restarted) {
        CleanOrProblem("reader get " + Key(id), got.status());
        *pause = true;  // the daemon is down or starting: no busy loop of refused connects
      } else {
        Problem("error", "reader get " + Key(id) + ": " + got.status().ToString());
      }
    }
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
    return FlipByteIn(files[rng() % files.size()], rng);
  }

  // Flips one bit of a random byte of `path`: what it did, "" for an empty or missing file.
  static std::string FlipByteIn(const std::filesystem::path& path, std::mt19937_64& rng) {
    std::error_code ec;
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

  // Cuts `path` short at a random length of at least one byte: what it did, "" when it cannot.
  static std::string CutShort(const std::filesystem::path& path, std::mt19937_64& rng) {
    std::error_code ec;
    const uint64_t size = std::filesystem::file_size(path, ec);
    if (ec || size < 2) return "";
    const uint64_t keep = 1 + rng() % (size - 1);
    std::filesystem::resize_file(path, keep, ec);
    if (ec) return "";
    return path.filename().string() + " cut from " + std::to_string(size) + " to " +
           std::to_string(keep) + " bytes";
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
    return CutShort(files[rng() % files.size()], rng);
  }

  // Flips a byte of RocksDB's MANIFEST (`flip`) or cuts it short: "" when there is none.
  std::string DamageTheManifest(const std::string& data, std::mt19937_64& rng, bool flip) {
    std::error_code ec;
    std::filesystem::path path;
    for (const auto& e : std::filesystem::directory_iterator(data + "/rocksdb", ec)) {
      if (e.path().filename().string().rfind("MANIFEST-", 0) == 0) path = e.path();
    }
    if (path.empty()) return "";
    return flip ? FlipByteIn(path, rng) : CutShort(path, rng);
  }

  // Damages a random table file (.sst) of the stopped daemon's RocksDB directory, in turn
  // (`kind` 0, 1, 2): a byte flipped in its first part (data blocks), a byte flipped in its last
  // 512 bytes (index, properties, footer), the file cut short. "" when there is none.
  static std::string DamageATable(const std::string& data, std::mt19937_64& rng, int kind) {
    std::vector<std::filesystem::path> files;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(data + "/rocksdb", ec)) {
      if (e.path().extension() == ".sst" && e.file_size(ec) > 1) files.push_back(e.path());
    }
    if (files.empty()) return "";
    std::sort(files.begin(), files.end());
    const std::filesystem::path path = files[rng() % files.size()];
    if (kind == 2) return CutShort(path, rng);
    const uint64_t size = std::filesystem::file_size(path, ec);
    if (ec || size == 0) return "";
    const uint64_t tail = std::min<uint64_t>(512, size);
    const uint64_t at = kind == 0 ? rng() % std::max<uint64_t>(1, size - tail)
                                  : size - tail + rng() % tail;
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(at));
    char b = 0;
    file.read(&b, 1);
    b = static_cast<char>(b ^ (1 << (rng() % 8)));
    file.seekp(static_cast<std::streamoff>(at));
    file.write(&b, 1);
    return path.filename().string() + (kind == 0 ? " (data)" : " (tail)") + " byte " +
           std::to_string(at) + " of " + std::to_string(size) + " flipped";
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
    std::string reader_endpoints;
    if (f.readers > 0) {
      // Readers keep their endpoints across restarts: the daemon comes back on the same ports.
      const int data_port = FreePort(), control_port = FreePort();
      flags.push_back("--data_plane.port=" + std::to_string(data_port));
      flags.push_back("--control_plane.port=" + std::to_string(control_port));
      reader_endpoints = "127.0.0.1:" + std::to_string(data_port) + ",127.0.0.1:" +
                         std::to_string(control_port);
    }
    flags.insert(flags.end(), f.daemon_flags.begin(), f.daemon_flags.end());
    KvcompdProcess d(f.kvcompd, data, flags);
    std::mt19937_64 rng(f.seed + static_cast<uint64_t>(cycles_done));
    std::uniform_int_distribution<int> run_ms(f.run_min_ms, std::max(f.run_min_ms, f.run_max_ms));
    std::atomic<bool> readers_done{false};
    std::vector<std::thread> readers;
    struct JoinReaders {
      std::atomic<bool>* done;
      std::vector<std::thread>* threads;
      ~JoinReaders() {
        *done = true;
        for (auto& t : *threads) t.join();
      }
    } join_readers{&readers_done, &readers};
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
      if (f.readers > 0 && d.data_endpoint() + ",127.0.0.1:" + std::to_string(d.ports().control) !=
                               reader_endpoints) {
        std::lock_guard<std::mutex> l(mu);
        Problem("error", "kvcompd did not take the ports asked for: " + d.data_endpoint());
        failed = true;
        break;
      }
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
      up_at_ns = Clock::now().time_since_epoch().count();
      down = false;
      if (readers.empty()) {
        for (int r = 0; r < f.readers; ++r) {
          readers.emplace_back([&, r] { Reader(reader_endpoints, r, &readers_done); });
        }
      }
      stop = false;
      std::atomic<bool> killed{false};
      std::vector<std::thread> threads;
      for (int w = 0; w < f.writers; ++w) {
        threads.emplace_back([&, w] { Writer(d, w, &killed); });
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(run_ms(rng)));
      killed = true;
      down = true;
      ++kills;
      // Before a table file is damaged the daemon stops cleanly, so its memtables are written
      // out as fresh table files of every family.
      const bool sst_fault = f.sst_every > 0 && (cycle + 1) % f.sst_every == 0;
      d.Kill(sst_fault ? SIGTERM : SIGKILL);
      stop = true;
      for (auto& t : threads) t.join();
      {
        std::lock_guard<std::mutex> l(mu);
        if (f.flip_every > 0 && (cycle + 1) % f.flip_every == 0) {
          const std::string what = FlipAByte(data, rng);
          if (!what.empty()) {
            NoteFault(what);
          }
        }
        if (f.manifest_every > 0 && (cycle + 1) % f.manifest_every == 0) {
          const bool flip = ((cycle + 1) / f.manifest_every) % 2 == 1;
          const std::string what = DamageTheManifest(data, rng, flip);
          if (!what.empty()) {
            NoteFault(what);
          }
        }
        if (sst_fault) {
          const std::string what = DamageATable(data, rng, ((cycle + 1) / f.sst_every) % 3);
          if (!what.empty()) {
            NoteFault(what);
          }
        }
        if (f.tear_every > 0 && (cycle + 1) % f.tear_every == 0) {
          const std::string what = TearAFile(data, rng);
          if (!what.empty()) {
            NoteFault(what);
          }
        }
        Journal("T " + std::to_string(round_trips.load()) + " " + std::to_string(reader_gets.load()) +
                " " + std::to_string(reader_misses.load()) + " " +
                std::to_string(verify_gets.load()) + " " + std::to_string(clean_errors.load()));
        Journal("C " + std::to_string(cycle + 1));
        cycles_done = cycle + 1;
      }
      if ((cycle + 1) % 50 == 0 && cycle + 1 < end) Progress(cycle + 1, t0, restart_ms);
    }
    if (!failed && cycle == f.cycles) {  // a last restart checks what the last kill left
      if (d.Start(60)) {
        auto c = Connect(d, absl::Seconds(30), 2);
        if (c != nullptr) Verify(*c, cycle);
        readers_done = true;
        for (auto& t : readers) t.join();
        readers.clear();
        down = true;
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
    Progress(cycle, t0, restart_ms);
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
      << " | faults " << faults;
    const char* kind_sep = " (";
    for (auto& [kind, n] : fault_kinds) {
      s << kind_sep << kind << " " << n;
      kind_sep = ", ";
    }
    if (!fault_kinds.empty()) s << ")";
    s << ", then missing " << fault_misses << ", refused " << fault_errors;
    kind_sep = " (";
    for (auto& [code, n] : fault_error_codes) {
      s << kind_sep << code << " " << n;
      kind_sep = ", ";
    }
    if (!fault_error_codes.empty()) s << ")";
    s << ", deleted ones back " << fault_back
      << ", puts and deletes refused (DATA_LOSS) after " << fault_refused_ops
      << " | round trips (acknowledged, read back byte-exact) " << round_trips.load()
      << " | gets compared: readers " << reader_gets.load() << ", after restarts "
      << verify_gets.load() << " | reader misses " << reader_misses.load()
      << " | clean errors (cut by a kill or a restart) " << clean_errors.load();
    const char* sep = " (";
    for (auto& [code, n] : clean_error_codes) {
      s << sep << code << " " << n;
      sep = ", ";
    }
    if (!clean_error_codes.empty()) s << ")";
    s << " | restart-to-ready p50 " << Percentile(restart_ms, 0.5) << " ms, p99 "
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

// ---------------------------------------------------------------------------------------------
// Small lossless caches over the SDK, shared by the diskfull and peer modes: every acknowledged
// cache and every delete is tracked; a check reads every live cache back byte for byte and the
// recently deleted ones as misses.

struct Ledger {
  std::mutex mu;
  std::map<uint64_t, uint64_t> live;  // id -> stored bytes, acknowledged and not deleted
  std::deque<uint64_t> deleted;       // recent acknowledged deletes
  std::atomic<uint64_t> next_id{0};
  std::atomic<uint64_t> acked{0}, round_trips{0}, gets{0}, deletes{0};
  std::atomic<uint64_t> lost{0}, corrupt{0}, back{0}, errors{0};
  std::vector<std::string> problems;  // guarded by mu

  static std::string Key(uint64_t id) { return "s-" + std::to_string(id); }

  void Problem(std::atomic<uint64_t>& counter, const std::string& what) {
    ++counter;
    std::lock_guard<std::mutex> l(mu);
    if (problems.size() < 50) problems.push_back(what);
    std::fprintf(stderr, "PROBLEM: %s\n", what.c_str());
  }
  uint64_t Wrong() const { return lost + corrupt + back + errors; }

  // Puts a new cache; on acknowledgement reads it straight back (a round trip). The status of
  // the put (the read back's problems are recorded here).
  absl::Status PutAndReadBack(client::Client& c) {
    const uint64_t id = next_id.fetch_add(1);
    const Kv kv = MakeSmallKv(id);
    auto r = c.Put("m", Key(id), kSmallLayout, SmallTokensOf(id), kv.layers, Lossless());
    if (!r.ok()) return r.status();
    ++acked;
    {
      std::lock_guard<std::mutex> l(mu);
      live[id] = r->stored_bytes;
    }
    auto got = c.GetBytes("m", Key(id));
    if (!got.ok()) {
      Problem(absl::IsNotFound(got.status()) ? lost : errors,
              "read back " + Key(id) + ": " + got.status().ToString());
    } else if (auto bad = CheckExact(*got, id, r->stored_bytes); !bad.empty()) {
      Problem(corrupt, "read back " + Key(id) + ": " + bad);
    } else {
      ++round_trips;
    }
    return absl::OkStatus();
  }

  // One get of a random live cache (a reader beside the writers).
  void GetOne(client::Client& c, std::mt19937_64& rng) {
    uint64_t id = 0, stored = 0;
    {
      std::lock_guard<std::mutex> l(mu);
      if (live.empty()) return;
      auto it = live.lower_bound(rng() % next_id.load());
      if (it == live.end()) it = live.begin();
      id = it->first;
      stored = it->second;
    }
    auto got = c.GetBytes("m", Key(id));
    if (!got.ok()) {
      std::lock_guard<std::mutex> l(mu);
      if (live.count(id) == 0) return;  // deleted meanwhile
    }
    if (!got.ok()) {
      Problem(absl::IsNotFound(got.status()) ? lost : errors,
              "get " + Key(id) + ": " + got.status().ToString());
    } else if (auto bad = CheckExact(*got, id, stored); !bad.empty()) {
      Problem(corrupt, "get " + Key(id) + ": " + bad);
    } else {
      ++gets;
    }
  }

  // Every live cache byte for byte, every recently deleted one a miss.
  void CheckAll(client::Client& c, const std::string& when) {
    std::map<uint64_t, uint64_t> snapshot;
    std::deque<uint64_t> gone;
    {
      std::lock_guard<std::mutex> l(mu);
      snapshot = live;
      gone = deleted;
    }
    for (auto& [id, stored] : snapshot) {
      auto got = c.GetBytes("m", Key(id));
      if (!got.ok()) {
        Problem(absl::IsNotFound(got.status()) ? lost : errors,
                when + ": " + Key(id) + ": " + got.status().ToString());
      } else if (auto bad = CheckExact(*got, id, stored); !bad.empty()) {
        Problem(corrupt, when + ": " + Key(id) + ": " + bad);
      } else {
        ++gets;
      }
    }
    for (uint64_t id : gone) {
      auto got = c.GetBytes("m", Key(id));
      if (got.ok()) Problem(back, when + ": deleted " + Key(id) + " served");
    }
  }

  // Deletes live caches until `keep` are left (oldest first).
  void DeleteDownTo(client::Client& c, size_t keep) {
    while (true) {
      uint64_t id = 0;
      {
        std::lock_guard<std::mutex> l(mu);
        if (live.size() <= keep) return;
        id = live.begin()->first;
      }
      absl::Status st = c.Delete("m", Key(id));
      if (!st.ok()) {
        Problem(errors, "delete " + Key(id) + ": " + st.ToString());
        return;
      }
      ++deletes;
      std::lock_guard<std::mutex> l(mu);
      live.erase(id);
      deleted.push_back(id);
      if (deleted.size() > 256) deleted.pop_front();
    }
  }
};

uint64_t MetricOf(const KvcompdProcess& d, const std::string& series) {
  const double v = testing::MetricValue(testing::HttpGet(d.ports().metrics, "/metrics").body, series);
  return v < 0 ? UINT64_MAX : static_cast<uint64_t>(v);
}

// ---------------------------------------------------------------------------------------------
// diskfull mode

// `--cycles` cycles on a tmpfs the campaign mounts as the daemon's data directory (root needed;
// a refused mount fails the run). Each cycle: the volume is sized to what it holds plus the
// daemon's reserve plus --room_mb; two writers put small lossless caches (each read straight
// back, byte for byte) while a reader gets live ones, until each writer has had 5 refusals in a
// row; every refusal must be RESOURCE_EXHAUSTED "disk full" (a clean error), anything else while
// the daemon is up is an error. Then every acknowledged cache is read back byte for byte. Every
// other cycle the daemon is SIGKILLed, a filler file takes what was left of the volume, and the
// daemon must start on the full disk (its RocksDB tier read-only), serve every cache and refuse
// a put cleanly; the filler goes. Then the space returns (the volume grows by 256 MiB): puts must
// resume without a restart (the time to the first accepted put is recorded), every cache again
// byte-exact; and all but 8 live caches are deleted (deletes must go on), the deleted ones then
// misses. A last SIGKILL and restart checks everything once more.
int DiskFull(const Flags& f) {
  constexpr uint64_t kMiB = 1 << 20;
  const uint64_t reserve = 4 * kMiB;
  uint64_t size = 256 * kMiB;
  testing::TmpfsMount fs(f.dir + "/data", size);
  if (!fs.ok()) {
    std::fprintf(stderr, "%s\n", fs.error().c_str());
    return 1;
  }
  std::vector<std::string> flags = {"--storage.put_tier=rocksdb",
                                    "--storage.rocksdb_capacity_bytes=4Gi",
                                    "--storage.rocksdb_reserve_bytes=" + std::to_string(reserve),
                                    "--storage.host_capacity_bytes=16Mi",
                                    "--storage.sweep_interval_seconds=0",
                                    "--data_plane.max_block_bytes=1Mi"};
  flags.insert(flags.end(), f.daemon_flags.begin(), f.daemon_flags.end());
  KvcompdProcess d(f.kvcompd, f.dir + "/data", flags);
  if (!d.Start(60)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", d.Log().c_str());
    return 1;
  }
  Ledger led;
  std::atomic<uint64_t> refused{0}, read_only_refused{0};
  uint64_t restarts_on_full = 0, read_only_starts = 0, cycles_never_full = 0;
  std::vector<double> resume_ms;
  const auto t0 = Clock::now();
  auto problem = [&](const std::string& what) { led.Problem(led.errors, what); };
  for (int cycle = 0; cycle < f.cycles && led.Wrong() == 0; ++cycle) {
    const uint64_t used = size - std::min(size, fs.FreeBytes());
    size = used + reserve + f.room_mb * kMiB;
    if (std::string e = fs.Resize(size); !e.empty()) {
      problem(e);
      break;
    }
    const uint64_t refused_before = refused.load();
    std::atomic<bool> writers_done{false};
    std::vector<std::thread> threads;
    for (int w = 0; w < 2; ++w) {
      threads.emplace_back([&] {
        auto c = Connect(d, absl::Seconds(30), 1);
        if (c == nullptr) return problem("writer could not connect");
        int in_a_row = 0;
        for (int n = 0; n < 20000 && in_a_row < 5; ++n) {
          absl::Status st = led.PutAndReadBack(*c);
          if (st.ok()) {
            in_a_row = 0;
          } else if (absl::IsResourceExhausted(st) &&
                     st.message().find("disk full") != absl::string_view::npos) {
            ++refused;
            ++in_a_row;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          } else {
            return problem("put refused, not as disk full: " + st.ToString());
          }
        }
      });
    }
    std::thread reader([&] {
      auto c = Connect(d, absl::Seconds(30), 1);
      if (c == nullptr) return problem("reader could not connect");
      std::mt19937_64 rng(f.seed + static_cast<uint64_t>(cycle));
      while (!writers_done.load()) led.GetOne(*c, rng);
    });
    for (auto& t : threads) t.join();
    writers_done = true;
    reader.join();
    if (refused.load() == refused_before) ++cycles_never_full;
    auto c = Connect(d, absl::Seconds(30), 2);
    if (c == nullptr) {
      problem("cycle " + std::to_string(cycle) + ": could not connect");
      break;
    }
    led.CheckAll(*c, "cycle " + std::to_string(cycle) + ", disk full");
    if (cycle % 2 == 1) {
      c.reset();
      d.Kill(SIGKILL);
      fs.Fill("filler", 64 * 1024);
      ++restarts_on_full;
      if (!d.Start(60)) {
        problem("kvcompd did not start on a full disk:\n" + d.Log());
        break;
      }
      if (MetricOf(d, "kvcomp_store_read_only") == 1) ++read_only_starts;
      c = Connect(d, absl::Seconds(30), 2);
      if (c == nullptr) {
        problem("could not connect after the restart on a full disk");
        break;
      }
      led.CheckAll(*c, "cycle " + std::to_string(cycle) + ", restarted on a full disk");
      absl::Status st = led.PutAndReadBack(*c);
      if (absl::IsResourceExhausted(st)) {
        ++read_only_refused;
      } else if (!st.ok()) {
        problem("put on a full disk after the restart: " + st.ToString());
      }
      std::filesystem::remove(f.dir + "/data/filler");
    }
    size += 256 * kMiB;
    if (std::string e = fs.Resize(size); !e.empty()) {
      problem(e);
      break;
    }
    const auto r0 = Clock::now();
    absl::Status st = absl::UnknownError("not tried");
    while (Clock::now() - r0 < std::chrono::seconds(30)) {
      st = led.PutAndReadBack(*c);
      if (st.ok()) break;
      if (!absl::IsResourceExhausted(st)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!st.ok()) {
      problem("cycle " + std::to_string(cycle) + ": puts did not resume after space returned: " +
              st.ToString());
      break;
    }
    resume_ms.push_back(Ms(Clock::now() - r0));
    led.CheckAll(*c, "cycle " + std::to_string(cycle) + ", space back");
    led.DeleteDownTo(*c, 8);
    led.CheckAll(*c, "cycle " + std::to_string(cycle) + ", after deletes");
  }
  d.Kill(SIGKILL);
  if (d.Start(60)) {
    auto c = Connect(d, absl::Seconds(30), 2);
    if (c != nullptr) led.CheckAll(*c, "last restart");
    d.Kill(SIGTERM);
  } else {
    problem("the last start failed:\n" + d.Log());
  }
  std::ostringstream s;
  s << "| diskfull | cycles " << f.cycles << " (" << f.room_mb << " MiB of room each, reserve "
    << (reserve >> 20) << " MiB) | " << static_cast<int>(Ms(Clock::now() - t0) / 1000)
    << " s | acknowledged puts " << led.acked.load() << " | round trips (read back byte-exact) "
    << led.round_trips.load() << " | other gets compared " << led.gets.load()
    << " | puts refused cleanly (RESOURCE_EXHAUSTED disk full) " << refused.load()
    << " | cycles that never filled " << cycles_never_full << " | restarts on a full disk "
    << restarts_on_full << " (" << read_only_starts << " read-only, " << read_only_refused.load()
    << " put refused cleanly after) | puts resumed after space returned: p50 "
    << Percentile(resume_ms, 0.5) << " ms, max "
    << (resume_ms.empty() ? 0 : *std::max_element(resume_ms.begin(), resume_ms.end()))
    << " ms | deletes " << led.deletes.load() << " | lost " << led.lost.load() << " | corrupt "
    << led.corrupt.load() << " | deleted but back " << led.back.load() << " | errors "
    << led.errors.load() << " |\n";
  for (const auto& p : led.problems) s << "  - " << p << "\n";
  Report(f, s.str());
  return led.Wrong() == 0 && cycles_never_full == 0 ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// peer mode

// The child of a peer cycle: connects to --child_endpoint over UCX, begins a put of a 2 MiB
// cache (4 layers, one block each) under --child_key, sends --child_blocks blocks, says so on
// stdout after each step (4 ms apart), and waits (never commits) for the parent's SIGKILL.
int PutChild(const Flags& f) {
  transport::ClientOptions o;
  o.ucx.overrides["TLS"] = "tcp";
  auto ep = transport::Endpoint::Parse(f.child_endpoint);
  if (!ep.ok()) return 2;
  auto c = transport::UcxClient::Connect(*ep, "", "", o);
  if (!c.ok()) {
    std::fprintf(stderr, "child connect: %s\n", c.status().ToString().c_str());
    return 1;
  }
  constexpr uint64_t kTokens = 512;
  auto id = (*c)->PutBegin(testing::MakePutBegin(kLayout, kTokens, "m", f.child_key));
  if (!id.ok()) return 1;
  std::printf("begun\n");
  std::fflush(stdout);
  std::vector<uint16_t> k(kLayout.LayerBytes(kTokens) / 2, 0x3C00), v(k.size(), 0xBC00);
  for (int b = 0; b < f.child_blocks && b < static_cast<int>(kLayout.num_layers); ++b) {
    const uint32_t l = static_cast<uint32_t>(b);
    if (!(*c)->SendBlock(testing::LayersBlock(*id, kLayout, kTokens, l, l + 1), k.data(), v.data()).ok()) {
      return 1;
    }
    std::printf("block %d\n", b);
    std::fflush(stdout);
    // A producer that makes its layers one by one (prefill): the parent's kill may land
    // between blocks or within one.
    std::this_thread::sleep_for(std::chrono::milliseconds(4));
  }
  while (true) pause();
}

// `--cycles` puts cut between PutBegin and Commit on the UCX data plane, three ways in turn: (0)
// the client closes its connection after PutBegin and some of the blocks; (1) a client process
// (this binary, --mode=put_child) is SIGKILLed at a random moment of its put (connecting, at
// PutBegin, mid-block or after the last block); (2) every block sent, the connection closed
// instead of the Commit. Every other cycle the key already holds an acknowledged cache (an
// overwrite cut short). After each cut put: the key serves the old cache byte for byte, or is a
// miss when there was none (a partial cache is never served); a healthy client's round trip
// works; kvcomp_puts_in_progress comes back to 0 (the put's buffers released; the time it took
// is recorded). The daemon's RSS is reported at the start and the end; --rss_every=N adds a line
// on stderr every N cycles (RSS, open puts, caches stored), and --no_round_trips leaves out the
// healthy client's round trips and overwrites, so that only the cut puts touch the daemon.
// --stalls adds a fourth way, a stalled peer: the client process is stopped (SIGSTOP) after its
// PutBegin was accepted, its connection open; while it is stopped a healthy client's round trip
// must be served, and the daemon must abort the put after data_plane.put_timeout_seconds (2 s
// here) and release its buffers; then the process is killed.
int PeerGone(const Flags& f, const char* self) {
  std::vector<std::string> flags = {"--data_plane.max_block_bytes=1Mi"};
  if (f.stalls) flags.push_back("--data_plane.put_timeout_seconds=2");
  flags.insert(flags.end(), f.daemon_flags.begin(), f.daemon_flags.end());
  KvcompdProcess d(f.kvcompd, f.dir + "/data", flags);
  if (!d.Start(60)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", d.Log().c_str());
    return 1;
  }
  auto c = Connect(d, absl::Seconds(30), 2);
  if (c == nullptr) return 1;
  Ledger led;
  auto problem = [&](const std::string& what) { led.Problem(led.errors, what); };
  const uint64_t rss_start = RssKiB(d.ports().pid);
  std::mt19937_64 rng(f.seed);
  std::vector<double> release_ms;
  uint64_t by_kind[4] = {0, 0, 0, 0}, overwrites = 0, old_kept = 0, misses = 0, not_released = 0;
  std::vector<double> stalled_round_trip_ms;
  pid_t stopped = 0;  // a stalled peer's process, killed once its put was released
  uint64_t open_at_cut = 0, child_before_begin = 0, child_blocks_sent[5] = {0, 0, 0, 0, 0};
  transport::ClientOptions o;
  o.ucx.overrides["TLS"] = "tcp";
  const auto t0 = Clock::now();
  for (int cycle = 0; cycle < f.cycles && led.Wrong() == 0; ++cycle) {
    if (f.rss_every > 0 && cycle % f.rss_every == 0) {
      std::fprintf(stderr, "peer cycle %d rss_kib %llu puts_in_progress %llu tier_entries %llu\n",
                   cycle, static_cast<unsigned long long>(RssKiB(d.ports().pid)),
                   static_cast<unsigned long long>(MetricOf(d, "kvcomp_puts_in_progress")),
                   static_cast<unsigned long long>(MetricOf(d, "kvcomp_caches_stored")));
    }
    const int kind = f.stalls ? cycle % 4 : cycle % 3;
    const bool overwrite = !f.no_round_trips && (cycle / 3) % 2 == 1;
    // The key of the cut put: a live cache's (an overwrite) or a fresh one.
    uint64_t old_id = UINT64_MAX, old_stored = 0;
    if (overwrite) {
      if (!led.PutAndReadBack(*c).ok()) {
        problem("put before an overwrite failed");
        break;
      }
      std::lock_guard<std::mutex> l(led.mu);
      old_id = led.live.rbegin()->first;
      old_stored = led.live.rbegin()->second;
    }
    const std::string key =
        overwrite ? Ledger::Key(old_id) : "cut-" + std::to_string(cycle);
    const int blocks = kind == 2 ? static_cast<int>(kLayout.num_layers)
                                 : static_cast<int>(rng() % kLayout.num_layers);
    if (kind == 1 || kind == 3) {
      int out[2];
      if (pipe(out) != 0) return 1;
      const std::string ep_arg = "--child_endpoint=" + d.data_endpoint();
      const std::string key_arg = "--child_key=" + key;
      const std::string blocks_arg = "--child_blocks=" + std::to_string(kLayout.num_layers);
      const pid_t pid = fork();
      if (pid == 0) {
        dup2(out[1], STDOUT_FILENO);
        close(out[0]);
        execl(self, self, "--mode=put_child", ep_arg.c_str(), key_arg.c_str(), blocks_arg.c_str(),
              static_cast<char*>(nullptr));
        _exit(127);
      }
      close(out[1]);
      // Killed at a random moment: every third at a random time from the start (often before
      // its PutBegin), the others within a few milliseconds after the daemon accepted its
      // PutBegin (before, within or after its blocks).
      std::string said;
      auto read_some = [&](int wait_ms) {
        pollfd p{out[0], POLLIN, 0};
        char buf[256];
        if (poll(&p, 1, wait_ms) > 0) {
          const ssize_t n = read(out[0], buf, sizeof(buf));
          if (n > 0) said.append(buf, static_cast<size_t>(n));
        }
      };
      if (kind == 1 && cycle % 9 == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 150));
      } else {
        const auto w0 = Clock::now();
        while (said.find("begun") == std::string::npos &&
               Clock::now() - w0 < std::chrono::seconds(10)) {
          read_some(100);
        }
        if (MetricOf(d, "kvcomp_puts_in_progress") == 1) ++open_at_cut;
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
      }
      if (kind == 3) {
        kill(pid, SIGSTOP);
        stopped = pid;
        // The stopped peer holds its put and its connection: others are served meanwhile.
        if (!f.no_round_trips) {
          const auto s0 = Clock::now();
          if (absl::Status st = led.PutAndReadBack(*c); !st.ok()) {
            problem("round trip beside a stalled peer: " + st.ToString());
          } else {
            stalled_round_trip_ms.push_back(Ms(Clock::now() - s0));
          }
        }
      } else {
        kill(pid, SIGKILL);
        int status = 0;
        waitpid(pid, &status, 0);
      }
      read_some(0);
      close(out[0]);
      if (kind == 1 && said.find("begun") == std::string::npos) {
        ++child_before_begin;
      } else if (kind == 1) {
        size_t sent = 0;
        for (size_t at = said.find("block"); at != std::string::npos; at = said.find("block", at + 1)) ++sent;
        ++child_blocks_sent[std::min<size_t>(sent, 4)];
      }
    } else {
      auto u = transport::UcxClient::Connect(*transport::Endpoint::Parse(d.data_endpoint()), "", "", o);
      if (!u.ok()) {
        problem("connect: " + u.status().ToString());
        break;
      }
      auto id = (*u)->PutBegin(testing::MakePutBegin(kLayout, 512, "m", key));
      if (!id.ok()) {
        problem("PutBegin: " + id.status().ToString());
        break;
      }
      std::vector<uint16_t> k(kLayout.LayerBytes(512) / 2, 0x3C00), v(k.size(), 0xBC00);
      for (int b = 0; b < blocks; ++b) {
        const uint32_t l = static_cast<uint32_t>(b);
        absl::Status st =
            (*u)->SendBlock(testing::LayersBlock(*id, kLayout, 512, l, l + 1), k.data(), v.data());
        if (!st.ok()) problem("block: " + st.ToString());
      }
      if (MetricOf(d, "kvcomp_puts_in_progress") == 1) ++open_at_cut;
      (*u)->Close();
      u->reset();
    }
    ++by_kind[kind];
    // Resources released: no put left open.
    const auto r0 = Clock::now();
    uint64_t open_puts = UINT64_MAX;
    while (Clock::now() - r0 < std::chrono::seconds(20)) {
      open_puts = MetricOf(d, "kvcomp_puts_in_progress");
      if (open_puts == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (stopped != 0) {  // released (or given up on): the stalled process goes
      kill(stopped, SIGKILL);
      int status = 0;
      waitpid(stopped, &status, 0);
      stopped = 0;
    }
    if (open_puts != 0) {
      ++not_released;
      problem("cycle " + std::to_string(cycle) + ": kvcomp_puts_in_progress " +
              std::to_string(open_puts) + " 20 s after the peer went");
    } else {
      release_ms.push_back(Ms(Clock::now() - r0));
    }
    // Never a partial cache: the old one byte for byte, or a miss.
    auto got = c->GetBytes("m", key);
    if (overwrite) {
      ++overwrites;
      if (!got.ok()) {
        led.Problem(led.lost, "old cache under " + key + " after a cut overwrite: " +
                                  got.status().ToString());
      } else if (auto bad = CheckExact(*got, old_id, old_stored); !bad.empty()) {
        led.Problem(led.corrupt, "cut overwrite of " + key + " served: " + bad);
      } else {
        ++old_kept;
      }
    } else if (got.ok()) {
      led.Problem(led.corrupt, "cut put " + key + " served (" + std::to_string(got->size()) +
                                   " bytes)");
    } else if (absl::IsNotFound(got.status())) {
      ++misses;
    } else {
      problem("get " + key + ": " + got.status().ToString());
    }
    // The daemon serves a healthy client's round trip.
    if (!f.no_round_trips) {
      if (absl::Status st = led.PutAndReadBack(*c); !st.ok()) problem("round trip: " + st.ToString());
    }
    if (cycle % 20 == 19) led.DeleteDownTo(*c, 16);
  }
  led.CheckAll(*c, "end");
  const uint64_t rss_end = RssKiB(d.ports().pid);
  const bool alive = d.running();
  c.reset();
  d.Kill(SIGTERM);
  std::ostringstream s;
  s << "| peer | cycles " << f.cycles << " | " << static_cast<int>(Ms(Clock::now() - t0) / 1000)
    << " s | puts cut: connection closed after PutBegin and 0-3 of 4 blocks " << by_kind[0]
    << ", client process SIGKILLed at a random moment " << by_kind[1] << " (before its PutBegin "
    << "was accepted " << child_before_begin << ", after it with 0/1/2/3/4 blocks sent "
    << child_blocks_sent[0] << "/" << child_blocks_sent[1] << "/" << child_blocks_sent[2] << "/"
    << child_blocks_sent[3] << "/" << child_blocks_sent[4] << ")"
    << ", connection closed with every block sent and no Commit " << by_kind[2]
    << ", client process stopped (SIGSTOP) after its PutBegin " << by_kind[3]
    << " (a round trip beside it: p50 " << Percentile(stalled_round_trip_ms, 0.5) << " ms, max "
    << (stalled_round_trip_ms.empty()
            ? 0
            : *std::max_element(stalled_round_trip_ms.begin(), stalled_round_trip_ms.end()))
    << " ms)"
    << " | put seen open by the daemon (kvcomp_puts_in_progress 1) just before the cut "
    << open_at_cut
    << " | overwrites cut " << overwrites << " (old cache served byte-exact " << old_kept
    << ") | fresh keys a miss " << misses << " | open puts released: p50 "
    << Percentile(release_ms, 0.5) << " ms, max "
    << (release_ms.empty() ? 0 : *std::max_element(release_ms.begin(), release_ms.end()))
    << " ms, not released " << not_released << " | round trips (put, read back byte-exact) "
    << led.round_trips.load() << ", other gets compared " << led.gets.load() << " | RSS "
    << rss_start / 1024 << " -> " << rss_end / 1024 << " MiB | lost " << led.lost.load()
    << " | corrupt or partial " << led.corrupt.load() << " | errors " << led.errors.load()
    << " | daemon alive " << (alive ? "yes" : "NO") << " |\n";
  for (const auto& p : led.problems) s << "  - " << p << "\n";
  Report(f, s.str());
  return led.Wrong() == 0 && alive ? 0 : 1;
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
    else if (const char* v = val("manifest_every")) f.manifest_every = std::atoi(v);
    else if (const char* v = val("sst_every")) f.sst_every = std::atoi(v);
    else if (const char* v = val("rss_every")) f.rss_every = std::atoi(v);
    else if (a == "--no_round_trips") f.no_round_trips = true;
    else if (a == "--stalls") f.stalls = true;
    else if (a == "--lossless") f.lossless = true;
    else if (const char* v = val("readers")) f.readers = std::atoi(v);
    else if (const char* v = val("run_ms")) {
      f.run_min_ms = std::atoi(v);
      const char* colon = std::strchr(v, ':');
      f.run_max_ms = colon != nullptr ? std::atoi(colon + 1) : f.run_min_ms;
    }
    else if (const char* v = val("room_mb")) f.room_mb = std::strtoull(v, nullptr, 10);
    else if (const char* v = val("child_endpoint")) f.child_endpoint = v;
    else if (const char* v = val("child_key")) f.child_key = v;
    else if (const char* v = val("child_blocks")) f.child_blocks = std::atoi(v);
    // clang-format on
    else if (const char* v = val("daemon_flag")) f.daemon_flags.push_back(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (f.mode != "kill" && f.mode != "soak" && f.mode != "lockout" && f.mode != "restart" &&
      f.mode != "diskfull" && f.mode != "peer" && f.mode != "put_child") {
    std::fprintf(stderr, "--mode must be kill, soak, lockout, restart, diskfull or peer\n");
    std::exit(2);
  }
  if (f.dir.empty() && f.mode != "put_child") {
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
  } else if (f.mode == "diskfull") {
    rc = kvcomp::DiskFull(f);
  } else if (f.mode == "peer") {
    rc = kvcomp::PeerGone(f, "/proc/self/exe");
  } else if (f.mode == "put_child") {
    return kvcomp::PutChild(f);
  } else {
    std::fprintf(stderr, "--mode must be kill, soak, lockout, restart, diskfull or peer\n");
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
