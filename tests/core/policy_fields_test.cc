// The policy's field table (policy_fields.def) and what is generated from it: the TLV records,
// Validate's ranges, the text form, equality and the debug string.
#include <cmath>
#include <limits>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/policy_test_util.h"
#include "gtest/gtest.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/core/policy_fields.h"

namespace kvcomp {
namespace {

std::string Hex(const std::string& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

// Every field of format 1.2 (tags 1 to 23) set away from its default.
CompressionPolicy AllChanged12() {
  CompressionPolicy p;
  p.scorer = Scorer::kSnapKV;
  p.ratio = 0.3;
  p.token_budget = 77;
  p.head_budget = HeadBudget::kAdaKV;
  p.alpha_safeguard = 0.4;
  p.n_sink = 2;
  p.n_recent = 9;
  p.recent_fraction = 0.125;
  p.protect = false;
  p.window = 1000;
  p.snapkv_window = 32;
  p.snapkv_pool = 7;
  p.seed = 0x1122334455667788ull;
  p.block_size = 256;
  p.moments = false;
  p.moment_aware = true;
  p.key_codec = KeyCodec::kInt8;
  p.value_codec = ValueCodec::kOrthogonalInt4;
  p.rank = 96;
  p.group_size = 16;
  p.gamma_aware = false;
  p.value_outlier_factor = 8.5;
  p.value_raw_fraction = 0.05;
  return p;
}

// The policy records as format 1.2's writer produced them before the table existed (tags 1..23
// in order): the table must keep them bit for bit. Records are written in tag order, so a field
// added later (tag 24 on) only appends records after these.
TEST(PolicyFields, TlvRecordsAreBitIdenticalToFormat12) {
  auto prefix = [](const CompressionPolicy& p, size_t n) {
    return Hex(format::EncodePolicyRecords(p)).substr(0, n);
  };
  const std::string defaults12 =
            "010001000202000800000000000000e03f03000400000000000400010000050008009a9999999999c9"
            "3f06000400040000000700040000000000080001000109000400001000000a000400400000000b0004"
            "00050000000c00080000000000000000000d000400000000000e000100010f00010000100001000011"
            "00010000120004000000000013000400200000001400010001150008000000000000001040160008"
            "007b14ae47e17a943f170008000000000000000000";
  // format 1.2's defaults are today's absent values (recent_fraction's and moments' defaults
  // changed since)
  EXPECT_EQ(prefix(AbsentFieldPolicy(), defaults12.size()), defaults12);
  const std::string changed12 =
            "010001000602000800333333333333d33f030004004d0000000400010001050008009a9999999999d9"
            "3f06000400020000000700040009000000080001000009000400e80300000a000400200000000b0004"
            "00070000000c00080088776655443322110d000400000100000e000100000f000100011000010002"
            "1100010003120004006000000013000400100000001400010000150008000000000000002140160008"
            "009a9999999999a93f17000800000000000000c03f";
  EXPECT_EQ(prefix(AllChanged12(), changed12.size()), changed12);
  auto back = format::DecodePolicyRecords(format::EncodePolicyRecords(AllChanged12()));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, AllChanged12());
}

TEST(PolicyFields, NamesTagsAndIdsAreUnique) {
  std::set<std::string> names;
  std::set<int> tags, ids;
  for (const PolicyFieldInfo& f : PolicyFields()) {
    EXPECT_TRUE(names.insert(std::string(f.name)).second) << f.name;
    EXPECT_TRUE(tags.insert(f.tlv_tag).second) << f.name;
    EXPECT_TRUE(ids.insert(f.thrift_id).second) << f.name;
    EXPECT_GT(f.tlv_tag, 0) << f.name;
    EXPECT_GT(f.thrift_id, 0) << f.name;
    EXPECT_FALSE(f.doc.empty()) << f.name;
    EXPECT_EQ(FindPolicyField(f.name), &f);
  }
  EXPECT_EQ(FindPolicyField("no_such_field"), nullptr);
}

// Each field's text form reads back to the same value, takes part in ==, in the debug string
// and in the TLV records; one changed field at a time, every declared field.
TEST(PolicyFields, EveryFieldRoundTripsThroughTextAndTlv) {
  const CompressionPolicy changed = testing::EveryFieldChanged();
  const CompressionPolicy defaults;
  for (const PolicyFieldInfo& f : PolicyFields()) {
    SCOPED_TRACE(std::string(f.name));
    EXPECT_EQ(f.text(defaults), f.default_text);
    const std::string text = f.text(changed);
    ASSERT_NE(text, f.default_text) << "no valid non-default value found for this field";
    CompressionPolicy p;
    ASSERT_TRUE(f.set(p, text).ok());
    EXPECT_EQ(f.text(p), text);
    EXPECT_NE(p, defaults);
    EXPECT_NE(p.DebugString().find(absl::StrCat(f.name, "=", text)), std::string::npos)
        << p.DebugString();
    if (p.value_codec == ValueCodec::kRaw && p.rank != 0) p.value_codec = ValueCodec::kOrthogonal;
    ASSERT_TRUE(p.Validate().ok()) << p.Validate();
    auto back = format::DecodePolicyRecords(format::EncodePolicyRecords(p));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, p);
  }
  ASSERT_TRUE(changed.Validate().ok()) << changed.Validate();
  auto back = format::DecodePolicyRecords(format::EncodePolicyRecords(changed));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, changed);
}

