// kvcompd's Thrift control plane (every call), tenants and tokens on both planes, and the
// process lifecycle (SIGKILL loses nothing acknowledged, restart serves every cache, SIGTERM
// drains and exits cleanly, SIGHUP reloads tokens). Real daemon processes, UCX over TCP.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "block_put.h"
#include "daemon_fixture.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"
#include "low_rank_put.h"
#include "thrift/transport/TSSLSocket.h"

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;
using transport::UcxClient;

const KvLayout kLayout{2, 2, 4, 64, DType::kF16};
constexpr uint64_t kTokens = 128;

// Puts one random cache as a single block per layer. Returns what the daemon stored.
absl::StatusOr<wire::CacheSummary> PutRandom(UcxClient& c, const std::string& model,
                                             const std::string& key, uint64_t seed) {
  return PutRandomF16(c, MakePutBegin(kLayout, kTokens, model, key), seed);
}

// Values of rank 8 plus a little noise (the same 8 directions for every cache and head), so a
// calibrated rank-32 projection reconstructs them closely. Keys random. Returns the values sent.
absl::StatusOr<wire::CacheSummary> PutLowRank(UcxClient& c, const std::string& model,
                                              const std::string& key, uint64_t seed,
                                              std::vector<float>* sent_values = nullptr) {
  return PutLowRankCache(c, MakePutBegin(kLayout, kTokens, model, key), seed, sent_values);
}

class ControlTest : public DaemonFixture {};

