// End-to-end benchmark of kvcompd: starts a real daemon (embedded defaults plus the flags given
// after `--`), pushes a Llama-3.1-8B-shaped cache over UCX and measures
//   ingest: PutBegin -> every block acknowledged (receive GB/s over the K+V bytes) and
//           PutBegin -> commit acknowledged (end-to-end put GB/s, compression and store included),
//           with 1 MiB blocks pipelined (SendBlockAsync, a window of blocks in flight);
//   get:    latency of fetching the stored cache (GetInto a preallocated host buffer), p50/p99.
// Prints one YAML document on stdout.
//
// With --clients N it measures instead the latency of concurrent puts: N connections, each putting
// --puts caches of --put_tokens tokens one after another (p50/p99 of begin -> commit acknowledged).
//
// With --kvsplice it measures instead a cache of --tokens tokens put twice, with the default
// eviction (manifold, ratio 0.5, moments) and with KVSplice on top (int8 keys, values on a
// projection), the way a user gets there: an earlier request of the model (--calibration_tokens)
// is stored with raw values, the SDK's Client::Calibrate has the daemon fit a projection from it
// at --error_budget, then the measured cache (other tokens, the same value subspaces) is put with
// the KVSplice policy. Per put: bytes in and out and the daemon's stage seconds (its histograms
// read before and after the put); per case: the get as stored, and a decoded get (SDK
// GetDecoded) whose kept keys and values are checked against what was sent (eviction: exact;
// KVSplice: every layer's relative value error within the error budget).
//
// Usage: kvcompd_bench --kvcompd PATH [--tls tcp|posix,tcp] [--tokens N] [--ingest_tokens N]
//                      [--gets N] [--window N] [--clients N --puts N --put_tokens N]
//                      [--kvsplice [--calibration_tokens N] [--error_budget E]
//                       [--value_codec NAME] [--key_codec NAME] [--reps N]]
//                      [-- kvcompd flags...]
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"

namespace {

using kvcomp::CompressionPolicy;
using kvcomp::DType;
using kvcomp::KvLayout;
namespace wire = kvcomp::transport::wire;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Args {
  std::string kvcompd;
  std::string tls = "tcp";
  uint64_t tokens = 32768;         // get benchmark cache
  uint64_t ingest_tokens = 32768;  // ingest benchmark cache
  int gets = 30;
  int window = 16;
  uint64_t block_bytes = 1 << 20;
  // Concurrent puts: `clients` connections, each putting `puts` caches of `put_tokens` tokens
  // one after another; per-put latency (begin to commit acknowledged) p50/p99. 0 = skip.
  int clients = 0;
  int puts = 10;
  uint64_t put_tokens = 1024;
  // KVSplice case (--kvsplice): the measured cache is --tokens tokens, put --reps times per case.
  bool kvsplice = false;
  uint64_t calibration_tokens = 2048;
  double error_budget = 0.1;
  std::string value_codec = "orthogonal_int8";
  std::string key_codec = "int8";
  int reps = 1;
  std::vector<std::string> flags;
};

// A cache's K and V for one layer, bf16 [kv_heads][tokens][head_dim]; the same random layer is
// reused for every layer (the bytes' values do not change the data path's cost).
struct LayerData {
  std::vector<uint16_t> k, v;
};

LayerData MakeLayer(const KvLayout& layout, uint64_t tokens) {
  LayerData d;
  size_t n = uint64_t{layout.num_kv_heads} * tokens * layout.head_dim;
  d.k.resize(n);
  d.v.resize(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    d.k[i] = kvcomp::FloatToBf16(g(rng));
    d.v[i] = kvcomp::FloatToBf16(g(rng));
  }
  return d;
}

// Values near a low-dimensional subspace per kv head, as a model's are. Each head has a fixed
// orthonormal basis of `kValueDim` directions (the same for every request and layer, as a
// model's weights are), values are unit Gaussian coordinates on it plus isotropic noise of std
// `kValueNoise`; keys are unit Gaussian. A projection of rank kValueDim keeps all but the
// noise off the subspace: relative value error sqrt((d - r) s^2 / (r + d s^2)), 0.069 for
// d 128, r 32, s 0.04. `seed` picks the request (its tokens), not the subspaces.
constexpr uint32_t kValueDim = 32;
constexpr float kValueNoise = 0.04f;

LayerData MakeModelLayer(const KvLayout& layout, uint64_t tokens, uint32_t seed) {
  const uint32_t D = layout.head_dim, r = std::min(kValueDim, layout.head_dim);
  LayerData d;
  d.k.resize(uint64_t{layout.num_kv_heads} * tokens * D);
  d.v.resize(d.k.size());
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<double> basis(uint64_t{r} * D);  // [r][D], orthonormal rows
  std::vector<float> z(r), row(D);
  for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
    std::mt19937 brng(5000 + h);
    for (uint32_t i = 0; i < r; ++i) {  // Gram-Schmidt over Gaussian rows
      double* b = &basis[uint64_t{i} * D];
      for (uint32_t j = 0; j < D; ++j) b[j] = g(brng);
      for (uint32_t p = 0; p < i; ++p) {
        const double* q = &basis[uint64_t{p} * D];
        double dot = 0;
        for (uint32_t j = 0; j < D; ++j) dot += b[j] * q[j];
        for (uint32_t j = 0; j < D; ++j) b[j] -= dot * q[j];
      }
      double norm = 0;
      for (uint32_t j = 0; j < D; ++j) norm += b[j] * b[j];
      for (uint32_t j = 0; j < D; ++j) b[j] /= std::sqrt(norm);
    }
    std::mt19937 rng(seed * 1000 + h);
    for (uint64_t t = 0; t < tokens; ++t) {
      const uint64_t at = (uint64_t{h} * tokens + t) * D;
      for (uint32_t i = 0; i < r; ++i) z[i] = g(rng);
      for (uint32_t j = 0; j < D; ++j) row[j] = kValueNoise * g(rng);
      for (uint32_t i = 0; i < r; ++i) {
        const double* b = &basis[uint64_t{i} * D];
        for (uint32_t j = 0; j < D; ++j) row[j] += static_cast<float>(z[i] * b[j]);
      }
      for (uint32_t j = 0; j < D; ++j) {
        d.k[at + j] = kvcomp::FloatToBf16(g(rng));
        d.v[at + j] = kvcomp::FloatToBf16(row[j]);
      }
    }
  }
  return d;
}