TEST(PolicyFields, DoublesPrintTheirShortestExactText) {
  CompressionPolicy p;
  const PolicyFieldInfo* ratio = FindPolicyField("ratio");
  ASSERT_NE(ratio, nullptr);
  for (double v : {0.0, 0.1, 0.2, 0.1234567890123, 1.0 / 3.0, 0.999999999999}) {
    ASSERT_TRUE(ratio->set(p, ratio->text(CompressionPolicy{})).ok());
    p.ratio = v;
    CompressionPolicy q;
    ASSERT_TRUE(ratio->set(q, ratio->text(p)).ok());
    EXPECT_EQ(q.ratio, v) << ratio->text(p);
  }
  p.ratio = 0.2;
  EXPECT_EQ(ratio->text(p), "0.2");
  EXPECT_EQ(FindPolicyField("value_outlier_factor")->default_text, "4");
}

TEST(PolicyFields, TextOutsideTheTypeOrRangeIsRefusedNamingTheField) {
  struct Case {
    const char* field;
    const char* text;
    const char* says;
  };
  const Case cases[] = {
      {"ratio", "1", "[0, 1)"},          {"ratio", "-0.1", "[0, 1)"},
      {"ratio", "nan", "not a number"},  {"ratio", "abc", "not a number"},
      {"recent_fraction", "1", "[0, 1)"}, {"alpha_safeguard", "1.5", "[0, 1]"},
      {"window", "0", "at least 1"},     {"n_sink", "-1", "integer"},
      {"n_sink", "4294967296", "integer"}, {"rank", "257", "[0, 256]"},
      {"group_size", "0", "[1, 256]"},   {"value_outlier_factor", "0.5", "[1, 1e9]"},
      {"protect", "maybe", "boolean"},   {"scorer", "best", "expected one of"},
      {"key_codec", "int3", "expected one of"},
  };
  for (const Case& c : cases) {
    const PolicyFieldInfo* f = FindPolicyField(c.field);
    ASSERT_NE(f, nullptr) << c.field;
    CompressionPolicy p;
    const absl::Status s = f->set(p, c.text);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field << "=" << c.text;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s;
    EXPECT_NE(s.message().find(c.says), std::string::npos) << s;
    EXPECT_EQ(p, CompressionPolicy()) << "a refused value changed the policy";
  }
}

