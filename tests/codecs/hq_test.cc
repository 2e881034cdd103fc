// The Hadamard codec (kvcomp/codecs/hq.h): the row record's layout, round-trip error bounds,
// determinism, malformed input, and whole caches through the engine and the byte format.
#include "kvcomp/codecs/hq.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/core/policy_presets.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/pipeline.h"

namespace kvcomp {
namespace {

std::vector<float> RandomRow(std::mt19937_64& rng, uint32_t d, float outlier = 0.0f) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(d);
  for (float& v : x) v = n(rng);
  if (outlier != 0.0f) x[d / 3] += outlier;  // a key-like channel outlier
  return x;
}

float StepOf(const uint8_t* rec) { return HalfToFloat(static_cast<uint16_t>(rec[2] | rec[3] << 8)); }
float LoOf(const uint8_t* rec) { return HalfToFloat(static_cast<uint16_t>(rec[0] | rec[1] << 8)); }

TEST(Hq, RowBytesAndChecks) {
  EXPECT_EQ(hq::RowBytes(4, 128), 68u);
  EXPECT_EQ(hq::RowBytes(3, 128), 52u);
  EXPECT_EQ(hq::RowBytes(2, 64), 20u);
  for (uint32_t d : {8u, 16u, 64u, 128u, 256u}) EXPECT_TRUE(hq::CheckHeadDim(d).ok()) << d;
  for (uint32_t d : {0u, 4u, 96u, 100u, 512u}) {
    EXPECT_EQ(hq::CheckHeadDim(d).code(), absl::StatusCode::kInvalidArgument) << d;
  }
  for (uint32_t b : {0u, 1u, 5u, 8u}) {
    EXPECT_EQ(hq::CheckBits(b).code(), absl::StatusCode::kInvalidArgument) << b;
  }
}

// The rotation is orthonormal: applying it twice (with the normalizer each time) is the identity
// up to f32 rounding.
TEST(Hq, HadamardIsAnInvolutionUpToScale) {
  std::mt19937_64 rng(1);
  for (uint32_t d : {8u, 128u, 256u}) {
    std::vector<float> x = RandomRow(rng, d), u = x;
    hq::Hadamard(u.data(), d);
    hq::Hadamard(u.data(), d);
    for (uint32_t i = 0; i < d; ++i) EXPECT_NEAR(u[i] / static_cast<float>(d), x[i], 1e-5f);
  }
}

// ||x - decode(encode(x))||_2 <= step / 2 * sqrt(d) (every rotated coordinate within half a step,
// the rotation orthonormal), with a little room for f32 rounding; the grid covers the row.
TEST(Hq, RoundTripWithinHalfAStepPerCoordinate) {
  std::mt19937_64 rng(7);
  for (uint32_t bits : {2u, 3u, 4u}) {
    for (uint32_t d : {8u, 64u, 128u, 256u}) {
      for (float outlier : {0.0f, 40.0f}) {
        for (int trial = 0; trial < 20; ++trial) {
          const std::vector<float> x = RandomRow(rng, d, outlier);
          std::vector<uint8_t> rec(hq::RowBytes(bits, d));
          ASSERT_TRUE(hq::EncodeRow(x.data(), d, bits, rec.data()).ok());
          std::vector<float> y(d);
          ASSERT_TRUE(hq::DecodeRow(rec.data(), d, bits, y.data()).ok());
          double err = 0, norm = 0;
          for (uint32_t i = 0; i < d; ++i) {
            err += double(x[i] - y[i]) * (x[i] - y[i]);
            norm += double(x[i]) * x[i];
          }
          const double bound = 0.5 * StepOf(rec.data()) * std::sqrt(double(d));
          EXPECT_LE(std::sqrt(err), bound * 1.001 + 1e-5 * std::sqrt(norm))
              << "bits " << bits << " d " << d;
          EXPECT_GT(StepOf(rec.data()), 0.0f);
          EXPECT_LE(LoOf(rec.data()), 0.0f);  // a Gaussian row has negative rotated coordinates
        }
      }
    }
  }
}

// The relative error of a Gaussian row with one outlier channel (20 sigma) at each width: about
// halving per added bit. Mean over 200 rows of d = 128.
TEST(Hq, RelativeErrorByWidth) {
  std::mt19937_64 rng(11);
  const uint32_t d = 128;
  for (uint32_t bits : {3u, 4u}) {
    double rel = 0;
    for (int t = 0; t < 200; ++t) {
      const std::vector<float> x = RandomRow(rng, d, 20.0f);
      std::vector<uint8_t> rec(hq::RowBytes(bits, d));
      ASSERT_TRUE(hq::EncodeRow(x.data(), d, bits, rec.data()).ok());
      std::vector<float> y(d);
      ASSERT_TRUE(hq::DecodeRow(rec.data(), d, bits, y.data()).ok());
      double e = 0, n = 0;
      for (uint32_t i = 0; i < d; ++i) {
        e += double(x[i] - y[i]) * (x[i] - y[i]);
        n += double(x[i]) * x[i];
      }
      rel += std::sqrt(e / n) / 200;
    }
    // Measured 0.078 (4 bits) and 0.166 (3 bits) with this outlier channel.
    EXPECT_LT(rel, bits == 4 ? 0.10 : 0.20) << bits;
    EXPECT_GT(rel, bits == 4 ? 0.04 : 0.10) << bits;  // not an accidental lossless path
  }
}

// The record of a fixed row, byte for byte: the layout documented in docs/format.md and what the
// CUDA twin must reproduce.
TEST(Hq, FixedRowRecord) {
  const uint32_t d = 8;
  const float x[d] = {1.0f, -2.0f, 0.5f, 3.0f, 0.0f, -1.5f, 2.5f, -0.25f};
  uint8_t rec[4 + 4];
  ASSERT_TRUE(hq::EncodeRow(x, d, 4, rec).ok());
  // signs of kHqSigns[0] = ...7c15: bits 0..7 = 1,0,1,0,1,0,0,0 -> s = -,+,-,+,-,+,+,+
  float u[d];
  for (uint32_t i = 0; i < d; ++i) u[i] = hq::Sign(i) * x[i];
  EXPECT_EQ(u[0], -1.0f);
  EXPECT_EQ(u[1], -2.0f);
  EXPECT_EQ(u[2], -0.5f);
  EXPECT_EQ(u[3], 3.0f);
  hq::Hadamard(u, d);
  const float c = hq::Normalizer(d);
  float mn = 1e9f, mx = -1e9f;
  for (float& v : u) {
    v *= c;
    mn = std::fmin(mn, v);
    mx = std::fmax(mx, v);
  }
  EXPECT_LE(LoOf(rec), mn);
  EXPECT_GE(LoOf(rec) + 15 * StepOf(rec), mx * (1 - 1e-6f));
  // Codes: a little-endian stream of nibbles, element 0 in the low nibble of byte 4.
  for (uint32_t i = 0; i < d; ++i) {
    const uint32_t q = (rec[4 + i / 2] >> (4 * (i % 2))) & 15u;
    const float want = std::nearbyint((u[i] - LoOf(rec)) / StepOf(rec));
    EXPECT_EQ(q, static_cast<uint32_t>(std::fmin(std::fmax(want, 0.0f), 15.0f))) << i;
  }
  // The 3-bit stream crosses bytes: code i in bits [3i, 3i + 3).
  uint8_t rec3[4 + 3];
  ASSERT_TRUE(hq::EncodeRow(x, d, 3, rec3).ok());
  const uint32_t stream = rec3[4] | rec3[5] << 8 | rec3[6] << 16;
  for (uint32_t i = 0; i < d; ++i) {
    const uint32_t q = (stream >> (3 * i)) & 7u;
    const float want = std::nearbyint((u[i] - LoOf(rec3)) / StepOf(rec3));
    EXPECT_EQ(q, static_cast<uint32_t>(std::fmin(std::fmax(want, 0.0f), 7.0f))) << i;
  }
}

TEST(Hq, DeterministicAndZeroRowExact) {
  std::mt19937_64 rng(3);
  const uint32_t d = 128;
  const std::vector<float> x = RandomRow(rng, d, 10.0f);
  std::vector<uint8_t> a(hq::RowBytes(3, d)), b(a.size());
  ASSERT_TRUE(hq::EncodeRow(x.data(), d, 3, a.data()).ok());
  ASSERT_TRUE(hq::EncodeRow(x.data(), d, 3, b.data()).ok());
  EXPECT_EQ(a, b);
  const std::vector<float> zero(d, 0.0f);
  a.resize(hq::RowBytes(4, d));  // a 4-bit record is longer than the 3-bit one above
  ASSERT_TRUE(hq::EncodeRow(zero.data(), d, 4, a.data()).ok());
  EXPECT_EQ(StepOf(a.data()), 0.0f);
  std::vector<float> y(d, 1.0f);
  ASSERT_TRUE(hq::DecodeRow(a.data(), d, 4, y.data()).ok());
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

// Large batches are split over threads: every record is the one EncodeRow makes alone, decoded
// rows are DecodeRow's, and a bad row deep in the batch is reported by its own index.
TEST(Hq, BatchesSplitOverThreadsMatchRowByRow) {
  std::mt19937_64 rng(11);
  const uint32_t d = 64, bits = 3;
  const uint64_t rows = 40000;
  std::vector<float> x;
  x.reserve(rows * d);
  for (uint64_t r = 0; r < rows; ++r) {
    const std::vector<float> row = RandomRow(rng, d, 1.0f + static_cast<float>(r % 7));
    x.insert(x.end(), row.begin(), row.end());
  }
  const uint64_t rb = hq::RowBytes(bits, d);
  std::vector<uint8_t> batch(rows * rb), one(rb);
  ASSERT_TRUE(hq::EncodeRows(x.data(), DType::kF32, rows, d, bits, batch.data()).ok());
  std::vector<float> decoded(rows * d), alone(d);
  ASSERT_TRUE(hq::DecodeRows(batch.data(), rows, d, bits, decoded.data(), DType::kF32).ok());
  for (uint64_t r = 0; r < rows; ++r) {
    ASSERT_TRUE(hq::EncodeRow(x.data() + r * d, d, bits, one.data()).ok());
    ASSERT_EQ(0, std::memcmp(one.data(), batch.data() + r * rb, rb)) << "row " << r;
    ASSERT_TRUE(hq::DecodeRow(batch.data() + r * rb, d, bits, alone.data()).ok());
    ASSERT_EQ(0, std::memcmp(alone.data(), decoded.data() + r * d, d * sizeof(float)))
        << "row " << r;
  }
  x[31000 * d + 5] = std::nanf("");
  x[39000 * d] = std::nanf("");
  absl::Status s = hq::EncodeRows(x.data(), DType::kF32, rows, d, bits, batch.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("(row 31000)"), std::string::npos) << s;
}

// The extremes take -0 below +0 (so a device's reduction tree gives the same record): a row of
// signed zeros has lo = -0 exactly when its rotation holds a -0, whatever the element order.
TEST(Hq, TheMinimumOfSignedZerosIsMinusZero) {
  const uint32_t d = 16;
  std::mt19937_64 rng(21);
  for (int trial = 0; trial < 64; ++trial) {
    std::vector<float> x(d);
    for (float& v : x) v = (rng() & 1) ? -0.0f : 0.0f;
    std::vector<float> u(d);
    for (uint32_t i = 0; i < d; ++i) u[i] = hq::Sign(i) * x[i];
    hq::Hadamard(u.data(), d);
    bool minus = false;
    for (float v : u) minus = minus || std::signbit(v * hq::Normalizer(d));
    std::vector<uint8_t> rec(hq::RowBytes(4, d));
    ASSERT_TRUE(hq::EncodeRow(x.data(), d, 4, rec.data()).ok());
    EXPECT_EQ(rec[0] | rec[1] << 8, minus ? 0x8000 : 0x0000) << trial;
    EXPECT_EQ(rec[2] | rec[3] << 8, 0);
  }
}

// The backends' CodecOps::EncodeHq / DecodeHq: the CPU's are the reference functions.
TEST(Hq, CpuCodecOpsAreTheReference) {
  auto be = MakeCpuBackend(CpuBackendOptions{2});
  ASSERT_TRUE(be.ok());
  std::mt19937_64 rng(23);
  const uint32_t d = 128, bits = 3;
  const uint64_t rows = 301;
  std::vector<float> x;
  for (uint64_t r = 0; r < rows; ++r) {
    const std::vector<float> row = RandomRow(rng, d, static_cast<float>(r % 5));
    x.insert(x.end(), row.begin(), row.end());
  }
  std::vector<uint8_t> want(rows * hq::RowBytes(bits, d)), got(want.size());
  ASSERT_TRUE(hq::EncodeRows(x.data(), DType::kF32, rows, d, bits, want.data()).ok());
  ASSERT_TRUE((*be)->codec().EncodeHq(bits, rows, d, x.data(), DType::kF32, got.data()).ok());
  EXPECT_EQ(got, want);
  std::vector<uint16_t> a(rows * d), b(rows * d);
  ASSERT_TRUE(hq::DecodeRows(want.data(), rows, d, bits, a.data(), DType::kBF16).ok());
  ASSERT_TRUE((*be)->codec().DecodeHq(bits, rows, d, want.data(), b.data(), DType::kBF16).ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ((*be)->codec().EncodeHq(bits, 1, 96, x.data(), DType::kF32, got.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// Whether a device engine keeps a compression on the device: yes for every codec, the hq codecs
// too unless KVCOMP_HQ_DEVICE_ENCODE=0.
TEST(Hq, DeviceEncodesEveryCodecUnlessSwitchedOff) {
  unsetenv("KVCOMP_HQ_DEVICE_ENCODE");
  CompressionPolicy p;
  EXPECT_TRUE(DeviceEncodes(p));
  p.value_codec = ValueCodec::kOrthogonalInt8;
  p.key_codec = KeyCodec::kInt8;
  EXPECT_TRUE(DeviceEncodes(p));
  p.value_codec = ValueCodec::kHq3;
  EXPECT_TRUE(DeviceEncodes(p));
  p.value_codec = ValueCodec::kRaw;
  p.key_codec = KeyCodec::kHq4;
  EXPECT_TRUE(DeviceEncodes(p));
  setenv("KVCOMP_HQ_DEVICE_ENCODE", "1", 1);
  EXPECT_TRUE(DeviceEncodes(p));
  setenv("KVCOMP_HQ_DEVICE_ENCODE", "0", 1);
  EXPECT_FALSE(DeviceEncodes(p));
  p.key_codec = KeyCodec::kInt8;
  EXPECT_TRUE(DeviceEncodes(p));  // the switch names the hq codecs only
  unsetenv("KVCOMP_HQ_DEVICE_ENCODE");
}

TEST(Hq, MalformedInputIsAnError) {
  const uint32_t d = 16;
  std::vector<float> x(d, 1.0f);
  std::vector<uint8_t> rec(hq::RowBytes(4, d));
  x[3] = NAN;
  EXPECT_EQ(hq::EncodeRow(x.data(), d, 4, rec.data()).code(), absl::StatusCode::kInvalidArgument);
  x[3] = INFINITY;
  EXPECT_EQ(hq::EncodeRow(x.data(), d, 4, rec.data()).code(), absl::StatusCode::kInvalidArgument);
  x[3] = 1e6f;  // the rotated row leaves f16
  EXPECT_EQ(hq::EncodeRow(x.data(), d, 4, rec.data()).code(), absl::StatusCode::kInvalidArgument);
  x[3] = 1.0f;
  ASSERT_TRUE(hq::EncodeRow(x.data(), d, 4, rec.data()).ok());
  std::vector<float> y(d);
  for (uint16_t bad_step : {uint16_t{0x7c00}, uint16_t{0x7e00}, uint16_t{0xbc00}}) {
    std::vector<uint8_t> r = rec;
    r[2] = static_cast<uint8_t>(bad_step & 0xff);
    r[3] = static_cast<uint8_t>(bad_step >> 8);
    EXPECT_EQ(hq::DecodeRow(r.data(), d, 4, y.data()).code(), absl::StatusCode::kInvalidArgument);
  }
  std::vector<uint8_t> r = rec;
  r[1] = 0xfc;  // lo = -inf
  r[0] = 0x00;
  EXPECT_EQ(hq::DecodeRow(r.data(), d, 4, y.data()).code(), absl::StatusCode::kInvalidArgument);
  // Whole-array entry points check their arguments.
  EXPECT_EQ(hq::EncodeRows(x.data(), DType::kF32, 1, 96, 4, rec.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(hq::EncodeRows(x.data(), DType::kF32, 1, d, 5, rec.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(hq::EncodeRows(nullptr, DType::kF32, 1, d, 4, rec.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(hq::DecodeRows(rec.data(), 1, d, 4, nullptr, DType::kF32).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Hq, PolicyNamesAndRules) {
  EXPECT_EQ(*ParseKeyCodec("hq4"), KeyCodec::kHq4);
  EXPECT_EQ(*ParseKeyCodec("hq3"), KeyCodec::kHq3);
  EXPECT_EQ(*ParseValueCodec("hq4"), ValueCodec::kHq4);
  EXPECT_EQ(*ParseValueCodec("hq3"), ValueCodec::kHq3);
  EXPECT_EQ(KeyCodecName(KeyCodec::kHq3), "hq3");
  EXPECT_EQ(ValueCodecName(ValueCodec::kHq4), "hq4");
  CompressionPolicy p;
  p.key_codec = KeyCodec::kHq4;
  p.value_codec = ValueCodec::kHq3;
  EXPECT_TRUE(p.ValidateFor(128).ok());
  EXPECT_EQ(p.EffectiveRank(128), 0u);
  EXPECT_EQ(p.ValidateFor(96).code(), absl::StatusCode::kInvalidArgument);
  p.rank = 64;
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// A random cache through Compress (CPU), the format and DecodeKept: sizes, per-row bounds,
// the format version, and a damaged record refused.
class HqCache : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_.num_layers = 2;
    layout_.num_kv_heads = 2;
    layout_.num_q_heads = 4;
    layout_.head_dim = 64;
    layout_.dtype = DType::kF32;
    std::mt19937_64 rng(5);
    std::normal_distribution<float> n(0.0f, 1.0f);
    const uint64_t per_layer = uint64_t{layout_.num_kv_heads} * tokens_ * layout_.head_dim;
    k_.resize(layout_.num_layers * per_layer);
    v_.resize(k_.size());
    for (float& x : k_) x = n(rng) * 2.0f + 1.0f;
    for (float& x : v_) x = n(rng) * 0.5f;
    view_.layout = layout_;
    view_.num_tokens = tokens_;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      view_.keys.push_back(HeadsView::Dense(k_.data() + l * per_layer, DType::kF32,
                                            layout_.num_kv_heads, tokens_, layout_.head_dim));
      view_.values.push_back(HeadsView::Dense(v_.data() + l * per_layer, DType::kF32,
                                              layout_.num_kv_heads, tokens_, layout_.head_dim));
    }
    auto b = MakeCpuBackend(CpuBackendOptions{2});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  KvLayout layout_;
  const uint64_t tokens_ = 200;
  std::vector<float> k_, v_;
  KvCacheView view_;
  std::unique_ptr<Backend> backend_;
};

TEST_F(HqCache, CompressEncodeParseDecode) {
  for (double ratio : {0.0, 0.5}) {
    CompressionPolicy p;
    p.ratio = ratio;
    p.moments = false;
    p.key_codec = KeyCodec::kHq4;
    p.value_codec = ValueCodec::kHq3;
    auto c = Compress(*backend_, view_, p);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->KeyTokenBytes(), 4u + 32u);
    EXPECT_EQ(c->ValueTokenBytes(), 4u + 24u);
    EXPECT_TRUE(c->key_scales.empty());
    EXPECT_TRUE(c->value_scales.empty());
    EXPECT_EQ(c->rank, 0u);
    EXPECT_EQ(c->projection_version, 0u);
    auto bytes = format::EncodeCache(*c);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    uint16_t minor;
    std::memcpy(&minor, bytes->data() + 6, 2);
    EXPECT_EQ(minor, 5);  // written by this version (the hq codecs came with 1.4)
    auto parsed = format::ParseCache(*bytes);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, *c);
    auto info = format::PeekCache(*bytes);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->key_codec, KeyCodec::kHq4);
    EXPECT_EQ(info->value_codec, ValueCodec::kHq3);
    auto dec = DecodeKept(*backend_, *parsed, nullptr, DType::kF32);
    ASSERT_TRUE(dec.ok()) << dec.status();
    const uint32_t d = layout_.head_dim;
    const auto* dk = reinterpret_cast<const float*>(dec->keys.data());
    const auto* dv = reinterpret_cast<const float*>(dec->values.data());
    // Each kept row against its source token: within its record's bound.
    for (uint64_t h = 0; h < c->num_heads(); ++h) {
      const uint32_t l = static_cast<uint32_t>(h / layout_.num_kv_heads);
      const uint32_t kv = static_cast<uint32_t>(h % layout_.num_kv_heads);
      for (uint64_t r = dec->offsets[h]; r < dec->offsets[h + 1]; ++r) {
        const uint64_t src = (uint64_t{l} * layout_.num_kv_heads + kv) * tokens_ * d +
                             uint64_t{dec->positions[r]} * d;
        double ek = 0, ev = 0;
        for (uint32_t i = 0; i < d; ++i) {
          ek += double(dk[r * d + i] - k_[src + i]) * (dk[r * d + i] - k_[src + i]);
          ev += double(dv[r * d + i] - v_[src + i]) * (dv[r * d + i] - v_[src + i]);
        }
        const double sk = StepOf(c->keys.data() + r * c->KeyTokenBytes());
        const double sv = StepOf(c->values.data() + r * c->ValueTokenBytes());
        ASSERT_LE(std::sqrt(ek), 0.5 * sk * std::sqrt(double(d)) * 1.001 + 1e-4) << r;
        ASSERT_LE(std::sqrt(ev), 0.5 * sv * std::sqrt(double(d)) * 1.001 + 1e-4) << r;
      }
    }
    // A damaged record (negative step) is refused when encoding and when parsing.
    CompressedCache bad = *c;
    bad.values[3] |= 0x80;
    EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_FALSE(format::EncodeCache(bad).ok());
  }
}

// hq values need no projection and mix with the other key codecs; a rank on hq values is refused.
TEST_F(HqCache, NeedsNoProjectionAndMixesWithTheOtherKeyCodecs) {
  CompressionPolicy p;
  p.ratio = 0.0;
  p.moments = false;
  p.key_codec = KeyCodec::kInt4;
  p.value_codec = ValueCodec::kHq4;
  auto c = Compress(*backend_, view_, p);
  ASSERT_TRUE(c.ok()) << c.status();
  auto dec = DecodeKept(*backend_, *c, nullptr, DType::kBF16);
  ASSERT_TRUE(dec.ok()) << dec.status();
  EXPECT_EQ(dec->values.size(), c->total_kept() * layout_.head_dim * 2);
  CompressedCache tampered = *c;
  tampered.rank = 8;
  EXPECT_EQ(tampered.Validate().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcomp
