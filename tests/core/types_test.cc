#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "absl/strings/cord.h"
#include "gtest/gtest.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/core/policy_presets.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace {

TEST(DType, NamesRoundTrip) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kInt8, DType::kInt4}) {
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(ParseDType("float64").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DTypeBytes(DType::kInt4, 5), 3u);
  EXPECT_EQ(DTypeBytes(DType::kBF16, 5), 10u);
}

TEST(DType, HalfMatchesCompilerConversion) {
  // Every half bit pattern converts to float and back unchanged (NaN payloads aside).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToHalf(f), h) << h;
    EXPECT_EQ(static_cast<float>(static_cast<_Float16>(f)), f);
  }
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  std::uniform_real_distribution<float> small(-1e-4f, 1e-4f);
  for (int i = 0; i < 200000; ++i) {
    const float f = (i % 2) ? u(rng) : small(rng);
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t ref_bits;
    std::memcpy(&ref_bits, &ref, 2);
    ASSERT_EQ(FloatToHalf(f), ref_bits) << f;
  }
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(3.140625f)), 3.140625f);
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

TEST(Layout, Validate) {
  KvLayout l{32, 8, 32, 128, DType::kBF16};
  EXPECT_TRUE(l.Validate().ok());
  EXPECT_EQ(l.group_size(), 4u);
  EXPECT_EQ(l.CacheBytes(1000), 2ull * 32 * 8 * 1000 * 128 * 2);
  KvLayout bad = l;
  bad.head_dim = 96;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
  bad = l;
  bad.num_q_heads = 12;
  EXPECT_FALSE(bad.Validate().ok());
  bad = l;
  bad.dtype = DType::kInt8;
  EXPECT_FALSE(bad.Validate().ok());
  bad = l;
  bad.num_layers = 0;
  EXPECT_FALSE(bad.Validate().ok());
}

TEST(CacheKey, ValidateAndEncode) {
  CacheKey k{"team-a", "meta-llama/Llama-3.1-8B", std::string("\x00\x01req", 5)};
  ASSERT_TRUE(k.Validate().ok());
  auto back = CacheKey::Decode(k.Encode());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, k);
  EXPECT_EQ(k.Encode().rfind(CacheKey::TenantPrefix("team-a"), 0), 0u);
  CacheKey bad = k;
  bad.key = std::string(CacheKey::kMaxKeyBytes + 1, 'x');
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
  bad = k;
  bad.key.clear();
  EXPECT_FALSE(bad.Validate().ok());
  bad = k;
  bad.tenant = "a/b";
  EXPECT_FALSE(bad.Validate().ok());
  bad = k;
  bad.model_id = "";
  EXPECT_FALSE(bad.Validate().ok());
  EXPECT_FALSE(CacheKey::Decode("\x00").ok());
}