TEST_F(ControlTest, EveryControlCallAnswers) {
  auto d = StartDaemon();
  absl::Status error;
  auto c = Connect(*d, "", "", &error);
  ASSERT_NE(c, nullptr) << error << d->Log();
  auto stored = PutRandom(*c, "llama", "k1", 1);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ControlClient rpc(d->ports().control);
  const rpc::Auth auth = MakeAuth("", "");

  rpc::HealthResponse health;
  rpc->Health(health, auth);
  EXPECT_EQ(health.status.code, rpc::StatusCode::OK);
  EXPECT_TRUE(health.live);
  EXPECT_TRUE(health.ready);
  EXPECT_FALSE(health.draining);

  rpc::ServerInfoResponse info;
  rpc->ServerInfo(info, auth);
  EXPECT_EQ(info.status.code, rpc::StatusCode::OK);
  EXPECT_FALSE(info.multi_tenant);
  EXPECT_EQ(info.data_address, d->data_endpoint());
  EXPECT_EQ(info.metrics_port, d->ports().metrics);
  EXPECT_EQ(info.durability, "disk");
  EXPECT_NE(info.backend.find(ExpectedBackend()), std::string::npos) << info.backend;
  EXPECT_EQ(info.data_protocol_version, 1);

  rpc::CacheRef ref;
  ref.model_id = "llama";
  ref.key = "k1";
  rpc::LookupResponse look;
  rpc->Lookup(look, auth, ref);
  EXPECT_EQ(look.status.code, rpc::StatusCode::OK) << look.status.message;
  EXPECT_EQ(look.stored_bytes, static_cast<int64_t>(stored->stored_bytes));
  EXPECT_EQ(look.original_bytes, static_cast<int64_t>(kLayout.CacheBytes(kTokens)));
  EXPECT_EQ(look.original_tokens, static_cast<int64_t>(kTokens));
  EXPECT_EQ(look.kept_tokens, static_cast<int64_t>(stored->total_kept));
  EXPECT_EQ(look.layout.num_layers, 2);
  EXPECT_EQ(look.layout.dtype, "f16");
  EXPECT_EQ(look.tier, ExpectedPutTier());

  rpc::StatsResponse stats;
  rpc->Stats(stats, auth);
  EXPECT_EQ(stats.status.code, rpc::StatusCode::OK);
  EXPECT_EQ(stats.caches, 1);
  EXPECT_EQ(stats.stored_bytes, static_cast<int64_t>(stored->stored_bytes));
  EXPECT_EQ(stats.puts_total, 1);
  EXPECT_FALSE(stats.tiers.empty());

  rpc::ListResponse list;
  rpc->List(list, auth, "", "", 10);
  EXPECT_EQ(list.status.code, rpc::StatusCode::OK);
  ASSERT_EQ(list.caches.size(), 1u);
  EXPECT_EQ(list.caches[0].key, "k1");
  EXPECT_TRUE(list.next_cursor.empty());
  // Paging: two more caches, listed one at a time.
  ASSERT_TRUE(PutRandom(*c, "other", "k0", 3).ok());
  ASSERT_TRUE(PutRandom(*c, "llama", "k3", 4).ok());
  std::vector<std::string> seen;
  std::string cursor;
  for (int page = 0; page < 5; ++page) {
    rpc->List(list, auth, "", cursor, 1);
    for (const auto& r : list.caches) seen.push_back(r.model_id + "/" + r.key);
    cursor = list.next_cursor;
    if (cursor.empty()) break;
  }
  EXPECT_EQ(seen.size(), 3u);
  rpc->List(list, auth, "llama", "", 10);
  EXPECT_EQ(list.caches.size(), 2u);  // model filter
  rpc::DeleteResponse cleanup;
  for (auto [model, key] : {std::pair<std::string, std::string>{"other", "k0"}, {"llama", "k3"}}) {
    rpc::CacheRef r;
    r.model_id = model;
    r.key = key;
    rpc->Delete(cleanup, auth, r);
    EXPECT_EQ(cleanup.status.code, rpc::StatusCode::OK);
  }

  rpc::PolicyResponse pol;
  rpc->GetPolicy(pol, auth, "llama");
  EXPECT_EQ(pol.status.code, rpc::StatusCode::OK);
  EXPECT_TRUE(pol.is_default);
  EXPECT_EQ(pol.policy.scorer, "manifold");
  rpc::Policy p = pol.policy;
  p.scorer = "knorm";
  p.ratio = 0.75;
  rpc->SetPolicy(pol, auth, "llama", p);
  EXPECT_EQ(pol.status.code, rpc::StatusCode::OK) << pol.status.message;
  rpc->GetPolicy(pol, auth, "llama");
  EXPECT_FALSE(pol.is_default);
  EXPECT_EQ(pol.policy.scorer, "knorm");
  EXPECT_EQ(pol.policy.ratio, 0.75);
  rpc->GetPolicy(pol, auth, "other-model");
  EXPECT_TRUE(pol.is_default);
  // The stored policy applies to the next put of that model: 0.75 evicted -> 32 of 128 kept.
  auto second = PutRandom(*c, "llama", "k2", 2);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->total_kept, kLayout.num_heads_total() * 32);
  // A bad policy is refused with a clear status.
  p.ratio = 1.5;
  rpc->SetPolicy(pol, auth, "llama", p);
  EXPECT_EQ(pol.status.code, rpc::StatusCode::INVALID_ARGUMENT);
  p.ratio = 0.5;
  p.scorer = "no-such-scorer";
  rpc->SetPolicy(pol, auth, "llama", p);
  EXPECT_EQ(pol.status.code, rpc::StatusCode::INVALID_ARGUMENT);
  // recent_fraction travels both ways and is range-checked.
  p.scorer = "knorm";
  p.ratio = 0.75;
  p.recent_fraction = 1.0;
  rpc->SetPolicy(pol, auth, "llama", p);
  EXPECT_EQ(pol.status.code, rpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(pol.status.message.find("recent_fraction"), std::string::npos) << pol.status.message;
  p.recent_fraction = 0.5;
  rpc->SetPolicy(pol, auth, "llama", p);
  EXPECT_EQ(pol.status.code, rpc::StatusCode::OK) << pol.status.message;
  rpc->GetPolicy(pol, auth, "llama");
  EXPECT_EQ(pol.policy.recent_fraction, 0.5);

  // Calibrate (details in CalibrateThenEncodedPutsAndDecodedGets): an unknown model has no
  // caches to learn from; a known one calibrates.
  rpc::CalibrateRequest cal;
  cal.model_id = "no-such-model";
  cal.rank = 16;
  rpc::CalibrateResponse calr;
  rpc->Calibrate(calr, auth, cal);
  EXPECT_EQ(calr.status.code, rpc::StatusCode::FAILED_PRECONDITION) << calr.status.message;
  cal.model_id = "llama";
  rpc->Calibrate(calr, auth, cal);
  EXPECT_EQ(calr.status.code, rpc::StatusCode::OK) << calr.status.message;
  EXPECT_EQ(calr.rank, 16);
  cal.value_codec = "bogus";
  rpc->Calibrate(calr, auth, cal);
  EXPECT_EQ(calr.status.code, rpc::StatusCode::INVALID_ARGUMENT);

  rpc::DeleteResponse del;
  rpc->Delete(del, auth, ref);
  EXPECT_EQ(del.status.code, rpc::StatusCode::OK);
  rpc->Delete(del, auth, ref);
  EXPECT_EQ(del.status.code, rpc::StatusCode::NOT_FOUND);
  rpc->Lookup(look, auth, ref);
  EXPECT_EQ(look.status.code, rpc::StatusCode::NOT_FOUND);

  // Policies survive a restart.
  c.reset();
  EXPECT_EQ(WEXITSTATUS(d->Kill(SIGTERM)), 0);
  d = StartDaemon();
  ControlClient rpc2(d->ports().control);
  rpc2->GetPolicy(pol, auth, "llama");
  EXPECT_EQ(pol.policy.scorer, "knorm");
}

