// The calibrated basis codec (kvcomp/codecs/pq.h): fixed records of a fixed basis (the Python
// mirror, tests/python/test_pq_mirror.py, asserts the same bytes and digests), the basis format's
// checks, calibration on synthetic rows with a steep spectrum, bad input.
#include "kvcomp/codecs/pq.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace kvcomp {
namespace pq {
namespace {

// The fixture's generator (the mirror has the same): a 64-bit LCG, 24 bits per draw.
struct Lcg {
  uint64_t s = 0x853c49e6748fea9bull;
  uint32_t Next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(s >> 40);
  }
  // A value in [-8, 8) with 20 fraction bits: exact in f32.
  float Val() { return (static_cast<float>(Next()) - 8388608.0f) / 1048576.0f; }
};

// One layer, two kv heads, d = 16, 37 bits per row (5-byte records, 3 padding bits); widths 0..8.
Basis FixtureBasis() {
  Basis b;
  b.num_layers = 1;
  b.num_kv_heads = 2;
  b.head_dim = 16;
  b.bits_total = 37;
  const uint8_t w[2][16] = {{8, 7, 6, 5, 4, 3, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0},
                            {5, 5, 5, 5, 4, 4, 3, 3, 2, 1, 0, 0, 0, 0, 0, 0}};
  Lcg g;
  for (int h = 0; h < 2; ++h) {
    for (int c = 0; c < 16; ++c) {
      for (int j = 0; j < 16; ++j) b.basis.push_back(g.Val() / 16.0f);
    }
    for (int j = 0; j < 16; ++j) b.mean.push_back(g.Val() / 64.0f);
    for (int c = 0; c < 16; ++c) {
      const float s = static_cast<float>(32 + (g.Next() & 15)) / 32.0f *
                      std::ldexp(1.0f, -(c / 4));
      b.scale.push_back(s);
      b.inv_scale.push_back(1.0f / s);
      b.widths.push_back(w[h][c]);
    }
  }
  return b;
}

std::vector<float> FixtureRows(uint64_t rows, uint32_t d) {
  Lcg g;
  g.s = 0x2545f4914f6cdd1dull;
  std::vector<float> x(rows * d);
  for (float& v : x) v = g.Val() / 16.0f;
  return x;
}

uint64_t Fnv(const void* p, uint64_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint64_t i = 0; i < n; ++i) {
    h ^= static_cast<const uint8_t*>(p)[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string Hex(const uint8_t* p, uint64_t n) {
  std::string s;
  for (uint64_t i = 0; i < n; ++i) s += absl::StrFormat("%02x", p[i]);
  return s;
}

TEST(PqCodebooks, CentroidsAscendBoundariesAreMidpoints) {
  for (uint32_t w = 1; w <= kMaxWidth; ++w) {
    auto c = Centroids(w);
    auto b = Boundaries(w);
    ASSERT_EQ(c.size(), size_t{1} << w);
    ASSERT_EQ(b.size(), c.size() - 1);
    for (size_t k = 0; k + 1 < c.size(); ++k) {
      EXPECT_LT(c[k], c[k + 1]);
      EXPECT_EQ(b[k], (c[k] + c[k + 1]) * 0.5f);
    }
    EXPECT_LT(GaussianDistortion(w), GaussianDistortion(w - 1));
  }
  EXPECT_TRUE(Centroids(0).empty());
  EXPECT_TRUE(Centroids(9).empty());
}

// The fixed records: the same hex and digests are asserted by the Python mirror.
TEST(PqRecords, FixedRecordsOfAFixedBasis) {
  const Basis b = FixtureBasis();
  ASSERT_TRUE(b.Validate().ok()) << b.Validate();
  ASSERT_EQ(b.RecordBytes(), 5u);
  EXPECT_EQ(absl::StrFormat("%016x", b.Fingerprint()), "b3bcc5cbbb90ab87");
  const uint64_t rows = 64;
  const std::vector<float> x = FixtureRows(rows, 16);
  std::vector<uint8_t> rec(2 * rows * 5);
  std::vector<float> y(2 * rows * 16);
  for (uint64_t h = 0; h < 2; ++h) {
    ASSERT_TRUE(EncodeRows(b, h, x.data(), rows, rec.data() + h * rows * 5).ok());
    ASSERT_TRUE(DecodeRows(b, h, rec.data() + h * rows * 5, rows, y.data() + h * rows * 16).ok());
  }
  EXPECT_EQ(Hex(rec.data(), 10), "82c04fa61a76cdb8e512");
  EXPECT_EQ(Hex(rec.data() + rows * 5, 10), "ef3da9b7194caa875716");
  EXPECT_EQ(absl::StrFormat("%016x", Fnv(rec.data(), rec.size())), "c5099cbb23545517");
  EXPECT_EQ(absl::StrFormat("%016x", Fnv(y.data(), y.size() * 4)), "9902d5a8afbd93b8");
  // Padding bits are zero.
  for (uint64_t r = 0; r < 2 * rows; ++r) EXPECT_EQ(rec[r * 5 + 4] >> 5, 0) << r;
}

TEST(PqRecords, NonzeroPaddingAndBadHeadsAreRefused) {
  const Basis b = FixtureBasis();
  const std::vector<float> x = FixtureRows(1, 16);
  uint8_t rec[5];
  ASSERT_TRUE(EncodeRows(b, 0, x.data(), 1, rec).ok());
  rec[4] |= 0x80;
  float y[16];
  EXPECT_EQ(DecodeRows(b, 0, rec, 1, y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeRows(b, 2, x.data(), 1, rec).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeRows(b, 7, rec, 1, y).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> bad = x;
  bad[3] = std::nanf("");
  EXPECT_EQ(EncodeRows(b, 0, bad.data(), 1, rec).code(), absl::StatusCode::kInvalidArgument);
  bad[3] = INFINITY;
  EXPECT_EQ(EncodeRows(b, 0, bad.data(), 1, rec).code(), absl::StatusCode::kInvalidArgument);
}

// Rows of a cache's dtype on several threads: the same records as the f32 rows of the same
// values on one thread; decoding to bf16 rounds the f32 decode.
TEST(PqRecords, CacheDTypesAndThreadsGiveTheSameBytes) {
  const Basis b = FixtureBasis();
  const uint64_t rows = 2000;
  const std::vector<float> x = FixtureRows(rows, 16);
  std::vector<uint16_t> xb(x.size());
  std::vector<float> xr(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    xb[i] = FloatToBf16(x[i]);
    xr[i] = Bf16ToFloat(xb[i]);
  }
  std::vector<uint8_t> want(rows * 5), got(rows * 5);
  ASSERT_TRUE(EncodeRows(b, 1, xr.data(), rows, want.data()).ok());
  for (int threads : {1, 4, 0}) {
    std::fill(got.begin(), got.end(), 0xAA);
    ASSERT_TRUE(EncodeRows(b, 1, xb.data(), DType::kBF16, rows, got.data(), threads).ok());
    EXPECT_EQ(got, want) << threads;
    ASSERT_TRUE(EncodeRows(b, 1, xr.data(), DType::kF32, rows, got.data(), threads).ok());
    EXPECT_EQ(got, want) << threads;
  }
  std::vector<float> y(rows * 16);
  ASSERT_TRUE(DecodeRows(b, 1, want.data(), rows, y.data()).ok());
  std::vector<uint16_t> yb(rows * 16);
  ASSERT_TRUE(DecodeRows(b, 1, want.data(), rows, yb.data(), DType::kBF16, 4).ok());
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(yb[i], FloatToBf16(y[i])) << i;
  std::vector<float> yf(rows * 16);
  ASSERT_TRUE(DecodeRows(b, 1, want.data(), rows, yf.data(), DType::kF32, 0).ok());
  EXPECT_EQ(yf, y);
  // a bad row in a later block names its row; other dtypes are refused
  std::vector<float> bad = xr;
  bad[1500 * 16 + 2] = NAN;
  auto st = EncodeRows(b, 1, bad.data(), DType::kF32, rows, got.data(), 4);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not finite"), std::string::npos) << st;
  EXPECT_EQ(EncodeRows(b, 1, xr.data(), DType::kInt8, rows, got.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeRows(b, 1, want.data(), rows, yf.data(), DType::kInt8).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PqBasis, SerializeParseRoundTripAndChecks) {
  const Basis b = FixtureBasis();
  const std::string s = b.Serialize();
  ASSERT_EQ(s.size(), 32u + 2 * (4 * 16 * (3 + 16) + 16));
  auto p = Basis::Parse(s);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->Serialize(), s);
  EXPECT_EQ(p->Fingerprint(), b.Fingerprint());
  // truncated, extended, damaged payload: DataLoss
  EXPECT_EQ(Basis::Parse(s.substr(0, 20)).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(Basis::Parse(s.substr(0, s.size() - 1)).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(Basis::Parse(s + "x").status().code(), absl::StatusCode::kDataLoss);
  std::string d = s;
  d[100] ^= 1;
  EXPECT_EQ(Basis::Parse(d).status().code(), absl::StatusCode::kDataLoss);
  // another magic, version, reserved byte: InvalidArgument
  d = s;
  d[0] = 'X';
  EXPECT_EQ(Basis::Parse(d).status().code(), absl::StatusCode::kInvalidArgument);
  d = s;
  d[4] = 2;
  EXPECT_EQ(Basis::Parse(d).status().code(), absl::StatusCode::kInvalidArgument);
  d = s;
  d[6] = 1;
  EXPECT_EQ(Basis::Parse(d).status().code(), absl::StatusCode::kInvalidArgument);
  // a valid fingerprint over content Validate() refuses (widths not summing to bits_total)
  Basis w = b;
  w.widths[0] = 7;
  auto q = Basis::Parse(w.Serialize());
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(q.status().message().find("widths sum"), std::string::npos) << q.status();
  w = b;
  w.scale[2] = 0;
  EXPECT_EQ(w.Validate().code(), absl::StatusCode::kInvalidArgument);
  w = b;
  w.basis[5] = INFINITY;
  EXPECT_EQ(w.Validate().code(), absl::StatusCode::kInvalidArgument);
  w = b;
  w.widths[9] = 9;
  EXPECT_EQ(w.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// Calibration on Gaussian rows with a steep spectrum in a random rotation: the basis recovers
// the spectrum, the widths sum to bits_total and fall with the variance, and the decoded rows'
// error is near what the water-filling predicts.
TEST(PqFit, SteepSpectrumIsCodedNearTheWaterFillingError) {
  const uint32_t L = 1, H = 2, d = 32, bits = 2 * d;
  const uint64_t n = 4000;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nd;
  // a random orthonormal rotation per head (Gram-Schmidt)
  std::vector<float> rows(L * H * n * d);
  std::vector<double> sd(d);
  for (uint32_t i = 0; i < d; ++i) sd[i] = 4.0 * std::pow(0.8, i);
  std::vector<std::vector<double>> rot(H, std::vector<double>(d * d));
  for (uint32_t h = 0; h < H; ++h) {
    auto& R = rot[h];
    for (double& v : R) v = nd(rng);
    for (uint32_t i = 0; i < d; ++i) {
      for (uint32_t k = 0; k < i; ++k) {
        double dot = 0;
        for (uint32_t j = 0; j < d; ++j) dot += R[i * d + j] * R[k * d + j];
        for (uint32_t j = 0; j < d; ++j) R[i * d + j] -= dot * R[k * d + j];
      }
      double nr = 0;
      for (uint32_t j = 0; j < d; ++j) nr += R[i * d + j] * R[i * d + j];
      for (uint32_t j = 0; j < d; ++j) R[i * d + j] /= std::sqrt(nr);
    }
    for (uint64_t r = 0; r < n; ++r) {
      std::vector<double> z(d);
      for (uint32_t i = 0; i < d; ++i) z[i] = sd[i] * nd(rng);
      for (uint32_t j = 0; j < d; ++j) {
        double v = 1.5 * (h + 1);  // a mean
        for (uint32_t i = 0; i < d; ++i) v += z[i] * R[i * d + j];
        rows[(h * n + r) * d + j] = static_cast<float>(v);
      }
    }
  }
  auto fit = Fit(rows, n, L, H, d, bits);
  ASSERT_TRUE(fit.ok()) << fit.status();
  const Basis& b = *fit;
  ASSERT_EQ(b.RecordBytes(), 8u);
  for (uint32_t h = 0; h < H; ++h) {
    uint32_t sum = 0;
    double predicted = 0, total = 0;
    for (uint32_t c = 0; c < d; ++c) {
      sum += b.widths[h * d + c];
      if (c > 0) {
        EXPECT_LE(b.widths[h * d + c], b.widths[h * d + c - 1]);
      }
      EXPECT_NEAR(b.scale[h * d + c] / sd[c], 1.0, 0.1) << h << " " << c;
      predicted += sd[c] * sd[c] * GaussianDistortion(b.widths[h * d + c]);
      total += sd[c] * sd[c];
    }
    EXPECT_EQ(sum, bits);
    EXPECT_NEAR(b.mean[h * d + 3], 1.5 * (h + 1), 0.3);
    std::vector<uint8_t> rec(n * 8);
    std::vector<float> y(n * d);
    const float* x = rows.data() + h * n * d;
    ASSERT_TRUE(EncodeRows(b, h, x, n, rec.data()).ok());
    ASSERT_TRUE(DecodeRows(b, h, rec.data(), n, y.data()).ok());
    double err = 0;
    for (uint64_t i = 0; i < n * d; ++i) err += (y[i] - x[i]) * (y[i] - x[i]);
    err /= n;
    EXPECT_LT(err, 1.3 * predicted) << "head " << h;
    EXPECT_LT(err / total, 0.05);  // against 0.117 for 2 bits on every component alike
  }
  // the fitted basis serializes and parses
  auto p = Basis::Parse(b.Serialize());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->Fingerprint(), b.Fingerprint());
}

TEST(PqFit, BadInputIsRefused) {
  std::vector<float> rows(2 * 8, 1.0f);
  EXPECT_EQ(Fit(rows, 2, 1, 1, 8, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Fit(rows, 2, 1, 1, 8, 65).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Fit(rows, 1, 1, 1, 8, 8).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Fit(rows, 3, 1, 1, 8, 8).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Fit(rows, 2, 1, 1, 0, 8).status().code(), absl::StatusCode::kInvalidArgument);
  rows[5] = std::nanf("");
  EXPECT_EQ(Fit(rows, 2, 1, 1, 8, 8).status().code(), absl::StatusCode::kInvalidArgument);
  // constant rows: every variance 0, still a valid basis (decodes to the mean)
  std::vector<float> flat(4 * 8, 2.5f);
  auto b = Fit(flat, 4, 1, 1, 8, 8);
  ASSERT_TRUE(b.ok()) << b.status();
  uint8_t rec[1];
  float y[8];
  ASSERT_TRUE(EncodeRows(*b, 0, flat.data(), 1, rec).ok());
  ASSERT_TRUE(DecodeRows(*b, 0, rec, 1, y).ok());
  for (float v : y) EXPECT_NEAR(v, 2.5f, 1e-5f);
}

}  // namespace
}  // namespace pq
}  // namespace kvcomp