struct PutTiming {
  double received_s = 0, committed_s = 0;
  uint64_t bytes = 0, stored = 0;
  bool ok = false;
  std::string error;
};

// Blocks of one layer: [kv_heads][block tokens][head_dim] per half; every layer sends the same.
struct Prepared {
  wire::Block block;
  std::vector<uint16_t> k, v;
};

std::vector<Prepared> PrepareLayerBlocks(const KvLayout& layout, uint64_t tokens,
                                         uint64_t block_tokens, const LayerData& layer) {
  std::vector<Prepared> per_layer;
  const uint32_t D = layout.head_dim;
  for (uint64_t tb = 0; tb < tokens; tb += block_tokens) {
    uint64_t te = std::min(tokens, tb + block_tokens);
    Prepared p;
    for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
      size_t at = (uint64_t{h} * tokens + tb) * D;
      p.k.insert(p.k.end(), layer.k.begin() + at, layer.k.begin() + at + (te - tb) * D);
      p.v.insert(p.v.end(), layer.v.begin() + at, layer.v.begin() + at + (te - tb) * D);
    }
    p.block.token_begin = tb;
    p.block.token_end = te;
    p.block.key_bytes = p.block.value_bytes = layout.LayerBytes(te - tb);
    per_layer.push_back(std::move(p));
  }
  return per_layer;
}

std::vector<Prepared> PrepareLayerBlocks(const KvLayout& layout, uint64_t tokens,
                                         uint64_t block_tokens) {
  return PrepareLayerBlocks(layout, tokens, block_tokens, MakeLayer(layout, tokens));
}

// Puts `tokens` tokens of `layout` from `per_layer` (PrepareLayerBlocks), keeping up to
// `window` blocks in flight; with `policy`, under that policy (else the daemon's default).
PutTiming SendPut(kvcomp::transport::UcxClient& c, const KvLayout& layout, uint64_t tokens,
                  const std::vector<Prepared>& per_layer, int window, const std::string& key,
                  const CompressionPolicy* policy = nullptr) {
  PutTiming t;
  wire::PutBegin begin;
  begin.layout = layout;
  begin.num_tokens = tokens;
  begin.model_id = "meta-llama/Llama-3.1-8B";
  begin.key = key;
  if (policy != nullptr) {
    begin.has_policy = true;
    begin.policy = *policy;
  }
  Clock::time_point t0 = Clock::now();
  auto id = c.PutBegin(begin);
  if (!id.ok()) {
    t.error = id.status().ToString();
    return t;
  }
  absl::Mutex mu;
  int in_flight = 0;
  uint64_t sent = 0;
  absl::Status first_error;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (const Prepared& p : per_layer) {
      wire::Block b = p.block;
      b.put_id = *id;
      b.layer_begin = l;
      b.layer_end = l + 1;
      {
        absl::MutexLock lock(&mu);
        auto room = [&]() { return in_flight < window; };
        mu.Await(absl::Condition(&room));
        ++in_flight;
      }
      c.SendBlockAsync(b, p.k.data(), p.v.data(), [&](absl::Status s) {
        absl::MutexLock lock(&mu);
        --in_flight;
        if (!s.ok() && first_error.ok()) first_error = s;
      });
      ++sent;
      t.bytes += b.payload_bytes();
    }
  }
  {
    absl::MutexLock lock(&mu);
    auto drained = [&]() { return in_flight == 0; };
    mu.Await(absl::Condition(&drained));
  }
  t.received_s = Since(t0);
  if (!first_error.ok()) {
    t.error = first_error.ToString();
    return t;
  }
  auto summary = c.PutCommit(*id, sent);
  t.committed_s = Since(t0);
  if (!summary.ok()) {
    t.error = summary.status().ToString();
    return t;
  }
  t.stored = summary->stored_bytes;
  t.ok = true;
  return t;
}

