// The policy's mappings in kvcompd, all generated from its one declaration
// (kvcomp/core/policy_fields.def): the Thrift Policy struct (both ways, every field), the
// default_policy.* configuration rows, and the per-tenant policies file (exact doubles across a
// restart).
#include <cstdio>
#include <limits>
#include <string>
#include <unistd.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/policy_test_util.h"
#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/core/policy_fields.h"
#include "kvcomp/core/policy_presets.h"
#include "kvcomp/core/status.h"
#include "kvcomp/service/config.h"
#include "kvcomp/service/policy_store.h"
#include "policy_rpc.h"

namespace kvcomp {
namespace service {
namespace {

// Every declared field away from its default, and a ratio whose shortest text needs 15 digits.
CompressionPolicy AllChanged() {
  CompressionPolicy p = testing::EveryFieldChanged();
  p.ratio = 0.123456789012345;
  p.recent_fraction = 1.0 / 3.0;
  p.seed = 0x1122334455667788ull;
  return p;
}

TEST(PolicyMapping, ThriftCarriesEveryFieldBothWays) {
  const CompressionPolicy p = AllChanged();
  for (const PolicyFieldInfo& f : PolicyFields()) {
    ASSERT_NE(f.text(p), f.default_text) << f.name << ": AllChanged() leaves it at its default";
  }
  auto back = PolicyFromRpc(PolicyToRpc(p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, p);
  // An rpc::Policy as Thrift constructs it (the IDL's defaults: what a client that sets no field,
  // or an older client without a field, sends) is the policy of absent fields, which keeps what
  // such a client meant where a default changed since (recent_fraction 0, not the default).
  auto unset = PolicyFromRpc(rpc::Policy());
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_EQ(*unset, AbsentFieldPolicy());
  EXPECT_EQ(unset->recent_fraction, 0.0);
  EXPECT_TRUE(unset->moments);
  // A new client sends every field: the default policy arrives as the default policy.
  auto defaults = PolicyFromRpc(PolicyToRpc(CompressionPolicy()));
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(*defaults, CompressionPolicy());
  EXPECT_NE(defaults->recent_fraction, unset->recent_fraction);
  EXPECT_NE(defaults->moments, unset->moments);
}

TEST(PolicyMapping, ThriftCarriesEverySeedAsItsBitPattern) {
  for (uint64_t seed : {uint64_t{0}, uint64_t{1} << 63, std::numeric_limits<uint64_t>::max(),
                        uint64_t{0xfedcba9876543210ull}}) {
    CompressionPolicy p;
    p.seed = seed;
    const rpc::Policy r = PolicyToRpc(p);
    EXPECT_EQ(static_cast<uint64_t>(r.seed), seed);
    auto back = PolicyFromRpc(r);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->seed, seed);
  }
  rpc::Policy r;
  r.seed = -5;  // a client that wrote 2^64 - 5 through an i64
  auto p = PolicyFromRpc(r);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->seed, std::numeric_limits<uint64_t>::max() - 4);
}

TEST(PolicyMapping, ThriftValuesOutsideTheirFieldAreRefusedNamingIt) {
  struct Case {
    const char* field;
    void (*set)(rpc::Policy&);
    const char* says;
  };
  const Case cases[] = {
      {"n_sink", [](rpc::Policy& r) { r.n_sink = -1; }, "outside [0, 4294967295]"},
      {"window", [](rpc::Policy& r) { r.window = int64_t{1} << 32; }, "outside [0, 4294967295]"},
      {"window", [](rpc::Policy& r) { r.window = 0; }, "at least 1"},
      {"ratio", [](rpc::Policy& r) { r.ratio = 1.0; }, "[0, 1)"},
      {"recent_fraction", [](rpc::Policy& r) { r.recent_fraction = -0.5; }, "[0, 1)"},
      {"rank", [](rpc::Policy& r) { r.value_codec = "orthogonal"; r.rank = 300; }, "[0, 256]"},
      {"scorer", [](rpc::Policy& r) { r.scorer = "best"; }, "expected one of"},
      {"key_codec", [](rpc::Policy& r) { r.key_codec = "int3"; }, "expected one of"},
      {"snapkv_pool", [](rpc::Policy& r) { r.snapkv_pool = 4; }, "odd"},
  };
  for (const Case& c : cases) {
    rpc::Policy r;
    c.set(r);
    auto p = PolicyFromRpc(r);
    ASSERT_FALSE(p.ok()) << c.field;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_TRUE(absl::StrContains(p.status().message(), c.field)) << p.status();
    EXPECT_TRUE(absl::StrContains(p.status().message(), c.says)) << p.status();
  }
}

TEST(PolicyMapping, ConfigurationHasOneRowPerDeclaredField) {
  size_t rows = 0;
  for (const ConfigField& f : ConfigFields()) {
    if (!absl::StartsWith(f.key, "default_policy.")) continue;
    if (f.key == "default_policy.preset") continue;  // a preset, not a field (next test)
    const PolicyFieldInfo* pf = FindPolicyField(f.key.substr(15));
    ASSERT_NE(pf, nullptr) << f.key;
    EXPECT_EQ(f.type, pf->unit);
    EXPECT_EQ(f.help, pf->Help());
    ++rows;
  }
  EXPECT_EQ(rows, PolicyFields().size());
  // Every field through the table's text form, as YAML, flags and environment set it.
  const CompressionPolicy p = AllChanged();
  Options o;
  for (const PolicyFieldInfo& f : PolicyFields()) {
    ASSERT_TRUE(SetOption(o, absl::StrCat("default_policy.", f.name), f.text(p)).ok()) << f.name;
  }
  EXPECT_EQ(o.default_policy, p);
  const absl::Status bad = SetOption(o, "default_policy.ratio", "1");
  EXPECT_TRUE(absl::StrContains(bad.message(), "default_policy.ratio")) << bad;
}

// default_policy.preset: the named preset, with the field keys over it whatever their order or
// source; an unknown name is refused naming the key; the printed configuration reads back.
TEST(PolicyMapping, PresetKeyIsTheBaseTheFieldKeysOverride) {
  for (const std::string& name : PolicyPresetNames()) {
    Options o;
    ASSERT_TRUE(SetOption(o, "default_policy.preset", name).ok()) << name;
    EXPECT_EQ(o.default_policy, *PolicyPreset(name)) << name;
  }
  CompressionPolicy want = *PolicyPreset("balanced");
  want.ratio = 0.6;
  {  // field first, preset after (a YAML map in this order, or a preset from the environment)
    Options o;
    ASSERT_TRUE(SetOption(o, "default_policy.ratio", "0.6").ok());
    ASSERT_TRUE(SetOption(o, "default_policy.preset", "balanced").ok());
    EXPECT_EQ(o.default_policy, want);
  }
  {  // preset first, field after
    Options o;
    ASSERT_TRUE(ApplyYaml(o, "default_policy:\n  preset: balanced\n  ratio: 0.6\n").ok());
    EXPECT_EQ(o.default_policy, want);
    EXPECT_EQ(o.default_policy_preset, "balanced");
    Options back;
    ASSERT_TRUE(ApplyYaml(back, OptionsToYaml(o)).ok());
    EXPECT_EQ(back.default_policy, want);
    // an empty preset goes back to the field defaults, keeping the fields given
    ASSERT_TRUE(SetOption(o, "default_policy.preset", "").ok());
    CompressionPolicy plain;
    plain.ratio = 0.6;
    EXPECT_EQ(o.default_policy, plain);
  }
  Options o;
  const absl::Status bad = SetOption(o, "default_policy.preset", "fastest");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.message(), "default_policy.preset")) << bad;
  EXPECT_TRUE(absl::StrContains(bad.message(), "balanced")) << bad;  // names the choices
}