TEST_F(ControlTest, CalibrateThenEncodedPutsAndDecodedGets) {
  auto d = StartDaemon();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  ControlClient rpc(d->ports().control);
  const rpc::Auth auth = MakeAuth("", "");
  rpc::PolicyResponse pol;
  rpc->GetPolicy(pol, auth, "splice");
  rpc::Policy p = pol.policy;
  p.value_codec = "orthogonal_int8";
  p.rank = 32;
  // Calibration needs stored caches with raw values first.
  rpc::CalibrateRequest cal;
  cal.model_id = "splice";
  cal.value_codec = "orthogonal_int8";
  cal.rank = 32;
  rpc::CalibrateResponse calr;
  rpc->Calibrate(calr, auth, cal);
  EXPECT_EQ(calr.status.code, rpc::StatusCode::FAILED_PRECONDITION) << calr.status.message;
  // An encoded policy without a projection is refused at put-begin, clearly.
  rpc->SetPolicy(pol, auth, "splice", p);
  ASSERT_EQ(pol.status.code, rpc::StatusCode::OK) << pol.status.message;
  absl::StatusOr<wire::CacheSummary> early = PutLowRank(*c, "splice", "early", 1);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  // Raw caches of the model to calibrate on, then calibrate.
  p.value_codec = "none";
  p.rank = 0;
  rpc->SetPolicy(pol, auth, "splice", p);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(PutLowRank(*c, "splice", "raw" + std::to_string(i), 10 + i).ok());
  }
  rpc->Calibrate(calr, auth, cal);
  ASSERT_EQ(calr.status.code, rpc::StatusCode::OK) << calr.status.message;
  EXPECT_NE(calr.projection_version, 0);
  EXPECT_EQ(calr.rank, 32);
  EXPECT_EQ(calr.caches_used, 3);
  // Encoded puts now work and store fewer bytes than the raw ones.
  p.value_codec = "orthogonal_int8";
  p.rank = 32;
  rpc->SetPolicy(pol, auth, "splice", p);
  std::vector<float> sent;
  auto raw = c->Lookup("splice", "raw0");
  auto enc = PutLowRank(*c, "splice", "encoded", 99, &sent);
  ASSERT_TRUE(enc.ok()) << enc.status();
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(enc->value_codec, ValueCodec::kOrthogonalInt8);
  EXPECT_LT(enc->stored_bytes, raw->stored_bytes);
  // A decoded get returns raw codecs; the values come back close to those sent.
  auto got = c->Get("splice", "encoded", wire::Representation::kDecoded);
  ASSERT_TRUE(got.ok()) << got.status();
  auto cache = format::ParseCache(got->bytes.view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->value_codec, ValueCodec::kRaw);
  EXPECT_EQ(cache->total_kept(), enc->total_kept);
  double err = 0, norm = 0;
  auto offsets = cache->TokenOffsets();
  for (uint32_t l = 0; l < kLayout.num_layers; ++l) {
    for (uint32_t h = 0; h < kLayout.num_kv_heads; ++h) {
      uint64_t head = cache->head_index(l, h);
      for (uint64_t i = offsets[head]; i < offsets[head + 1]; ++i) {
        for (uint32_t j = 0; j < kLayout.head_dim; ++j) {
          float got_v = LoadAsFloat(cache->values.data(), DType::kF16, i * kLayout.head_dim + j);
          size_t at = ((uint64_t{l} * kLayout.num_kv_heads + h) * kTokens + cache->positions[i]) *
                          kLayout.head_dim +
                      j;
          err += (got_v - sent[at]) * (got_v - sent[at]);
          norm += sent[at] * sent[at];
        }
      }
    }
  }
  EXPECT_LT(std::sqrt(err / norm), 0.05);
  // The stored form is the encoded one.
  auto stored = c->Get("splice", "encoded");
  ASSERT_TRUE(stored.ok());
  EXPECT_EQ(stored->bytes.size(), enc->stored_bytes);
}