TEST(PolicyFields, ValidateChecksEveryDeclaredRange) {
  for (const PolicyFieldInfo& f : PolicyFields()) {
    if (f.range.kind == PolicyRange::kAny || f.range.kind == PolicyRange::kNamed) continue;
    SCOPED_TRACE(std::string(f.name));
    // The lowest value is accepted, one below it is not (through the struct, not the text).
    CompressionPolicy p;
    ASSERT_TRUE(f.set(p, absl::StrCat(f.range.lo)).ok());
    if (f.name == "rank") p.value_codec = ValueCodec::kOrthogonal;
    EXPECT_TRUE(p.Validate().ok()) << p.Validate();
    CompressionPolicy probe;
    EXPECT_FALSE(f.set(probe, absl::StrCat(f.range.lo - 1)).ok());
  }
  CompressionPolicy p;
  p.window = 0;
  EXPECT_NE(p.Validate().message().find("window 0 must be at least 1"), std::string::npos)
      << p.Validate();
  p = CompressionPolicy();
  p.group_size = 300;
  EXPECT_NE(p.Validate().message().find("group_size 300 outside [1, 256]"), std::string::npos)
      << p.Validate();
  p = CompressionPolicy();
  p.value_codec = static_cast<ValueCodec>(9);
  EXPECT_NE(p.Validate().message().find("unknown value_codec 9"), std::string::npos)
      << p.Validate();
}

TEST(PolicyFields, HelpNamesRangeDefaultAndEnumValues) {
  EXPECT_EQ(FindPolicyField("ratio")->Help(),
            "Fraction of tokens evicted per head (kept = int(n x (1 - ratio))); ignored when "
            "token_budget > 0. In [0, 1). Default 0.5.");
  const std::string scorer = FindPolicyField("scorer")->Help();
  EXPECT_NE(scorer.find("Default manifold. One of: knorm, keydiff, manifold, windowed_manifold, "
                        "streaming, random, snapkv."),
            std::string::npos)
      << scorer;
  EXPECT_NE(FindPolicyField("window")->Help().find("At least 1. Default 4096."), std::string::npos);
}

// A default that changed keeps its old value as the field's absent value: a new policy gets the
// new default, an empty record set (a writer that did not write the field) reads as before.
TEST(PolicyFields, AbsentValuesAreTheDefaultsExceptWhereADefaultChanged) {
  const CompressionPolicy defaults;
  const CompressionPolicy absent = AbsentFieldPolicy();
  ASSERT_TRUE(absent.Validate().ok());
  EXPECT_EQ(defaults.recent_fraction, 0.75);
  EXPECT_EQ(absent.recent_fraction, 0.0);
  EXPECT_FALSE(defaults.moments);
  EXPECT_TRUE(absent.moments);
  CompressionPolicy same = absent;
  same.recent_fraction = defaults.recent_fraction;
  same.moments = defaults.moments;
  EXPECT_EQ(same, defaults) << "only recent_fraction's and moments' defaults changed";
  for (const PolicyFieldInfo& f : PolicyFields()) {
    EXPECT_EQ(f.absent_text, f.text(absent)) << f.name;
    EXPECT_EQ(f.default_text, f.text(defaults)) << f.name;
    if (f.absent_text != f.default_text) {
      EXPECT_NE(f.Help().find(absl::StrCat("Absent from a stored cache or a request: ",
                                           f.absent_text, ".")),
                std::string::npos)
          << f.Help();
    }
  }
  // The records of every field decode to the policy written; no records to the absent values.
  auto empty = format::DecodePolicyRecords("");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(*empty, absent);
  auto back = format::DecodePolicyRecords(format::EncodePolicyRecords(defaults));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, defaults);
  EXPECT_NE(PolicyFieldsJson().find("\"absent\": 0, \"absent_text\": \"0\""),
            std::string::npos);
  EXPECT_NE(PolicyFieldsJson().find("\"default\": false, \"default_text\": \"false\", "
                                    "\"absent\": true, \"absent_text\": \"true\""),
            std::string::npos);
  EXPECT_NE(FindPolicyField("moments")->Help().find(
                "Absent from a stored cache or a request: true."),
            std::string::npos)
      << FindPolicyField("moments")->Help();
}

TEST(PolicyFields, JsonListsEveryField) {
  const std::string json = PolicyFieldsJson();
  for (const PolicyFieldInfo& f : PolicyFields()) {
    EXPECT_NE(json.find(absl::StrCat("{\"name\": \"", f.name, "\"")), std::string::npos) << f.name;
  }
  EXPECT_EQ(json.front(), '[');
}

}  // namespace
}  // namespace kvcomp