// Puts `tokens` tokens of `layout`, in blocks of `block_tokens` tokens of one layer, keeping
// up to `window` blocks in flight. Block payloads are gathered up front.
PutTiming Put(kvcomp::transport::UcxClient& c, const KvLayout& layout, uint64_t tokens,
              uint64_t block_tokens, int window, const std::string& key) {
  return SendPut(c, layout, tokens, PrepareLayerBlocks(layout, tokens, block_tokens), window, key);
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(q * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// The daemon's cumulative stage seconds and transfer counters (/metrics); the difference of two
// readings is what happened between them.
struct DaemonCounters {
  double receive = 0, to_device = 0, compress = 0, download = 0, encode = 0, store = 0, serve = 0;
  double gpu_s = 0, h2d_bytes = 0, d2h_bytes = 0;
};

DaemonCounters ReadCounters(int metrics_port) {
  const std::string m = kvcomp::testing::HttpGet(metrics_port, "/metrics").body;
  auto value = [&](const std::string& series) {
    return std::max(0.0, kvcomp::testing::MetricValue(m, series));  // absent: 0
  };
  auto stage = [&](const char* s) {
    return value(std::string("kvcomp_stage_duration_seconds_sum{stage=\"") + s + "\"}");
  };
  DaemonCounters c;
  c.receive = stage("receive");
  c.to_device = stage("to_device");
  c.compress = stage("compress");
  c.download = stage("download");
  c.encode = stage("encode");
  c.store = stage("store");
  c.serve = stage("serve");
  c.gpu_s = value("kvcomp_gpu_seconds_total");
  c.h2d_bytes = value("kvcomp_h2d_bytes_total");
  c.d2h_bytes = value("kvcomp_d2h_bytes_total");
  return c;
}

DaemonCounters operator-(const DaemonCounters& a, const DaemonCounters& b) {
  DaemonCounters d;
  d.receive = a.receive - b.receive;
  d.to_device = a.to_device - b.to_device;
  d.compress = a.compress - b.compress;
  d.download = a.download - b.download;
  d.encode = a.encode - b.encode;
  d.store = a.store - b.store;
  d.serve = a.serve - b.serve;
  d.gpu_s = a.gpu_s - b.gpu_s;
  d.h2d_bytes = a.h2d_bytes - b.h2d_bytes;
  d.d2h_bytes = a.d2h_bytes - b.d2h_bytes;
  return d;
}

// A decoded get (raw codecs, the input dtype) against the K and V that were sent: every layer
// repeats `sent` (one layer's K and V), so layer l, head h, kept token p must hold
// sent[h][p]. Relative errors per layer as the calibration measures them:
// sqrt(sum |x - x'|^2 / sum |x|^2) over the layer's kept tokens.
struct Verification {
  std::string error;  // a structural mismatch; empty when the cache has the expected shape
  uint64_t kept = 0;
  double key_error_max = 0, value_error_max = 0;
};

Verification Verify(const kvcomp::CompressedCache& got, const KvLayout& layout, uint64_t tokens,
                    const LayerData& sent) {
  Verification v;
  const uint32_t D = layout.head_dim;
  if (!(got.layout == layout) || got.original_tokens != tokens ||
      got.key_codec != kvcomp::KeyCodec::kRaw || got.value_codec != kvcomp::ValueCodec::kRaw ||
      got.KeyTokenBytes() != D * 2 || got.ValueTokenBytes() != D * 2) {
    v.error = "decoded cache has another layout, token count or codec";
    return v;
  }
  const std::vector<uint64_t> offsets = got.TokenOffsets();
  const uint16_t* keys = reinterpret_cast<const uint16_t*>(got.keys.data());
  const uint16_t* values = reinterpret_cast<const uint16_t*>(got.values.data());
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    double kn = 0, kd = 0, vn = 0, vd = 0;
    for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
      const uint32_t hi = got.head_index(l, h);
      uint64_t last = 0;
      for (uint64_t i = 0; i < got.kept[hi]; ++i) {
        const uint64_t row = offsets[hi] + i;
        const uint64_t p = got.positions[row];
        if (p >= tokens || (i > 0 && p <= last)) {
          v.error = "kept positions out of range or not ascending";
          return v;
        }
        last = p;
        const uint64_t at = (uint64_t{h} * tokens + p) * D;
        for (uint32_t j = 0; j < D; ++j) {
          const double k0 = kvcomp::Bf16ToFloat(sent.k[at + j]);
          const double v0 = kvcomp::Bf16ToFloat(sent.v[at + j]);
          const double dk = kvcomp::Bf16ToFloat(keys[row * D + j]) - k0;
          const double dv = kvcomp::Bf16ToFloat(values[row * D + j]) - v0;
          kn += dk * dk;
          kd += k0 * k0;
          vn += dv * dv;
          vd += v0 * v0;
        }
      }
      v.kept += got.kept[hi];
    }
    v.key_error_max = std::max(v.key_error_max, kd > 0 ? std::sqrt(kn / kd) : 0.0);
    v.value_error_max = std::max(v.value_error_max, vd > 0 ? std::sqrt(vn / vd) : 0.0);
  }
  return v;
}