TEST_F(ControlTest, LongLivedThriftConnectionCarriesWellOver100MB) {
  // Debian's Thrift 0.17 threaded server drops such connections after about 100 MB; the
  // nonblocking server kvcompd runs must not.
  auto d = StartDaemon();
  ControlClient rpc(d->ports().control);
  const rpc::Auth auth = MakeAuth("", "");
  rpc::CacheRef ref;
  ref.model_id = "m";
  ref.key = std::string(1 << 20, 'k');  // 1 MiB per request: refused as too long, after reading
  rpc::LookupResponse look;
  for (int i = 0; i < 160; ++i) {
    rpc->Lookup(look, auth, ref);
    ASSERT_EQ(look.status.code, rpc::StatusCode::INVALID_ARGUMENT) << i;
  }
  rpc::HealthResponse health;
  rpc->Health(health, auth);
  EXPECT_EQ(health.status.code, rpc::StatusCode::OK);
  EXPECT_TRUE(health.live);
}

TEST_F(ControlTest, TenantsSeeOnlyTheirOwnCaches) {
  WriteTokens("alpha: secret-a\nbeta: secret-b\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path()});
  EXPECT_NE(d->Log().find("multi-tenant"), std::string::npos);
  absl::Status error;
  EXPECT_EQ(Connect(*d, "alpha", "wrong", &error), nullptr);
  EXPECT_EQ(error.code(), absl::StatusCode::kUnauthenticated) << error;
  EXPECT_EQ(Connect(*d, "alpha", "", &error), nullptr);
  EXPECT_EQ(error.code(), absl::StatusCode::kUnauthenticated) << error;
  EXPECT_EQ(Connect(*d, "gamma", "secret-a", &error), nullptr);
  EXPECT_EQ(error.code(), absl::StatusCode::kUnauthenticated) << error;

  auto a = Connect(*d, "alpha", "secret-a");
  auto b = Connect(*d, "beta", "secret-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(PutRandom(*a, "m", "shared-name", 1).ok());
  ASSERT_TRUE(a->Get("m", "shared-name").ok());
  // beta reads alpha's key exactly as a key that does not exist.
  absl::Status other = b->Get("m", "shared-name").status();
  absl::Status missing = b->Get("m", "never-stored").status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(other, missing);
  EXPECT_EQ(b->Lookup("m", "shared-name").status(), b->Lookup("m", "never-stored").status());
  EXPECT_EQ(b->Delete("m", "shared-name"), b->Delete("m", "never-stored"));
  ASSERT_TRUE(a->Get("m", "shared-name").ok());  // beta's delete did nothing
  // beta may use the same name for its own cache.
  ASSERT_TRUE(PutRandom(*b, "m", "shared-name", 2).ok());
  auto ga = a->Get("m", "shared-name");
  auto gb = b->Get("m", "shared-name");
  ASSERT_TRUE(ga.ok() && gb.ok());
  EXPECT_NE(ga->bytes.view(), gb->bytes.view());

  ControlClient rpc(d->ports().control);
  rpc::StatsResponse stats;
  rpc->Stats(stats, MakeAuth("alpha", "bad"));
  EXPECT_EQ(stats.status.code, rpc::StatusCode::UNAUTHENTICATED);
  rpc->Stats(stats, MakeAuth("", ""));
  EXPECT_EQ(stats.status.code, rpc::StatusCode::UNAUTHENTICATED);
  rpc->Stats(stats, MakeAuth("alpha", "secret-a"));
  EXPECT_EQ(stats.status.code, rpc::StatusCode::OK);
  EXPECT_EQ(stats.caches, 1);
  rpc::ListResponse list;
  rpc->List(list, MakeAuth("beta", "secret-b"), "", "", 100);
  ASSERT_EQ(list.caches.size(), 1u);
  rpc::CacheRef ref;
  ref.model_id = "m";
  ref.key = "shared-name";
  rpc::DeleteResponse del;
  rpc->Delete(del, MakeAuth("beta", "secret-b"), ref);
  EXPECT_EQ(del.status.code, rpc::StatusCode::OK);
  EXPECT_TRUE(a->Get("m", "shared-name").ok());  // only beta's went

  std::string m = HttpGet(d->ports().metrics, "/metrics").body;
  EXPECT_EQ(MetricValue(m, "kvcomp_auth_failures_total{plane=\"data\"}"), 3);
  EXPECT_EQ(MetricValue(m, "kvcomp_auth_failures_total{plane=\"control\"}"), 2);

  // Tokens reload on SIGHUP (and on mtime change): gamma appears, beta's token changes.
  WriteTokens("alpha: secret-a\nbeta: new-b\ngamma: secret-g\n");
  d->Signal(SIGHUP);
  std::unique_ptr<UcxClient> g;
  for (int i = 0; i < 50 && g == nullptr; ++i) {
    g = Connect(*d, "gamma", "secret-g", &error);
    if (g == nullptr) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_NE(g, nullptr) << d->Log();
  EXPECT_EQ(Connect(*d, "beta", "secret-b", &error), nullptr);
  EXPECT_NE(Connect(*d, "beta", "new-b"), nullptr);
  // A broken token file keeps the previous tokens.
  WriteTokens("alpha: [not, a, token]\n");
  d->Signal(SIGHUP);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_NE(Connect(*d, "alpha", "secret-a"), nullptr);
  EXPECT_NE(d->Log().find("token reload failed"), std::string::npos);
  // Without a signal, a changed file is picked up by its modification time
  // (auth.reload_interval_seconds is 0.2 in these tests).
  WriteTokens("alpha: secret-a\ndelta: secret-d\n");
  std::unique_ptr<UcxClient> delta;
  for (int i = 0; i < 50 && delta == nullptr; ++i) {
    delta = Connect(*d, "delta", "secret-d", &error);
    if (delta == nullptr) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_NE(delta, nullptr) << d->Log();
}

TEST_F(ControlTest, OpenModeSaysSoAtStart) {
  auto d = StartDaemon();
  EXPECT_NE(d->Log().find("OPEN single-tenant mode"), std::string::npos) << d->Log();
  // Any credentials act as tenant "default".
  auto c = Connect(*d, "whoever", "whatever");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->server_info().tenant, "default");
}

TEST_F(ControlTest, SigkillLosesNothingAcknowledgedAndRestartServesEverything) {
  auto d = StartDaemon();
  std::map<std::string, std::string> acked;
  {
    auto c = Connect(*d);
    ASSERT_NE(c, nullptr);
    for (int i = 0; i < 6; ++i) {
      std::string key = "k" + std::to_string(i);
      ASSERT_TRUE(PutRandom(*c, "m", key, 10 + i).ok());
      auto got = c->Get("m", key);
      ASSERT_TRUE(got.ok());
      acked[key] = std::string(got->bytes.view());
    }
    // A put left half-sent when the process dies must not appear after the restart.
    wire::PutBegin half;
    half.layout = kLayout;
    half.num_tokens = kTokens;
    half.model_id = "m";
    half.key = "half";
    ASSERT_TRUE(c->PutBegin(half).ok());
  }
  d->Kill(SIGKILL);
  d = StartDaemon();
  EXPECT_NE(d->Log().find("6 cache(s) recovered"), std::string::npos) << d->Log();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  for (const auto& [key, bytes] : acked) {
    auto got = c->Get("m", key);
    ASSERT_TRUE(got.ok()) << key << ": " << got.status();
    EXPECT_EQ(got->bytes.view(), bytes) << key;
  }
  EXPECT_EQ(c->Lookup("m", "half").status().code(), absl::StatusCode::kNotFound);
  std::string m;
  for (int i = 0; i < 30; ++i) {
    m = HttpGet(d->ports().metrics, "/metrics").body;
    if (MetricValue(m, "kvcomp_caches_stored") == 6) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(MetricValue(m, "kvcomp_caches_stored"), 6);
}

TEST_F(ControlTest, SigtermDrainsThenExitsCleanly) {
  auto d = StartDaemon();
  EXPECT_EQ(HttpGet(d->ports().metrics, "/readyz").code, 200);
  EXPECT_EQ(HttpGet(d->ports().metrics, "/healthz").code, 200);
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(PutRandom(*c, "m", "before", 1).ok());
  c.reset();
  EXPECT_EQ(WEXITSTATUS(d->Kill(SIGTERM)), 0);
  EXPECT_NE(d->Log().find("draining"), std::string::npos);
  EXPECT_NE(d->Log().find("stopped"), std::string::npos);
  d = StartDaemon();
  c = Connect(*d);
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(c->Get("m", "before").ok());
}

TEST_F(ControlTest, SigtermFinishesInFlightPutsAndRefusesNewOnes) {
  auto d = StartDaemon();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  wire::PutBegin begin;
  begin.layout = kLayout;
  begin.num_tokens = kTokens;
  begin.model_id = "m";
  begin.key = "in-flight";
  auto id = c->PutBegin(begin);
  ASSERT_TRUE(id.ok());
  const size_t count = uint64_t{kLayout.num_kv_heads} * kTokens * kLayout.head_dim;
  std::vector<uint16_t> k(count, FloatToHalf(0.5f)), v(count, FloatToHalf(-0.25f));
  for (size_t i = 0; i < count; ++i) k[i] = FloatToHalf(static_cast<float>(i % 97) / 97.0f);
  wire::Block b;
  b.put_id = *id;
  b.layer_end = 1;
  b.token_end = kTokens;
  b.key_bytes = b.value_bytes = kLayout.LayerBytes(kTokens);
  ASSERT_TRUE(c->SendBlock(b, k.data(), v.data()).ok());

  d->Signal(SIGTERM);
  int code = 0;
  for (int i = 0; i < 100 && code != 503; ++i) {
    code = HttpGet(d->ports().metrics, "/readyz").code;
    if (code != 503) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(code, 503);
  EXPECT_EQ(HttpGet(d->ports().metrics, "/healthz").code, 200);
  // New puts are refused while draining; the open one completes.
  begin.key = "too-late";
  EXPECT_EQ(c->PutBegin(begin).status().code(), absl::StatusCode::kUnavailable);
  b.layer_begin = 1;
  b.layer_end = 2;
  ASSERT_TRUE(c->SendBlock(b, k.data(), v.data()).ok());
  auto summary = c->PutCommit(*id, 2);
  ASSERT_TRUE(summary.ok()) << summary.status();
  c.reset();
  int status = d->Kill(SIGTERM);  // already stopping: waits for the exit
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << d->Log();
  d = StartDaemon();
  c = Connect(*d);
  ASSERT_NE(c, nullptr);
  auto got = c->Lookup("m", "in-flight");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->stored_bytes, summary->stored_bytes);
  EXPECT_EQ(c->Lookup("m", "too-late").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ControlTest, ConfigurationCommandLine) {
  // --print-config emits YAML that --config accepts; unknown keys and bad values stop the start.
  std::string yaml = dir_.path() + "/effective.yaml";
  std::string cmd = std::string(KVCOMPD_PATH) + " --print-config --engine.workers=3 > " + yaml;
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(yaml);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find("workers: 3"), std::string::npos) << ss.str();
  cmd = std::string(KVCOMPD_PATH) + " --config " + yaml + " --print-config > /dev/null";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  cmd = "KVCOMP_ENGINE_WORKERS=5 " + std::string(KVCOMPD_PATH) + " --config " + yaml +
        " --print-config | grep -q 'workers: 5'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  std::ofstream(dir_.path() + "/bad.yaml") << "storage:\n  no_such_key: 1\n";
  cmd = std::string(KVCOMPD_PATH) + " --config " + dir_.path() + "/bad.yaml 2>/dev/null";
  EXPECT_EQ(WEXITSTATUS(std::system(cmd.c_str())), 2);
  cmd = std::string(KVCOMPD_PATH) + " --storage.durability=sometimes 2>/dev/null";
  EXPECT_EQ(WEXITSTATUS(std::system(cmd.c_str())), 2);
  cmd = std::string(KVCOMPD_PATH) + " --help | grep -q -- --storage.host_capacity_bytes";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  // The policy's recent fraction: flag, environment and YAML; [0, 1) or exit code 2.
  cmd = std::string(KVCOMPD_PATH) +
        " --default_policy.recent_fraction=0.5 --print-config | grep -q 'recent_fraction: 0.5'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  cmd = "KVCOMP_DEFAULT_POLICY_RECENT_FRACTION=0.25 " + std::string(KVCOMPD_PATH) +
        " --print-config | grep -q 'recent_fraction: 0.25'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  std::ofstream(dir_.path() + "/recent.yaml") << "default_policy:\n  recent_fraction: 0.75\n";
  cmd = std::string(KVCOMPD_PATH) + " --config " + dir_.path() +
        "/recent.yaml --print-config | grep -q 'recent_fraction: 0.75'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  cmd = std::string(KVCOMPD_PATH) + " --default_policy.recent_fraction=1 2>/dev/null";
  EXPECT_EQ(WEXITSTATUS(std::system(cmd.c_str())), 2);
  cmd = std::string(KVCOMPD_PATH) + " --default_policy.recent_fraction=-0.5 2>/dev/null";
  EXPECT_EQ(WEXITSTATUS(std::system(cmd.c_str())), 2);
  // A string option with a control character (here a carriage return that YAML folds into a
  // plain scalar continued on the next line) stops the start with the key named.
  std::ofstream(dir_.path() + "/cr.yaml") << "auth:\n  token_file: /etc/kvcomp/tokens\n   info\r";
  cmd = std::string(KVCOMPD_PATH) + " --config " + dir_.path() +
        "/cr.yaml 2>&1 | grep -q 'token_file.*control character'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  cmd = std::string(KVCOMPD_PATH) + " --config " + dir_.path() + "/cr.yaml >/dev/null 2>&1";
  EXPECT_EQ(WEXITSTATUS(std::system(cmd.c_str())), 2);
}

TEST_F(ControlTest, ThriftOverTls) {
  const std::string cert = dir_.path() + "/cert.pem", key = dir_.path() + "/key.pem";
  std::string cmd =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
      "-keyout " +
      key + " -out " + cert + " >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "openssl CLI not available";
  auto d = StartDaemon({"--control_plane.tls=true", "--control_plane.tls_cert_file=" + cert,
                        "--control_plane.tls_key_file=" + key});
  auto factory = std::make_shared<apache::thrift::transport::TSSLSocketFactory>();
  factory->loadTrustedCertificates(cert.c_str());
  factory->authenticate(true);
  auto socket = factory->createSocket("localhost", d->ports().control);
  auto transport = std::make_shared<apache::thrift::transport::TFramedTransport>(socket);
  auto protocol = std::make_shared<apache::thrift::protocol::TBinaryProtocol>(transport);
  rpc::KvcompControlClient client(protocol);
  transport->open();
  rpc::HealthResponse health;
  client.Health(health, MakeAuth("", ""));
  EXPECT_EQ(health.status.code, rpc::StatusCode::OK);
  EXPECT_TRUE(health.ready);
  transport->close();
  // A plain-TCP client gets nothing useful from the TLS port.
  EXPECT_THROW(
      {
        ControlClient plain(d->ports().control);
        plain->Health(health, MakeAuth("", ""));
      },
      apache::thrift::TException);
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