// A daemon without default_policy keys serves the default policy (the new defaults), an
// explicit key still sets the old value, and a policies-log record written before a field
// existed (or before its default changed) keeps what its writer meant: the field's absent value.
TEST(PolicyMapping, NewDefaultsForConfigurationOldMeaningForStoredRecords) {
  Options o;
  EXPECT_EQ(o.default_policy, CompressionPolicy());
  ASSERT_TRUE(ApplyYaml(o, "default_policy:\n  ratio: 0.6\n").ok());
  EXPECT_EQ(o.default_policy.recent_fraction, CompressionPolicy().recent_fraction);
  ASSERT_TRUE(SetOption(o, "default_policy.recent_fraction", "0").ok());
  EXPECT_EQ(o.default_policy.recent_fraction, 0.0);

  char dir[] = "/tmp/kvcomp-policy-store-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/policies.yaml";
  CompressionPolicy p;
  p.ratio = 0.7;
  {
    auto store = PolicyStore::Open(path, CompressionPolicy());
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Set("t", "m", p).ok());
  }
  // Rewrite the record as a writer from before recent_fraction wrote it: no such key.
  std::string log;
  {
    FILE* f = std::fopen((path + ".log").c_str(), "rb");
    ASSERT_NE(f, nullptr);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) log.append(buf, n);
    std::fclose(f);
  }
  const size_t tab = log.rfind('\t');
  ASSERT_NE(tab, std::string::npos);
  std::string yaml;
  ASSERT_TRUE(absl::CUnescape(log.substr(tab + 1, log.size() - tab - 2), &yaml));
  for (const char* name : {"recent_fraction:", "moments:"}) {
    const size_t key = yaml.find(name);
    ASSERT_NE(key, std::string::npos) << yaml;
    yaml.erase(key, yaml.find('\n', key) + 1 - key);
  }
  const std::string body = absl::StrCat(log.substr(9, tab - 9 + 1), absl::CEscape(yaml));
  {
    FILE* f = std::fopen((path + ".log").c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const std::string line = absl::StrCat(
        absl::StrFormat("%08x", Crc32c(body.data(), body.size())), " ", body, "\n");
    ASSERT_EQ(std::fwrite(line.data(), 1, line.size(), f), line.size());
    std::fclose(f);
  }
  auto store = PolicyStore::Open(path, CompressionPolicy());
  ASSERT_TRUE(store.ok()) << store.status();
  auto [got, is_default] = (*store)->Resolve("t", "m");
  EXPECT_FALSE(is_default);
  CompressionPolicy want = p;
  want.recent_fraction = AbsentFieldPolicy().recent_fraction;
  want.moments = AbsentFieldPolicy().moments;
  EXPECT_EQ(got, want) << got.DebugString();
  EXPECT_EQ(got.recent_fraction, 0.0);
  EXPECT_TRUE(got.moments);
  std::remove(path.c_str());
  std::remove((path + ".log").c_str());
  rmdir(dir);
}