struct CasePut {
  std::string name;
  int rep = 0;
  PutTiming timing;
  DaemonCounters stages;
};

// --kvsplice: the default eviction, and KVSplice on a projection the daemon calibrated through
// the SDK, on the same cache; bytes, stage seconds per put, gets, and the decoded values checked.
int RunKvSplice(const Args& a, kvcomp::testing::KvcompdProcess& d, kvcomp::transport::UcxClient& c,
                const KvLayout& layout, uint64_t block_tokens) {
  const std::string model = "meta-llama/Llama-3.1-8B";
  const int metrics = d.ports().metrics;
  CompressionPolicy evict;  // manifold, ratio 0.5 (the default policy) with moments
  evict.moments = true;
  CompressionPolicy splice = evict;
  auto kc = kvcomp::ParseKeyCodec(a.key_codec);
  auto vc = kvcomp::ParseValueCodec(a.value_codec);
  if (!kc.ok() || !vc.ok() || *vc == kvcomp::ValueCodec::kRaw) {
    std::fprintf(stderr, "--key_codec / --value_codec: %s %s (a KVSplice value codec needed)\n",
                 kc.status().ToString().c_str(), vc.status().ToString().c_str());
    return 2;
  }
  splice.key_codec = *kc;
  splice.value_codec = *vc;

  // The SDK, as an application would use it: data and control address of the daemon.
  kvcomp::client::ClientOptions so;
  so.ucx_overrides = {{"TLS", a.tls}};
  so.request_timeout = absl::Seconds(600);
  so.get_timeout = absl::Seconds(600);  // a decoded get of a large cache on a CPU engine
  auto sdk = kvcomp::client::Client::Connect(
      {d.data_endpoint() + ",127.0.0.1:" + std::to_string(d.ports().control)}, so);
  if (!sdk.ok()) {
    std::fprintf(stderr, "SDK connect: %s\n", sdk.status().ToString().c_str());
    return 1;
  }

  std::printf("kvsplice:\n  tokens: %llu\n  policy_evict: \"%s\"\n  policy_kvsplice: \"%s\"\n",
              static_cast<unsigned long long>(a.tokens), evict.DebugString().c_str(),
              splice.DebugString().c_str());
  std::printf(
      "  data: \"values on a %u-dimensional subspace per kv head plus noise of std %.2f, "
      "keys unit Gaussian; every layer repeats one layer's K and V\"\n",
      kValueDim, kValueNoise);

  // An earlier request of the model, stored with raw values, then Calibrate on it.
  const LayerData earlier = MakeModelLayer(layout, a.calibration_tokens, 2);
  PutTiming ct = SendPut(c, layout, a.calibration_tokens,
                         PrepareLayerBlocks(layout, a.calibration_tokens, block_tokens, earlier),
                         a.window, "earlier-request", &evict);
  if (!ct.ok) {
    std::fprintf(stderr, "earlier request put failed: %s\n", ct.error.c_str());
    return 1;
  }
  kvcomp::client::CalibrateOptions co;
  co.value_codec = a.value_codec;
  co.error_budget = a.error_budget;
  Clock::time_point t0 = Clock::now();
  auto cal = (*sdk)->Calibrate(model, co);
  const double calibrate_s = Since(t0);
  if (!cal.ok() || cal->empty() || !(*cal)[0].status.ok()) {
    std::fprintf(stderr, "calibrate failed: %s\n",
                 !cal.ok()      ? cal.status().ToString().c_str()
                 : cal->empty() ? "no endpoint"
                                : (*cal)[0].status.ToString().c_str());
    return 1;
  }
  const kvcomp::client::CalibrateResult& r = (*cal)[0];
  const uint32_t rank_min = r.layer_ranks.empty()
                                ? r.rank
                                : *std::min_element(r.layer_ranks.begin(), r.layer_ranks.end());
  std::printf(
      "  calibration:\n    earlier_request_tokens: %llu\n    earlier_request_put_s: %.4f\n"
      "    calibrate_s: %.4f\n    value_codec: \"%s\"\n    error_budget: %.4f\n"
      "    achieved_error: %.4f\n    projection_version: %llu\n    rank_min: %u\n"
      "    rank_max: %u\n    caches_used: %llu\n",
      static_cast<unsigned long long>(a.calibration_tokens), ct.committed_s, calibrate_s,
      a.value_codec.c_str(), a.error_budget, r.achieved_error,
      static_cast<unsigned long long>(r.projection_version), rank_min, r.rank,
      static_cast<unsigned long long>(r.caches_used));
  std::fflush(stdout);

  // The measured request: other tokens on the same subspaces.
  const LayerData sent = MakeModelLayer(layout, a.tokens, 1);
  const std::vector<Prepared> blocks = PrepareLayerBlocks(layout, a.tokens, block_tokens, sent);
  std::vector<CasePut> puts;
  std::printf("  puts:\n");
  for (int rep = 0; rep < a.reps; ++rep) {
    for (const auto& [name, policy] :
         {std::pair<std::string, const CompressionPolicy*>{"evict", &evict},
          std::pair<std::string, const CompressionPolicy*>{"kvsplice", &splice}}) {
      CasePut p;
      p.name = name;
      p.rep = rep;
      const DaemonCounters before = ReadCounters(metrics);
      p.timing =
          SendPut(c, layout, a.tokens, blocks, a.window, name + "-" + std::to_string(rep), policy);
      p.stages = ReadCounters(metrics) - before;
      if (!p.timing.ok) {
        std::fprintf(stderr, "%s put failed: %s\n%s\n", name.c_str(), p.timing.error.c_str(),
                     d.Log().c_str());
        return 1;
      }
      const PutTiming& t = p.timing;
      std::printf(
          "    - case: %s\n      rep: %d\n      bytes: %llu\n      stored_bytes: %llu\n"
          "      client_receive_s: %.4f\n      client_put_s: %.4f\n"
          "      daemon_receive_s: %.4f\n      daemon_to_device_s: %.4f\n"
          "      daemon_compress_s: %.4f\n      daemon_download_s: %.4f\n"
          "      daemon_encode_s: %.4f\n      daemon_store_s: %.4f\n"
          "      daemon_gpu_s: %.4f\n      h2d_bytes: %.0f\n      d2h_bytes: %.0f\n",
          name.c_str(), rep, static_cast<unsigned long long>(t.bytes),
          static_cast<unsigned long long>(t.stored), t.received_s, t.committed_s, p.stages.receive,
          p.stages.to_device, p.stages.compress, p.stages.download, p.stages.encode,
          p.stages.store, p.stages.gpu_s, p.stages.h2d_bytes, p.stages.d2h_bytes);
      std::fflush(stdout);
      puts.push_back(std::move(p));
    }
  }

  // Gets of rep 0's caches: as stored (what a decode node transfers), then decoded by the
  // daemon (SDK GetDecoded) and checked against what was sent.
  bool all_ok = true;
  std::printf("  gets:\n");
  for (const CasePut& p : puts) {
    if (p.rep != 0) continue;
    const std::string key = p.name + "-0";
    std::vector<uint8_t> dst(p.timing.stored);
    std::vector<double> lat;
    const DaemonCounters before = ReadCounters(metrics);
    for (int i = 0; i < a.gets + 1; ++i) {
      Clock::time_point g0 = Clock::now();
      auto n = c.GetInto(model, key, wire::Representation::kStored, dst.data(), dst.size());
      const double s = Since(g0);
      if (!n.ok() || *n != p.timing.stored) {
        std::fprintf(stderr, "get %s failed: %s\n", key.c_str(), n.status().ToString().c_str());
        return 1;
      }
      if (i > 0) lat.push_back(s);  // the first get warms up the registration
    }
    const DaemonCounters stored_get = ReadCounters(metrics) - before;
    Clock::time_point g0 = Clock::now();
    auto decoded = (*sdk)->GetDecoded(model, key);
    const double decoded_s = Since(g0);
    const DaemonCounters decoded_get = ReadCounters(metrics) - before - stored_get;
    if (!decoded.ok()) {
      std::fprintf(stderr, "decoded get %s failed: %s\n", key.c_str(),
                   decoded.status().ToString().c_str());
      return 1;
    }
    const Verification v = Verify(*decoded, layout, a.tokens, sent);
    // Raw codecs give back exactly what was sent; KVSplice within the calibrated error budget.
    const bool exact = p.name == "evict";
    const bool ok = v.error.empty() && (exact ? v.key_error_max == 0 && v.value_error_max == 0
                                              : v.value_error_max <= a.error_budget);
    all_ok = all_ok && ok;
    std::printf(
        "    - case: %s\n      stored_bytes: %llu\n      samples: %zu\n"
        "      stored_p50_ms: %.2f\n      stored_p99_ms: %.2f\n      daemon_serve_ms_per_get: "
        "%.2f\n      decoded_get_s: %.4f\n      daemon_serve_decoded_s: %.4f\n"
        "      kept_tokens: %llu\n      key_error_max: %.5f\n      value_error_max: %.5f\n"
        "      check: \"%s\"\n      verified: %s\n",
        p.name.c_str(), static_cast<unsigned long long>(p.timing.stored), lat.size(),
        Percentile(lat, 0.5) * 1e3, Percentile(lat, 0.99) * 1e3,
        stored_get.serve / (a.gets + 1) * 1e3, decoded_s, decoded_get.serve,
        static_cast<unsigned long long>(v.kept), v.key_error_max, v.value_error_max,
        !v.error.empty() ? v.error.c_str()
        : exact          ? "kept keys and values equal to those sent"
                         : "every layer's relative value error <= error_budget",
        ok ? "true" : "false");
    std::fflush(stdout);
    std::printf(
        "RESULT bench=kvcompd_get case=%s tokens=%llu stored_MB=%.1f stored_get_p50_ms=%.2f "
        "decoded_get_s=%.3f value_err_max=%.4f key_err_max=%.4f budget=%.3f verified=%d\n",
        p.name.c_str(), static_cast<unsigned long long>(a.tokens), p.timing.stored / 1e6,
        Percentile(lat, 0.5) * 1e3, decoded_s, v.value_error_max, v.key_error_max,
        exact ? 0.0 : a.error_budget, ok ? 1 : 0);
  }

  // One line per put: bytes, the client's times, the daemon's stages, and the compression time
  // (its download from a GPU engine apart) against the transfer it saves on a 400 Gb/s link.
  double evict_compress = 0;
  for (const CasePut& p : puts) {
    if (p.name == "evict") evict_compress += p.stages.compress / a.reps;
  }
  std::printf(
      "RESULT bench=kvcompd_calibrate earlier_tokens=%llu calibrate_s=%.3f rank=%u-%u "
      "achieved_error=%.4f budget=%.3f\n",
      static_cast<unsigned long long>(a.calibration_tokens), calibrate_s, rank_min, r.rank,
      r.achieved_error, a.error_budget);
  for (const CasePut& p : puts) {
    const double saved_s = (double(p.timing.bytes) - double(p.timing.stored)) / 50e9;
    std::printf(
        "RESULT bench=kvcompd_put case=%s tokens=%llu rep=%d original_MB=%.1f stored_MB=%.1f "
        "ratio=%.2f put_s=%.3f receive_s=%.3f to_device_s=%.4f compress_s=%.4f "
        "download_s=%.4f encode_s=%.4f store_s=%.3f h2d_MB=%.1f d2h_MB=%.1f "
        "compress_vs_evict_s=%+.4f compress_over_link_saving=%.1f%% with_encode=%.1f%% "
        "with_download=%.1f%%\n",
        p.name.c_str(), static_cast<unsigned long long>(a.tokens), p.rep, p.timing.bytes / 1e6,
        p.timing.stored / 1e6, double(p.timing.bytes) / double(p.timing.stored),
        p.timing.committed_s, p.stages.receive, p.stages.to_device, p.stages.compress,
        p.stages.download, p.stages.encode, p.stages.store, p.stages.h2d_bytes / 1e6,
        p.stages.d2h_bytes / 1e6, p.stages.compress - evict_compress,
        p.stages.compress / saved_s * 100,
        (p.stages.compress + p.stages.encode) / saved_s * 100,
        (p.stages.compress + p.stages.encode + p.stages.download) / saved_s * 100);
  }
  std::printf("daemon_backend: \"%s\"\n",
              d.Log().find("engine: cuda") != std::string::npos ? "cuda" : "cpu");
  if (!all_ok) {
    std::fprintf(stderr, "verification failed (see verified: false above)\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() { return std::string(i + 1 < argc ? argv[++i] : ""); };
    if (s == "--") {
      for (++i; i < argc; ++i) a.flags.push_back(argv[i]);
    } else if (s == "--kvcompd") {
      a.kvcompd = next();
    } else if (s == "--tls") {
      a.tls = next();
    } else if (s == "--tokens") {
      a.tokens = std::stoull(next());
    } else if (s == "--ingest_tokens") {
      a.ingest_tokens = std::stoull(next());
    } else if (s == "--gets") {
      a.gets = std::stoi(next());
    } else if (s == "--window") {
      a.window = std::stoi(next());
    } else if (s == "--clients") {
      a.clients = std::stoi(next());
    } else if (s == "--puts") {
      a.puts = std::stoi(next());
    } else if (s == "--put_tokens") {
      a.put_tokens = std::stoull(next());
    } else if (s == "--kvsplice") {
      a.kvsplice = true;
    } else if (s == "--calibration_tokens") {
      a.calibration_tokens = std::stoull(next());
    } else if (s == "--error_budget") {
      a.error_budget = std::stod(next());
    } else if (s == "--value_codec") {
      a.value_codec = next();
    } else if (s == "--key_codec") {
      a.key_codec = next();
    } else if (s == "--reps") {
      a.reps = std::max(1, std::stoi(next()));
    } else {
      std::fprintf(stderr, "unknown argument %s\n", s.c_str());
      return 2;
    }
  }
  if (a.kvcompd.empty()) {
    std::fprintf(stderr, "usage: kvcompd_bench --kvcompd PATH [...] [-- kvcompd flags]\n");
    return 2;
  }
  kvcomp::testing::TempDir dir;
  std::vector<std::string> flags = {
      "--storage.host_capacity_bytes=16Gi", "--data_plane.max_buffered_bytes=12Gi",
      "--data_plane.ucx_tls=" + a.tls, "--engine.workers=1", "--engine.cpu_threads=0"};
  flags.insert(flags.end(), a.flags.begin(), a.flags.end());
  kvcomp::testing::KvcompdProcess d(a.kvcompd, dir.path() + "/data", flags);
  if (!d.Start(120)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", d.Log().c_str());
    return 1;
  }
  kvcomp::transport::ClientOptions o;
  o.ucx.overrides["TLS"] = a.tls;
  o.request_timeout = absl::Seconds(600);
  auto c = kvcomp::transport::UcxClient::Connect(
      *kvcomp::transport::Endpoint::Parse(d.data_endpoint()), "", "", o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return 1;
  }
  const KvLayout llama{32, 8, 32, 128, DType::kBF16};
  // 1 MiB blocks: K+V of one layer, block_tokens tokens.
  const uint64_t block_tokens = a.block_bytes / (2 * llama.LayerBytes(1));

  std::printf("transport: \"%s\"\nlayout: \"%s\"\nblock_bytes: %llu\nwindow: %d\n", a.tls.c_str(),
              llama.DebugString().c_str(), static_cast<unsigned long long>(a.block_bytes),
              a.window);
  if (a.kvsplice) {
    const int rc = RunKvSplice(a, d, **c, llama, block_tokens);
    c->reset();
    d.Kill(SIGTERM);
    return rc;
  }
  if (a.clients > 0) {
    // Concurrent puts from several clients; the latency tail is the figure.
    const std::vector<Prepared> blocks = PrepareLayerBlocks(llama, a.put_tokens, block_tokens);
    std::vector<std::unique_ptr<kvcomp::transport::UcxClient>> clients;
    for (int i = 0; i < a.clients; ++i) {
      auto ci = kvcomp::transport::UcxClient::Connect(
          *kvcomp::transport::Endpoint::Parse(d.data_endpoint()), "", "", o);
      if (!ci.ok()) {
        std::fprintf(stderr, "connect: %s\n", ci.status().ToString().c_str());
        return 1;
      }
      clients.push_back(std::move(*ci));
    }
    absl::Mutex mu;
    std::vector<double> lat;
    int failed = 0;
    std::string first_error;
    Clock::time_point t0 = Clock::now();
    std::vector<std::thread> threads;
    for (int i = 0; i < a.clients; ++i) {
      threads.emplace_back([&, i] {
        for (int p = 0; p < a.puts; ++p) {
          PutTiming t = SendPut(*clients[i], llama, a.put_tokens, blocks, a.window,
                                "c" + std::to_string(i) + "-" + std::to_string(p));
          absl::MutexLock lock(&mu);
          if (t.ok) {
            lat.push_back(t.committed_s);
          } else {
            ++failed;
            if (first_error.empty()) first_error = t.error;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    const double wall = Since(t0);
    if (lat.empty()) {
      std::fprintf(stderr, "every concurrent put failed: %s\n", first_error.c_str());
      return 1;
    }
    std::printf(
        "concurrent_puts:\n  clients: %d\n  puts_per_client: %d\n  tokens: %llu\n"
        "  bytes_per_put: %llu\n  ok: %zu\n  failed: %d\n  wall_s: %.2f\n  puts_per_s: %.2f\n"
        "  p50_ms: %.1f\n  p99_ms: %.1f\n  max_ms: %.1f\n",
        a.clients, a.puts, static_cast<unsigned long long>(a.put_tokens),
        static_cast<unsigned long long>(llama.CacheBytes(a.put_tokens)), lat.size(), failed, wall,
        lat.size() / wall, Percentile(lat, 0.5) * 1e3, Percentile(lat, 0.99) * 1e3,
        Percentile(lat, 1.0) * 1e3);
    if (!first_error.empty()) std::printf("  first_error: \"%s\"\n", first_error.c_str());
    clients.clear();
    c->reset();
    d.Kill(SIGTERM);
    return 0;
  }
  // Ingest: two warm-up-free puts, each reported.
  std::printf("ingest:\n");
  for (int rep = 0; rep < 2; ++rep) {
    PutTiming t =
        Put(**c, llama, a.ingest_tokens, block_tokens, a.window, "ingest-" + std::to_string(rep));
    if (!t.ok) {
      std::fprintf(stderr, "ingest put failed: %s\n%s\n", t.error.c_str(), d.Log().c_str());
      return 1;
    }
    std::printf(
        "  - tokens: %llu\n    bytes: %llu\n    stored_bytes: %llu\n"
        "    receive_s: %.4f\n    receive_gbps: %.3f\n    put_s: %.4f\n"
        "    put_gbps: %.3f\n",
        static_cast<unsigned long long>(a.ingest_tokens), static_cast<unsigned long long>(t.bytes),
        static_cast<unsigned long long>(t.stored), t.received_s, t.bytes / t.received_s / 1e9,
        t.committed_s, t.bytes / t.committed_s / 1e9);
    std::fflush(stdout);
  }
  // Get latency of a 32K-token cache.
  PutTiming t = Put(**c, llama, a.tokens, block_tokens * 128, a.window, "get-target");
  if (!t.ok) {
    std::fprintf(stderr, "put for gets failed: %s\n", t.error.c_str());
    return 1;
  }
  std::vector<uint8_t> dst(t.stored);
  std::vector<double> lat;
  for (int i = 0; i < a.gets + 1; ++i) {
    Clock::time_point t0 = Clock::now();
    auto n = (*c)->GetInto("meta-llama/Llama-3.1-8B", "get-target", wire::Representation::kStored,
                           dst.data(), dst.size());
    double s = Since(t0);
    if (!n.ok() || *n != t.stored) {
      std::fprintf(stderr, "get failed: %s\n", n.status().ToString().c_str());
      return 1;
    }
    if (i > 0) lat.push_back(s);  // the first get warms up the registration
  }
  std::printf(
      "get:\n  tokens: %llu\n  original_bytes: %llu\n  stored_bytes: %llu\n"
      "  samples: %zu\n  p50_ms: %.2f\n  p99_ms: %.2f\n  min_ms: %.2f\n"
      "  max_ms: %.2f\n  p50_gbps: %.3f\n",
      static_cast<unsigned long long>(a.tokens),
      static_cast<unsigned long long>(llama.CacheBytes(a.tokens)),
      static_cast<unsigned long long>(t.stored), lat.size(), Percentile(lat, 0.5) * 1e3,
      Percentile(lat, 0.99) * 1e3, Percentile(lat, 0.0) * 1e3, Percentile(lat, 1.0) * 1e3,
      t.stored / Percentile(lat, 0.5) / 1e9);
  // Where the daemon spent its time, from its own histograms.
  std::string m = kvcomp::testing::HttpGet(d.ports().metrics, "/metrics").body;
  std::printf("daemon_stage_seconds_sum:\n");
  for (const char* stage :
       {"receive", "to_device", "compress", "download", "encode", "store", "serve"}) {
    std::string series = std::string("kvcomp_stage_duration_seconds_sum{stage=\"") + stage + "\"}";
    std::printf("  %s: %.4f\n", stage, kvcomp::testing::MetricValue(m, series));
  }
  std::printf("daemon_backend: \"%s\"\n",
              d.Log().find("engine: cuda") != std::string::npos ? "cuda" : "cpu");
  c->reset();
  d.Kill(SIGTERM);
  return 0;
}