TEST(CompressedCache, WriteDenseKvPlacesEveryTokenAtItsPosition) {
  const KvLayout l{2, 2, 2, 64, DType::kF16};
  const uint64_t T = 5;
  CompressedCache c;
  c.layout = l;
  c.original_tokens = T;
  const uint64_t row = DTypeBytes(l.dtype, l.head_dim);
  for (uint64_t h = 0; h < c.num_heads(); ++h) {
    c.kept.push_back(T);
    for (uint32_t t = 0; t < T; ++t) c.positions.push_back(t);
  }
  std::mt19937 rng(std::random_device{}());
  c.keys.resize(c.num_heads() * T * row);
  c.values.resize(c.keys.size());
  for (uint8_t& b : c.keys) b = static_cast<uint8_t>(rng());
  for (uint8_t& b : c.values) b = static_cast<uint8_t>(rng());
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  // Heads are stored layer-major, then kv head: dense K is the stored keys, dense V follows.
  std::vector<uint8_t> dense(l.CacheBytes(T));
  ASSERT_TRUE(c.WriteDenseKv(dense.data()).ok());
  EXPECT_TRUE(std::equal(c.keys.begin(), c.keys.end(), dense.begin()));
  EXPECT_TRUE(std::equal(c.values.begin(), c.values.end(), dense.begin() + c.keys.size()));
  // A head that evicted a token, or an encoded codec, is refused.
  CompressedCache evicted = c;
  evicted.kept[3] = T - 1;
  EXPECT_EQ(evicted.WriteDenseKv(dense.data()).code(), absl::StatusCode::kFailedPrecondition);
  CompressedCache encoded = c;
  encoded.key_codec = KeyCodec::kInt8;
  EXPECT_EQ(encoded.WriteDenseKv(dense.data()).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(Policy, DefaultsAreValid) {
  CompressionPolicy p;
  EXPECT_TRUE(p.Validate().ok());
  EXPECT_EQ(p.scorer, Scorer::kManifold);
  EXPECT_DOUBLE_EQ(p.alpha_safeguard, 0.2);
  EXPECT_EQ(p.window, 4096u);
  EXPECT_EQ(p.n_sink, 4u);
}

TEST(Policy, KvpressRounding) {
  CompressionPolicy p;
  p.ratio = 0.07;
  EXPECT_EQ(p.KeptPerHead(1000), 929u);
  p.token_budget = 100;
  EXPECT_EQ(p.KeptPerHead(1000), 100u);
  EXPECT_EQ(p.KeptPerHead(50), 50u);
}

TEST(Policy, RejectsBadFields) {
  CompressionPolicy p;
  p.ratio = 1.0;
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
  p.ratio = -0.1;
  EXPECT_FALSE(p.Validate().ok());
  p.ratio = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(p.Validate().ok());
  p = CompressionPolicy();
  p.alpha_safeguard = 1.5;
  EXPECT_FALSE(p.Validate().ok());
  p = CompressionPolicy();
  p.snapkv_pool = 4;
  EXPECT_FALSE(p.Validate().ok());
  p = CompressionPolicy();
  p.value_codec = ValueCodec::kOrthogonalInt4;
  p.rank = 33;
  EXPECT_FALSE(p.Validate().ok());
  p.rank = 130;
  EXPECT_TRUE(p.Validate().ok());
  EXPECT_FALSE(p.ValidateFor(128).ok());
  p = CompressionPolicy();
  p.scorer = static_cast<Scorer>(99);
  EXPECT_FALSE(p.Validate().ok());
}

TEST(Policy, RecentFractionRangeAndEffectiveRecent) {
  CompressionPolicy p;
  EXPECT_EQ(p.recent_fraction, 0.75);  // the default: three quarters of the kept budget recent
  EXPECT_EQ(p.EffectiveRecent(1000), 750u);
  EXPECT_FALSE(p.moments);  // no summaries of the evicted tokens unless asked
  p = AbsentFieldPolicy();  // what a cache or request without the field means
  EXPECT_EQ(p.recent_fraction, 0.0);
  EXPECT_TRUE(p.moments);
  EXPECT_EQ(p.EffectiveRecent(1000), 0u);  // n_recent alone
  p.n_recent = 9;
  EXPECT_EQ(p.EffectiveRecent(1000), 9u);
  p.recent_fraction = 0.5;
  EXPECT_TRUE(p.Validate().ok());
  EXPECT_EQ(p.EffectiveRecent(1000), 500u);
  EXPECT_EQ(p.EffectiveRecent(1017), 508u);  // floor
  EXPECT_EQ(p.EffectiveRecent(17), 9u);      // n_recent is the floor of the window
  EXPECT_EQ(p.EffectiveRecent(0), 9u);
  // The fraction's window leaves the 4 sink tokens their room at small budgets.
  p.n_recent = 0;
  p.recent_fraction = 0.75;
  EXPECT_EQ(p.EffectiveRecent(10), 6u);  // floor(7.5) = 7 > 10 - 4
  EXPECT_EQ(p.EffectiveRecent(16), 12u);
  EXPECT_EQ(p.EffectiveRecent(3), 0u);
  p.n_recent = 5;
  EXPECT_EQ(p.EffectiveRecent(3), 5u);  // n_recent as given
  p.recent_fraction = 0.999;
  EXPECT_EQ(p.EffectiveRecent(uint64_t{1} << 40), 0xFFFFFFFFu);  // saturates
  for (double bad : {1.0, -0.01, 2.0, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    p.recent_fraction = bad;
    const absl::Status s = p.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("recent_fraction"), std::string::npos) << s;
    EXPECT_NE(s.message().find("[0, 1)"), std::string::npos) << s;
  }
  // Part of equality and of the debug string.
  CompressionPolicy a, b;
  b.recent_fraction = 0.25;
  EXPECT_NE(a, b);
  EXPECT_NE(b.DebugString().find("recent_fraction=0.25"), std::string::npos);
}

TEST(Policy, NamesRoundTrip) {
  for (auto s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
                 Scorer::kStreaming, Scorer::kRandom, Scorer::kSnapKV}) {
    EXPECT_EQ(*ParseScorer(ScorerName(s)), s);
  }
  EXPECT_EQ(*ParseValueCodec("orthogonal_int4"), ValueCodec::kOrthogonalInt4);
  EXPECT_EQ(ParseScorer("h2o").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DefaultRank(ValueCodec::kOrthogonalInt4, 128), 96u);
}

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError("odd");
  return x / 2;
}
absl::Status UseMacros(int x, int* out) {
  KVCOMP_ASSIGN_OR_RETURN(int h, Half(x));
  KVCOMP_RETURN_IF_ERROR(h > 10 ? absl::OutOfRangeError("big") : absl::OkStatus());
  *out = h;
  return absl::OkStatus();
}