TEST(PolicyMapping, PoliciesFileKeepsEveryFieldExactlyAcrossARestart) {
  char dir[] = "/tmp/kvcomp-policy-store-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/policies.yaml";
  const CompressionPolicy p = AllChanged();
  {
    auto store = PolicyStore::Open(path, CompressionPolicy());
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Set("t", "m", p).ok());
  }
  auto store = PolicyStore::Open(path, CompressionPolicy());
  ASSERT_TRUE(store.ok()) << store.status();
  auto [got, is_default] = (*store)->Resolve("t", "m");
  EXPECT_FALSE(is_default);
  EXPECT_EQ(got, p) << got.DebugString();
  std::remove(path.c_str());
  std::remove((path + ".log").c_str());
  rmdir(dir);
}

// The control plane's Status carries the typed detail both ways, so that the SDK decides on it
// (busy, channel gone, memory not mappable) without reading the message.
TEST(StatusMappingTest, CodeMessageAndDetailRoundTrip) {
  for (const absl::Status& s :
       {BusyError("serve queue full"),
        WithDetail(absl::NotFoundError("no GPU channel 3 open for this tenant"),
                   ErrorDetail::kLinkGone),
        WithDetail(absl::FailedPreconditionError("mapping the client's memory: x"),
                   ErrorDetail::kMemoryNotMappable),
        absl::NotFoundError("cache not found"), absl::OkStatus()}) {
    const rpc::Status wire = StatusToRpc(s);
    EXPECT_EQ(wire.__isset.detail, DetailOf(s) != ErrorDetail::kNone) << s;
    const absl::Status back = StatusFromRpc(wire);
    EXPECT_EQ(back.code(), s.code()) << s;
    EXPECT_EQ(back.message(), s.message()) << s;
    EXPECT_EQ(DetailOf(back), DetailOf(s)) << s;
    EXPECT_EQ(IsBusy(back), IsBusy(s)) << s;
  }
  // An older peer's status (no detail) and a newer peer's unknown detail read as none.
  rpc::Status old;
  old.code = rpc::StatusCode::UNAVAILABLE;
  old.message = "down";
  EXPECT_EQ(DetailOf(StatusFromRpc(old)), ErrorDetail::kNone);
  old.__set_detail(77);
  EXPECT_EQ(DetailOf(StatusFromRpc(old)), ErrorDetail::kNone);
  EXPECT_FALSE(IsBusy(StatusFromRpc(old)));
  // A code this build does not know is Unknown, not a crash.
  old.code = static_cast<rpc::StatusCode::type>(4242);
  EXPECT_EQ(StatusFromRpc(old).code(), absl::StatusCode::kUnknown);
}

}  // namespace
}  // namespace service
}  // namespace kvcomp