TEST(Status, Macros) {
  int out = 0;
  EXPECT_TRUE(UseMacros(8, &out).ok());
  EXPECT_EQ(out, 4);
  EXPECT_EQ(UseMacros(7, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UseMacros(40, &out).code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(IsBusy(BusyError("queue full")));
  EXPECT_FALSE(IsBusy(absl::UnavailableError("down")));
  EXPECT_FALSE(IsBusy(absl::UnavailableError("[busy] down")));  // text decides nothing
  EXPECT_EQ(BusyError("queue full").message(), "queue full");
  EXPECT_EQ(StatusCodeFromWire(StatusCodeToWire(absl::StatusCode::kDataLoss)),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(StatusCodeFromWire(999), absl::StatusCode::kUnknown);
}

TEST(PolicyPreset, NamedPresetsValidateAndDiffer) {
  for (const std::string& name : PolicyPresetNames()) {
    auto p = PolicyPreset(name);
    ASSERT_TRUE(p.ok()) << name << ": " << p.status();
    EXPECT_TRUE(p->Validate().ok()) << name;
  }
  EXPECT_EQ(*PolicyPreset("default"), CompressionPolicy{});
  const CompressionPolicy lossless = *PolicyPreset("lossless");
  EXPECT_EQ(lossless.ratio, 0.0);
  EXPECT_FALSE(lossless.moments);
  EXPECT_EQ(lossless.key_codec, KeyCodec::kRaw);
  EXPECT_EQ(lossless.value_codec, ValueCodec::kRaw);
  const CompressionPolicy codec = *PolicyPreset("codec");
  EXPECT_EQ(codec.ratio, 0.0);
  EXPECT_FALSE(codec.moments);
  EXPECT_EQ(codec.key_codec, KeyCodec::kPq);  // k3v2: the calibrated basis codec
  EXPECT_EQ(codec.value_codec, ValueCodec::kPq);
  EXPECT_EQ(codec.key_bits, 3u);
  EXPECT_EQ(codec.value_bits, 2u);
  const CompressionPolicy balanced = *PolicyPreset("balanced");
  EXPECT_EQ(balanced.ratio, 0.33);
  EXPECT_EQ(balanced.recent_fraction, 0.85);
  EXPECT_FALSE(balanced.moments);
  EXPECT_EQ(balanced.key_codec, KeyCodec::kHq4);
  EXPECT_EQ(balanced.value_codec, ValueCodec::kHq3);
  auto bad = PolicyPreset("fastest");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("lossless"), std::string::npos);
}

TEST(StatusTest, DetailsAreTypedPayloadsThatSurviveAnnotation) {
  const Status gone =
      WithDetail(absl::NotFoundError("no GPU channel 7"), ErrorDetail::kLinkGone);
  EXPECT_EQ(DetailOf(gone), ErrorDetail::kLinkGone);
  EXPECT_EQ(DetailOf(absl::NotFoundError("no GPU channel 7")), ErrorDetail::kNone);
  const Status annotated = Annotate(gone, "get");
  EXPECT_EQ(annotated.message(), "get: no GPU channel 7");
  EXPECT_EQ(DetailOf(annotated), ErrorDetail::kLinkGone);
  EXPECT_TRUE(IsBusy(Annotate(BusyError("queue full"), "put")));
  // Replaced, removed; OK carries none.
  EXPECT_EQ(DetailOf(WithDetail(gone, ErrorDetail::kMemoryNotMappable)),
            ErrorDetail::kMemoryNotMappable);
  EXPECT_EQ(DetailOf(WithDetail(gone, ErrorDetail::kNone)), ErrorDetail::kNone);
  EXPECT_TRUE(WithDetail(absl::OkStatus(), ErrorDetail::kBusy).ok());
  EXPECT_EQ(DetailOf(absl::OkStatus()), ErrorDetail::kNone);
  // A busy detail on another code is not busy.
  EXPECT_FALSE(IsBusy(WithDetail(absl::InternalError("x"), ErrorDetail::kBusy)));
  // Wire numbers are stable; unknown ones read as none, also from a foreign payload.
  EXPECT_EQ(ErrorDetailToWire(ErrorDetail::kBusy), 1);
  EXPECT_EQ(ErrorDetailToWire(ErrorDetail::kLinkGone), 2);
  EXPECT_EQ(ErrorDetailToWire(ErrorDetail::kMemoryNotMappable), 3);
  EXPECT_EQ(ErrorDetailFromWire(3), ErrorDetail::kMemoryNotMappable);
  EXPECT_EQ(ErrorDetailToWire(ErrorDetail::kCallDeadline), 4);
  EXPECT_EQ(ErrorDetailFromWire(4), ErrorDetail::kCallDeadline);
  EXPECT_EQ(ErrorDetailToWire(ErrorDetail::kDiskFull), 5);
  EXPECT_EQ(ErrorDetailFromWire(5), ErrorDetail::kDiskFull);
  EXPECT_EQ(ErrorDetailFromWire(6), ErrorDetail::kNone);
  EXPECT_EQ(ErrorDetailFromWire(999), ErrorDetail::kNone);
  Status foreign = absl::UnavailableError("x");
  foreign.SetPayload(kErrorDetailUrl, absl::Cord("not a number"));
  EXPECT_EQ(DetailOf(foreign), ErrorDetail::kNone);
}

}  // namespace
}  // namespace kvcomp
