// KVSplice codec on the CPU backend: int4 packing, quantization bounds, poisoned outputs, keys,
// whole-cache encode/decode through the format, and the missing-projection errors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec_test_util.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/kernels/projection.h"

namespace kvcomp {
namespace {

std::unique_ptr<Backend> Cpu() {
  auto b = MakeCpuBackend(CpuBackendOptions{2});
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b);
}

// A sealed projection of `heads` heads whose basis is `rows` rows of a random orthonormal basis
// (or the identity) and gamma as given (1 by default).
Projection MakeProjection(uint32_t layers, uint32_t kv, uint32_t d, uint32_t rows, bool identity,
                          uint64_t seed, float gamma_decay = 1.0f) {
  Projection p;
  p.model_id = "test";
  p.num_layers = layers;
  p.num_kv_heads = kv;
  p.head_dim = d;
  p.rows = rows;
  std::mt19937_64 rng(seed);
  for (uint64_t h = 0; h < p.num_heads(); ++h) {
    std::vector<double> b = testing::RandomBasis(d, rng);
    for (uint32_t j = 0; j < rows; ++j) {
      for (uint32_t k = 0; k < d; ++k) {
        p.basis.push_back(identity ? (j == k ? 1.0f : 0.0f)
                                   : static_cast<float>(b[uint64_t{j} * d + k]));
      }
      p.gamma.push_back(std::pow(gamma_decay, static_cast<float>(j)));
    }
    for (uint32_t j = 0; j < d; ++j) p.eigenvalues.push_back(1.0f);
  }
  EXPECT_TRUE(p.Seal().ok());
  return p;
}

// A projection of `rows` rows calibrated on every layer of `values` (reservoir and query sample
// sizes as Calibrator::Create takes them).
absl::StatusOr<Projection> CalibratedOn(Backend* be, const testing::LowRankData& data,
                                        const std::vector<float>& values, uint32_t rows,
                                        uint32_t samples = 0, uint32_t queries = 0) {
  KVCOMP_ASSIGN_OR_RETURN(
      auto cal,
      Calibrator::Create({"m", data.layers, data.heads, data.d, samples, queries, 0}, be));
  for (uint32_t l = 0; l < data.layers; ++l) {
    KVCOMP_RETURN_IF_ERROR(cal.AddLayer(l, data.LayerView(values, l)));
  }
  return cal.Finish(rows);
}

RowSpan Span(const std::vector<uint64_t>& offsets, uint64_t first_head = 0) {
  RowSpan r;
  r.first_head = first_head;
  r.row_offsets = offsets;
  return r;
}

TEST(CodecCpu, Int4UnpacksEveryByteValue) {
  auto be = Cpu();
  const uint32_t d = 64;
  Projection p = MakeProjection(1, 1, d, 2, /*identity=*/true, 1);
  ValueCodecParams params{ValueCodec::kOrthogonalInt4, 2, 32, false};
  std::vector<uint8_t> latent(256);
  for (int b = 0; b < 256; ++b) latent[b] = static_cast<uint8_t>(b);
  std::vector<uint16_t> scales(256, FloatToHalf(1.0f));
  std::vector<uint64_t> off = {0, 256};
  std::vector<float> out(256 * d, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(be->codec()
                  .DecodeValues(p, params, Span(off), latent.data(), scales.data(), out.data(),
                                DType::kF32)
                  .ok());
  for (int b = 0; b < 256; ++b) {
    const int lo = (b & 15) >= 8 ? (b & 15) - 16 : (b & 15);
    const int hi = (b >> 4) >= 8 ? (b >> 4) - 16 : (b >> 4);
    EXPECT_EQ(out[b * d + 0], static_cast<float>(lo)) << b;
    EXPECT_EQ(out[b * d + 1], static_cast<float>(hi)) << b;
    for (uint32_t k = 2; k < d; ++k) ASSERT_EQ(out[b * d + k], 0.0f);
  }
}

TEST(CodecCpu, Int4RoundTripsEveryValueAndPacksLowNibbleFirst) {
  auto be = Cpu();
  const uint32_t d = 64, r = 32;
  Projection p = MakeProjection(1, 1, d, r, /*identity=*/true, 1);
  ValueCodecParams params{ValueCodec::kOrthogonalInt4, r, 16, false};
  // Rows: every ordered pair (a, b) of int4 values in [-7, 7] at latent positions (0, 1), and a
  // 7 at position 2 and 16 so each group's scale is exactly 0.5.
  std::vector<float> v;
  std::vector<std::pair<int, int>> pairs;
  for (int a = -7; a <= 7; ++a) {
    for (int b = -7; b <= 7; ++b) {
      pairs.push_back({a, b});
      std::vector<float> row(d, 0.0f);
      row[0] = 0.5f * a;
      row[1] = 0.5f * b;
      row[2] = 3.5f;
      row[16] = -3.5f;
      v.insert(v.end(), row.begin(), row.end());
    }
  }
  const uint64_t n = pairs.size();
  std::vector<uint64_t> off = {0, n};
  std::vector<uint8_t> latent(n * params.LatentBytes(), 0xAB);
  std::vector<uint16_t> scales(n * params.Groups(), 0xFFFF);
  ASSERT_TRUE(be->codec()
                  .EncodeValues(p, params, Span(off), v.data(), DType::kF32, latent.data(),
                                scales.data())
                  .ok());
  std::vector<float> out(n * d, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(be->codec()
                  .DecodeValues(p, params, Span(off), latent.data(), scales.data(), out.data(),
                                DType::kF32)
                  .ok());
  for (uint64_t i = 0; i < n; ++i) {
    const auto [a, b] = pairs[i];
    EXPECT_EQ(latent[i * 16], static_cast<uint8_t>((a & 15) | ((b & 15) << 4))) << a << " " << b;
    EXPECT_EQ(scales[i * 2], FloatToHalf(0.5f));
    for (uint32_t k = 0; k < d; ++k) {
      const float want = k < r ? v[i * d + k] : 0.0f;  // rows beyond the rank are dropped
      ASSERT_EQ(out[i * d + k], want) << i << " " << k;
    }
  }
}

// Full rank: V' - V = sum_j e_j gamma_j p_j, so e_j = ((V' - V) . p_j) / gamma_j is the latent
// quantization error, which must be within half the group's f16 scale.
void CheckQuantizationBound(ValueCodec codec, uint32_t group, bool gamma_aware, DType dtype) {
  auto be = Cpu();
  const uint32_t d = 64;
  Projection p = MakeProjection(1, 2, d, d, /*identity=*/false, 7, 0.95f);
  ValueCodecParams params{codec, d, group, gamma_aware};
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const uint64_t n0 = 70, n1 = 33, n = n0 + n1;
  std::vector<float> vf(n * d);
  for (auto& x : vf) x = nd(rng);
  std::vector<uint16_t> v16(n * d);
  for (size_t i = 0; i < vf.size(); ++i) {
    if (dtype == DType::kBF16) {
      v16[i] = FloatToBf16(vf[i]);
      vf[i] = Bf16ToFloat(v16[i]);
    } else if (dtype == DType::kF16) {
      v16[i] = FloatToHalf(vf[i]);
      vf[i] = HalfToFloat(v16[i]);
    }
  }
  const void* in = dtype == DType::kF32 ? static_cast<const void*>(vf.data()) : v16.data();
  std::vector<uint64_t> off = {0, n0, n};
  std::vector<uint8_t> latent(n * params.LatentBytes());
  std::vector<uint16_t> scales(n * params.Groups());
  ASSERT_TRUE(
      be->codec().EncodeValues(p, params, Span(off), in, dtype, latent.data(), scales.data()).ok());
  std::vector<float> out(n * d, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(be->codec()
                  .DecodeValues(p, params, Span(off), latent.data(), scales.data(), out.data(),
                                DType::kF32)
                  .ok());
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t h = i < n0 ? 0 : 1;
    for (uint32_t j = 0; j < d; ++j) {
      const float* pj = p.head_basis(h) + uint64_t{j} * d;
      double e = 0;
      for (uint32_t k = 0; k < d; ++k) e += (double{out[i * d + k]} - vf[i * d + k]) * pj[k];
      const double g = gamma_aware ? p.head_gamma(h)[j] : 1.0;
      const double s = HalfToFloat(scales[i * params.Groups() + j / group]);
      ASSERT_LE(std::fabs(e / g), 0.5 * s * (1 + 1e-3) + 1e-5)
          << "row " << i << " latent " << j << " scale " << s;
    }
  }
}

TEST(CodecCpu, Int8ErrorWithinHalfGroupScale) {
  CheckQuantizationBound(ValueCodec::kOrthogonalInt8, 32, false, DType::kF32);
  CheckQuantizationBound(ValueCodec::kOrthogonalInt8, 32, true, DType::kBF16);
  CheckQuantizationBound(ValueCodec::kOrthogonalInt8, 7, true, DType::kF16);
}

TEST(CodecCpu, Int4ErrorWithinHalfGroupScale) {
  CheckQuantizationBound(ValueCodec::kOrthogonalInt4, 32, false, DType::kF32);
  CheckQuantizationBound(ValueCodec::kOrthogonalInt4, 16, true, DType::kBF16);
}

TEST(CodecCpu, EncodeAndDecodeOverwritePoisonedOutputs) {
  auto be = Cpu();
  const uint32_t d = 128;
  Projection p = MakeProjection(2, 2, d, 96, false, 9, 0.97f);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  for (ValueCodec codec : {ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                           ValueCodec::kOrthogonalInt4}) {
    ValueCodecParams params{codec, 96, 32, true};
    // Heads 1..3 of the projection (first_head 1), one of them empty.
    std::vector<uint64_t> off = {0, 100, 100, 165};
    const uint64_t n = off.back();
    std::vector<float> v(n * d);
    for (auto& x : v) x = nd(rng);
    std::vector<std::vector<uint8_t>> lat(2, std::vector<uint8_t>(n * params.LatentBytes()));
    std::vector<std::vector<uint16_t>> sc(2, std::vector<uint16_t>(n * params.Groups() + 1));
    for (int t = 0; t < 2; ++t) {
      std::fill(lat[t].begin(), lat[t].end(), t == 0 ? 0x00 : 0xFF);
      std::fill(sc[t].begin(), sc[t].end(), t == 0 ? 0x0000 : 0xFFFF);
      ASSERT_TRUE(be->codec()
                      .EncodeValues(p, params, Span(off, 1), v.data(), DType::kF32,
                                    lat[t].data(), sc[t].data())
                      .ok());
    }
    EXPECT_EQ(lat[0], lat[1]) << ValueCodecName(codec);
    for (uint64_t i = 0; i < n * params.Groups(); ++i) ASSERT_EQ(sc[0][i], sc[1][i]);
    for (DType out_dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      std::vector<uint8_t> out(DTypeBytes(out_dtype, n * d), 0xFF);  // NaN in every dtype
      ASSERT_TRUE(be->codec()
                      .DecodeValues(p, params, Span(off, 1), lat[0].data(), sc[0].data(),
                                    out.data(), out_dtype)
                      .ok());
      for (uint64_t i = 0; i < n * d; ++i) {
        ASSERT_TRUE(std::isfinite(LoadAsFloat(out.data(), out_dtype, i)))
            << ValueCodecName(codec) << " " << DTypeName(out_dtype) << " element " << i;
      }
    }
  }
}

TEST(CodecCpu, KeysRawFp16Int8) {
  auto be = Cpu();
  const uint32_t d = 64;
  std::vector<uint64_t> off = {0, 40, 40, 77};
  const uint64_t n = off.back();
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<uint16_t> k(n * d);
  for (auto& x : k) x = FloatToBf16(nd(rng));
  // raw: the same bits back; fp16: FloatToHalf of each element.
  std::vector<uint16_t> raw(n * d, 0xFFFF);
  ASSERT_TRUE(be->codec()
                  .EncodeKeys(KeyCodec::kRaw, Span(off), d, k.data(), DType::kBF16, raw.data(),
                              nullptr)
                  .ok());
  EXPECT_EQ(raw, k);
  std::vector<uint16_t> h(n * d, 0xFFFF);
  ASSERT_TRUE(be->codec()
                  .EncodeKeys(KeyCodec::kFp16, Span(off), d, k.data(), DType::kBF16, h.data(),
                              nullptr)
                  .ok());
  for (uint64_t i = 0; i < n * d; ++i) ASSERT_EQ(h[i], FloatToHalf(Bf16ToFloat(k[i])));
  std::vector<int8_t> q(n * d);
  std::vector<float> scales(3 * d, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(be->codec()
                  .EncodeKeys(KeyCodec::kInt8, Span(off), d, k.data(), DType::kBF16, q.data(),
                              scales.data())
                  .ok());
  for (uint32_t c = 0; c < d; ++c) EXPECT_EQ(scales[d + c], 0.0f);  // the empty head
  std::vector<float> back(n * d, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(be->codec()
                  .DecodeKeys(KeyCodec::kInt8, Span(off), d, q.data(), DType::kBF16,
                              scales.data(), back.data(), DType::kF32)
                  .ok());
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t head = i < 40 ? 0 : 2;
    for (uint32_t c = 0; c < d; ++c) {
      const float s = scales[head * d + c];
      ASSERT_LE(std::fabs(back[i * d + c] - Bf16ToFloat(k[i * d + c])), 0.5f * s * 1.0001f);
    }
  }
}

// int4 keys: per (head, group of kKeyInt4GroupRows rows, channel) scale max |k| / 7, the scales
// of a head's groups in order, heads in order (an empty head has none), two channels per byte
// (low nibble first), every element back within half its group's scale.
TEST(CodecCpu, Int4KeysScalePerGroupOfRows) {
  auto be = Cpu();
  for (uint32_t d : {64u, 7u}) {
    SCOPED_TRACE(d);
    const std::vector<uint64_t> off = {0, 300, 300, 555};  // 3 groups, none, 2 groups
    const uint64_t n = off.back(), nb = (d + 1) / 2;
    ASSERT_EQ(KeyScaleGroups(KeyCodec::kInt4, 300), 3u);
    ASSERT_EQ(KeyScaleGroups(KeyCodec::kInt4, 0), 0u);
    std::mt19937_64 rng(13);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::vector<uint16_t> k(n * d);
    for (uint64_t i = 0; i < n * d; ++i) {
      // the group of rows 256..299 of head 0 is ten times louder: its own scales follow it
      k[i] = FloatToBf16(nd(rng) * (i / d >= 256 && i / d < 300 ? 10.0f : 1.0f));
    }
    std::vector<uint8_t> q(n * nb, 0xEE);
    std::vector<float> scales(5 * d, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(be->codec()
                    .EncodeKeys(KeyCodec::kInt4, Span(off), d, k.data(), DType::kBF16, q.data(),
                                scales.data())
                    .ok());
    // group g of the call: rows [begin, end)
    const std::vector<std::pair<uint64_t, uint64_t>> groups = {
        {0, 128}, {128, 256}, {256, 300}, {300, 428}, {428, 555}};
    for (size_t g = 0; g < groups.size(); ++g) {
      for (uint32_t c = 0; c < d; ++c) {
        float m = 0.0f;
        for (uint64_t r = groups[g].first; r < groups[g].second; ++r) {
          m = std::fmax(m, std::fabs(Bf16ToFloat(k[r * d + c])));
        }
        ASSERT_EQ(scales[g * d + c], m / 7.0f) << "group " << g << " channel " << c;
      }
    }
    for (uint64_t r = 0; r < n; ++r) {
      const uint64_t g = std::find_if(groups.begin(), groups.end(),
                                      [&](auto gr) { return r < gr.second; }) - groups.begin();
      for (uint32_t c = 0; c < d; ++c) {
        const uint8_t byte = q[r * nb + c / 2];
        const int nib = c % 2 == 0 ? byte & 15 : byte >> 4;
        const int want = static_cast<int>(
            std::nearbyint(Bf16ToFloat(k[r * d + c]) / scales[g * d + c]));
        ASSERT_EQ(nib, want & 15) << "row " << r << " channel " << c;
      }
      if (d % 2 == 1) {
        ASSERT_EQ(q[r * nb + nb - 1] >> 4, 0) << "odd head_dim: high nibble 0";
      }
    }
    for (DType out_dtype : {DType::kF32, DType::kBF16}) {
      std::vector<uint8_t> back(DTypeBytes(out_dtype, n * d), 0xFF);
      ASSERT_TRUE(be->codec()
                      .DecodeKeys(KeyCodec::kInt4, Span(off), d, q.data(), DType::kBF16,
                                  scales.data(), back.data(), out_dtype)
                      .ok());
      for (uint64_t r = 0; r < n; ++r) {
        const uint64_t g = std::find_if(groups.begin(), groups.end(),
                                        [&](auto gr) { return r < gr.second; }) - groups.begin();
        for (uint32_t c = 0; c < d; ++c) {
          const float got = LoadAsFloat(back.data(), out_dtype, r * d + c);
          const float tol = 0.5f * scales[g * d + c] * 1.0001f +
                            (out_dtype == DType::kBF16 ? std::fabs(got) / 128.0f : 0.0f);
          ASSERT_LE(std::fabs(got - Bf16ToFloat(k[r * d + c])), tol) << r << " " << c;
        }
      }
    }
    // A missing scale buffer is an error, not a crash.
    EXPECT_EQ(be->codec()
                  .EncodeKeys(KeyCodec::kInt4, Span(off), d, k.data(), DType::kBF16, q.data(),
                              nullptr)
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(be->codec()
                  .DecodeKeys(KeyCodec::kInt4, Span(off), d, q.data(), DType::kBF16, nullptr,
                              scales.data(), DType::kF32)
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(be->codec()
                .EncodeKeys(static_cast<KeyCodec>(4), Span({0, 1}), 64, nullptr, DType::kBF16,
                            nullptr, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// The encoder's arithmetic as codec_ops.h states it, written out with std::fma: each latent a
// chain of fused multiply-adds over the channels in order, divided by gamma; the outlier measure
// chains of squares. The backend (whatever ISA build the CPU takes) gives the same bits, for
// the whole cache at per-layer ranks (EncodeValueLayers) and per call (EncodeValues,
// ValueResiduals); the CUDA backend is held to the same bits by codec_cuda_test.
TEST(CodecCpu, EncoderFollowsTheFusedMultiplyAddChainBitForBit) {
  auto be = Cpu();
  const uint32_t layers = 2, kv = 2, d = 64;
  const Projection p = MakeProjection(layers, kv, d, d, false, 5, 0.9f);
  const std::vector<uint64_t> off = {0, 37, 37, 101, 230};
  const uint64_t n = off.back();
  std::mt19937_64 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n * d);
  for (auto& x : v) x = nd(rng);
  const std::vector<uint32_t> ranks = {24, 40};
  ValueCodecParams params{ValueCodec::kOrthogonalInt8, 40, 16, true};
  // Reference, row by row.
  std::vector<uint8_t> want_lat;
  std::vector<uint16_t> want_sc;
  std::vector<float> want_e(n), want_l(n);
  for (uint32_t l = 0; l < layers; ++l) {
    ValueCodecParams lp = params;
    lp.rank = ranks[l];
    for (uint32_t h = l * kv; h < (l + 1) * kv; ++h) {
      const float* basis = p.head_basis(h);
      const float* gamma = p.head_gamma(h);
      for (uint64_t i = off[h]; i < off[h + 1]; ++i) {
        const float* row = v.data() + i * d;
        float e = 0.0f, pp = 0.0f;
        for (uint32_t k = 0; k < d; ++k) e = std::fma(row[k], row[k], e);
        std::vector<float> z(lp.rank);
        for (uint32_t j = 0; j < lp.rank; ++j) {
          float acc = 0.0f;
          for (uint32_t k = 0; k < d; ++k) acc = std::fma(row[k], basis[j * d + k], acc);
          pp = std::fma(acc, acc, pp);
          z[j] = acc / gamma[j];
        }
        want_e[i] = e;
        want_l[i] = e - pp > 0.0f ? e - pp : 0.0f;
        const int g = static_cast<int>(lp.Groups());
        for (int gi = 0; gi < g; ++gi) {
          float m = 0.0f;
          for (uint32_t j = gi * lp.group_size; j < std::min(lp.rank, (gi + 1) * lp.group_size);
               ++j) {
            m = std::fmax(m, std::fabs(z[j]));
          }
          const float s = m / 127.0f;
          uint16_t hs = s > 0.0f ? FloatToHalf(s) : 0;
          if (s > 0.0f && HalfToFloat(hs) < s) ++hs;
          want_sc.push_back(hs);
          for (uint32_t j = gi * lp.group_size; j < std::min(lp.rank, (gi + 1) * lp.group_size);
               ++j) {
            const float q = hs == 0 ? 0.0f
                                    : std::fmin(std::fmax(z[j] / HalfToFloat(hs), -127.0f), 127.0f);
            want_lat.push_back(static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(q))));
          }
        }
      }
    }
  }
  std::vector<uint8_t> lat(want_lat.size(), 0xCD);
  std::vector<uint16_t> sc(want_sc.size(), 0xFFFF);
  std::vector<float> e(n, -1.0f), lost(n, -1.0f);
  ASSERT_TRUE(be->codec()
                  .EncodeValueLayers(p, params, ranks, off, v.data(), DType::kF32, lat.data(),
                                     sc.data(), e.data(), lost.data())
                  .ok());
  EXPECT_EQ(lat, want_lat);
  EXPECT_EQ(sc, want_sc);
  EXPECT_EQ(std::memcmp(e.data(), want_e.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(lost.data(), want_l.data(), n * 4), 0);
  // Layer 1 alone through EncodeValues and ValueResiduals: the same bytes.
  RowSpan l1;
  l1.first_head = kv;
  const std::vector<uint64_t> off1 = {0, 64, 193};
  l1.row_offsets = off1;
  ValueCodecParams p1 = params;
  p1.rank = ranks[1];
  const uint64_t lat0 = 37 * 24, sc0 = 37 * 2;
  std::vector<uint8_t> lat1(193 * p1.LatentBytes());
  std::vector<uint16_t> sc1(193 * p1.Groups());
  ASSERT_TRUE(be->codec()
                  .EncodeValues(p, p1, l1, v.data() + 37 * d, DType::kF32, lat1.data(),
                                sc1.data())
                  .ok());
  EXPECT_TRUE(std::equal(lat1.begin(), lat1.end(), want_lat.begin() + lat0));
  EXPECT_TRUE(std::equal(sc1.begin(), sc1.end(), want_sc.begin() + sc0));
  std::vector<float> e1(193), x1(193);
  ASSERT_TRUE(
      be->codec().ValueResiduals(p, ranks[1], l1, v.data() + 37 * d, DType::kF32, e1.data(),
                                 x1.data())
          .ok());
  EXPECT_EQ(std::memcmp(x1.data(), want_l.data() + 37, 193 * 4), 0);
  // Bad calls are errors.
  EXPECT_FALSE(be->codec()
                   .EncodeValueLayers(p, params, {24}, off, v.data(), DType::kF32, lat.data(),
                                      sc.data(), nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(be->codec()
                   .EncodeValueLayers(p, params, {24, 48}, off, v.data(), DType::kF32,
                                      lat.data(), sc.data(), nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(be->codec()
                   .EncodeValueLayers(p, params, ranks, {0, 5, 9}, v.data(), DType::kF32,
                                      lat.data(), sc.data(), nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(be->codec()
                   .EncodeValueLayers(p, params, ranks, off, v.data(), DType::kF32, lat.data(),
                                      sc.data(), e.data(), nullptr)
                   .ok());
}

TEST(CodecCpu, RejectsBadParameters) {
  auto be = Cpu();
  Projection p = MakeProjection(1, 2, 64, 32, false, 1);
  std::vector<uint64_t> off = {0, 4, 8};
  std::vector<float> v(8 * 64, 1.0f);
  std::vector<uint8_t> lat(8 * 128);
  std::vector<uint16_t> sc(8 * 8);
  auto enc = [&](ValueCodecParams params, const Projection& proj, std::vector<uint64_t> o) {
    return be->codec()
        .EncodeValues(proj, params, Span(o), v.data(), DType::kF32, lat.data(), sc.data())
        .code();
  };
  const auto kBad = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(enc({ValueCodec::kOrthogonalInt8, 33, 32, true}, p, off), kBad);  // rank > rows
  EXPECT_EQ(enc({ValueCodec::kOrthogonalInt4, 31, 32, true}, p, off), kBad);  // odd int4 rank
  EXPECT_EQ(enc({ValueCodec::kRaw, 16, 32, true}, p, off), kBad);
  EXPECT_EQ(enc({ValueCodec::kOrthogonalInt8, 16, 0, true}, p, off), kBad);
  EXPECT_EQ(enc({ValueCodec::kOrthogonalInt8, 16, 32, true}, p, {0, 4, 8, 8}), kBad);  // 3 heads
  EXPECT_EQ(enc({ValueCodec::kOrthogonalInt8, 16, 32, true}, p, {0, 5, 4}), kBad);
  Projection unsealed = p;
  unsealed.version = 0;
  EXPECT_EQ(enc({ValueCodec::kOrthogonalInt8, 16, 32, true}, unsealed, off), kBad);
  EXPECT_TRUE(enc({ValueCodec::kOrthogonalInt8, 16, 32, true}, p, off) == absl::StatusCode::kOk);
}

// A raw cache of real values: every head keeps a random subset of `tokens` tokens.
CompressedCache RawCache(const testing::LowRankData& data, const std::vector<float>& values,
                         const std::vector<float>& keys, DType dtype, uint64_t seed) {
  CompressedCache c;
  KvLayout layout{data.layers, data.heads, data.heads * 2, data.d, dtype};
  c.has_moments = false;
  c.Reset(layout, data.tokens);
  std::mt19937_64 rng(seed);
  for (uint64_t h = 0; h < c.num_heads(); ++h) {
    uint32_t kept = 0;
    for (uint32_t t = 0; t < data.tokens; ++t) {
      if (rng() % 3 == 0 && h != 1) continue;  // head 1 keeps everything, others ~2/3
      c.positions.push_back(t);
      ++kept;
      for (uint32_t k = 0; k < data.d; ++k) {
        const uint64_t src = (h * data.tokens + t) * data.d + k;
        const size_t at = c.values.size();
        c.values.resize(at + DTypeBytes(dtype, 1));
        c.keys.resize(at + DTypeBytes(dtype, 1));
        StoreFromFloat(c.values.data() + at, dtype, 0, values[src]);
        StoreFromFloat(c.keys.data() + at, dtype, 0, keys[src]);
      }
    }
    c.kept[h] = kept;
  }
  EXPECT_TRUE(c.Validate().ok());
  return c;
}

TEST(KvSplice, EveryPresetRoundTripsThroughTheFormat) {
  auto be = Cpu();
  testing::LowRankData data;
  data.layers = 2;
  data.heads = 2;
  data.tokens = 300;
  data.d = 64;
  data.true_rank = 24;
  const std::vector<float> values = data.Make(1), keys = data.Make(2);
  auto proj = CalibratedOn(be.get(), data, values, 64, 256, 64);
  ASSERT_TRUE(proj.ok()) << proj.status();
  InMemoryProjectionStore store;
  ASSERT_TRUE(store.Put(*proj).ok());
  const CompressedCache raw = RawCache(data, values, keys, DType::kBF16, 4);
  for (ValueCodec vc : {ValueCodec::kRaw, ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                        ValueCodec::kOrthogonalInt4}) {
    for (KeyCodec kc : {KeyCodec::kRaw, KeyCodec::kFp16, KeyCodec::kInt8, KeyCodec::kInt4}) {
      CompressionPolicy policy;
      policy.value_codec = vc;
      policy.key_codec = kc;
      CompressedCache c = raw;
      c.policy = policy;
      ASSERT_TRUE(EncodeKept(*be, policy, &*proj, &c).ok()) << ValueCodecName(vc);
      EXPECT_EQ(c.rank, vc == ValueCodec::kRaw ? 0u : DefaultRank(vc, data.d));
      EXPECT_EQ(c.projection_version, vc == ValueCodec::kRaw ? 0 : proj->version);
      EXPECT_EQ(c.value_gamma, vc == ValueCodec::kOrthogonalInt8 || vc == ValueCodec::kOrthogonalInt4);
      const CacheBytes bytes = c.Breakdown();
      EXPECT_EQ(bytes.values, c.total_kept() * c.ValueTokenBytes());
      auto encoded = format::EncodeCache(c);
      ASSERT_TRUE(encoded.ok()) << encoded.status();
      auto parsed = format::ParseCache(*encoded);
      ASSERT_TRUE(parsed.ok()) << parsed.status();
      ASSERT_TRUE(*parsed == c);
      auto dec = DecodeKept(*be, *parsed, store, "m", DType::kF32);
      ASSERT_TRUE(dec.ok()) << dec.status();
      auto ref = DecodeKept(*be, raw, nullptr, DType::kF32);
      ASSERT_TRUE(ref.ok());
      const auto* got_v = reinterpret_cast<const float*>(dec->values.data());
      const auto* want_v = reinterpret_cast<const float*>(ref->values.data());
      const auto* got_k = reinterpret_cast<const float*>(dec->keys.data());
      const auto* want_k = reinterpret_cast<const float*>(ref->keys.data());
      double ev = 0, nv = 0, ek = 0, nk = 0;
      for (uint64_t i = 0; i < c.total_kept() * data.d; ++i) {
        ev += (got_v[i] - want_v[i]) * (got_v[i] - want_v[i]);
        nv += want_v[i] * want_v[i];
        ek += (got_k[i] - want_k[i]) * (got_k[i] - want_k[i]);
        nk += want_k[i] * want_k[i];
      }
      // Rank 32..48 of a 24-rank signal keeps it; what is left is noise and quantization.
      const double max_v = vc == ValueCodec::kRaw ? 0 : vc == ValueCodec::kOrthogonalInt4 ? 0.2 : 0.05;
      const double max_k = kc == KeyCodec::kInt4   ? 0.15
                           : kc == KeyCodec::kInt8 ? 0.02
                           : kc == KeyCodec::kFp16 ? 0.003
                                                   : 0;
      EXPECT_LE(std::sqrt(ev / nv), max_v) << ValueCodecName(vc) << "/" << KeyCodecName(kc);
      EXPECT_LE(std::sqrt(ek / nk), max_k) << ValueCodecName(vc) << "/" << KeyCodecName(kc);
      EXPECT_EQ(dec->positions, raw.positions);
    }
  }
}

// The auto-tuner's per-layer ranks: each layer is encoded at its own rank (fewer bytes for the
// layers that need less), the cache round-trips through the format, and every layer decodes
// exactly as a cache encoded at that layer's rank for all layers.
TEST(KvSplice, TunedRanksGiveEachLayerItsOwnRank) {
  auto be = Cpu();
  testing::LowRankData data;
  data.layers = 3;
  data.heads = 2;
  data.tokens = 200;
  data.d = 64;
  data.true_rank = 24;
  const std::vector<float> values = data.Make(5), keys = data.Make(6);
  auto full = CalibratedOn(be.get(), data, values, 64);
  ASSERT_TRUE(full.ok()) << full.status();
  Projection tuned = *full;
  tuned.tuned_rank = {16, 48, 7};
  tuned.tuned_error = {0.01, 0.01, 0.01};
  ASSERT_TRUE(tuned.Seal().ok());
  const CompressedCache raw = RawCache(data, values, keys, DType::kF16, 7);
  const std::vector<uint64_t> off = raw.TokenOffsets();
  for (ValueCodec vc :
       {ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8, ValueCodec::kOrthogonalInt4}) {
    SCOPED_TRACE(ValueCodecName(vc));
    CompressionPolicy policy;
    policy.value_codec = vc;
    policy.key_codec = KeyCodec::kInt8;
    auto ranks = ChooseLayerRanks(policy, tuned);
    ASSERT_TRUE(ranks.ok()) << ranks.status();
    const std::vector<uint32_t> want = vc == ValueCodec::kOrthogonalInt4
                                           ? std::vector<uint32_t>{16, 48, 8}
                                           : std::vector<uint32_t>{16, 48, 7};
    EXPECT_EQ(*ranks, want);
    CompressedCache c = raw;
    ASSERT_TRUE(EncodeKept(*be, policy, &tuned, &c).ok());
    EXPECT_EQ(c.layer_rank, want);
    EXPECT_EQ(c.rank, 48u);
    uint64_t want_bytes = 0;
    for (uint64_t h = 0; h < c.num_heads(); ++h) {
      ValueCodecParams vp;
      vp.codec = vc;
      vp.rank = want[h / data.heads];
      want_bytes += uint64_t{c.kept[h]} * vp.LatentBytes();
    }
    EXPECT_EQ(c.Breakdown().values, want_bytes);
    EXPECT_LT(want_bytes, c.total_kept() * c.ValueTokenBytes());
    auto parsed = format::ParseCache(*format::EncodeCache(c));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ASSERT_TRUE(*parsed == c);
    auto dec = DecodeKept(*be, *parsed, &tuned, DType::kF32);
    ASSERT_TRUE(dec.ok()) << dec.status();
    for (uint32_t l = 0; l < data.layers; ++l) {
      CompressionPolicy at = policy;
      at.rank = want[l];
      CompressedCache u = raw;
      ASSERT_TRUE(EncodeKept(*be, at, &tuned, &u).ok());
      EXPECT_TRUE(u.layer_rank.empty());
      auto ud = DecodeKept(*be, u, &tuned, DType::kF32);
      ASSERT_TRUE(ud.ok());
      const uint64_t b0 = off[l * data.heads] * data.d * 4,
                     b1 = off[(l + 1) * data.heads] * data.d * 4;
      EXPECT_TRUE(
          std::equal(dec->values.begin() + b0, dec->values.begin() + b1, ud->values.begin() + b0))
          << "layer " << l;
    }
    EXPECT_EQ(dec->keys, DecodeKept(*be, c, &tuned, DType::kF32)->keys);
  }
  // A policy rank overrides the tuner: one rank for all layers.
  CompressionPolicy fixed;
  fixed.value_codec = ValueCodec::kOrthogonalInt8;
  fixed.rank = 20;
  EXPECT_EQ(*ChooseLayerRanks(fixed, tuned), (std::vector<uint32_t>{20, 20, 20}));
}

// KVSplice outliers: values far off the calibrated subspace (a needle's distinctive value) keep
// their raw values, bit for bit, within the per-head cap; the rest decode as before.
TEST(KvSplice, OffSubspaceValuesKeepTheirRawValues) {
  auto be = Cpu();
  testing::LowRankData data;
  data.tokens = 400;
  const std::vector<float> values = data.Make(1), keys = data.Make(2);
  auto proj = CalibratedOn(be.get(), data, values, data.d);
  ASSERT_TRUE(proj.ok()) << proj.status();
  CompressedCache raw = RawCache(data, values, keys, DType::kF16, 3);
  const std::vector<uint64_t> off = raw.TokenOffsets();
  std::mt19937_64 rng(9);
  std::normal_distribution<float> n01;
  std::vector<uint64_t> planted;
  for (uint64_t h = 0; h < raw.num_heads(); ++h) {
    for (uint64_t j = 1; j <= 3; ++j) {
      const uint64_t row = off[h] + j * raw.kept[h] / 4;
      std::vector<float> u(data.d);
      float norm = 0;
      for (float& x : u) {
        x = n01(rng);
        norm += x * x;
      }
      for (uint32_t k = 0; k < data.d; ++k) {
        StoreFromFloat(raw.values.data(), DType::kF16, row * data.d + k,
                       4.0f * u[k] / std::sqrt(norm));
      }
      planted.push_back(row);
    }
  }
  CompressionPolicy policy;
  policy.value_codec = ValueCodec::kOrthogonalInt8;
  policy.rank = 16;
  CompressedCache c = raw;
  ASSERT_TRUE(EncodeKept(*be, policy, &*proj, &c).ok());
  EXPECT_EQ(c.raw_value_rows, planted);
  EXPECT_EQ(c.Breakdown().raw_values, planted.size() * (8 + data.d * 2));
  auto parsed = format::ParseCache(*format::EncodeCache(c));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_TRUE(*parsed == c);
  auto dec = DecodeKept(*be, *parsed, &*proj, DType::kF32);
  ASSERT_TRUE(dec.ok()) << dec.status();
  auto row_error = [&](const DecodedKept& d, uint64_t row) {
    const auto* got = reinterpret_cast<const float*>(d.values.data()) + row * data.d;
    double e = 0, nn = 0;
    for (uint32_t k = 0; k < data.d; ++k) {
      const float want = LoadAsFloat(raw.values.data(), DType::kF16, row * data.d + k);
      e += (got[k] - want) * (got[k] - want);
      nn += want * want;
    }
    return std::sqrt(e / nn);
  };
  for (uint64_t row = 0; row < c.total_kept(); ++row) {
    const bool out = std::binary_search(planted.begin(), planted.end(), row);
    if (out) {
      EXPECT_EQ(row_error(*dec, row), 0.0) << row;  // f16 -> f32 is exact
    } else {
      EXPECT_LT(row_error(*dec, row), 0.25) << row;
    }
  }
  // Off: the planted rows come back as their projections, most of them lost.
  CompressionPolicy off_policy = policy;
  off_policy.value_raw_fraction = 0;
  CompressedCache plain = raw;
  ASSERT_TRUE(EncodeKept(*be, off_policy, &*proj, &plain).ok());
  EXPECT_TRUE(plain.raw_value_rows.empty());
  EXPECT_LT(plain.Breakdown().total(), c.Breakdown().total());
  auto pdec = DecodeKept(*be, plain, &*proj, DType::kF32);
  ASSERT_TRUE(pdec.ok());
  for (uint64_t row : planted) EXPECT_GT(row_error(*pdec, row), 0.5) << row;
  // The cap: one row per head (the worst), never more.
  CompressionPolicy capped = policy;
  capped.value_raw_fraction = 1.0 / 250;  // heads keep 250..400 rows here
  CompressedCache one = raw;
  ASSERT_TRUE(EncodeKept(*be, capped, &*proj, &one).ok());
  ASSERT_EQ(one.raw_value_rows.size(), raw.num_heads());
  for (uint64_t h = 0; h < raw.num_heads(); ++h) {
    const uint64_t row = one.raw_value_rows[h];
    EXPECT_TRUE(row >= off[h] && row < off[h + 1]);
    EXPECT_TRUE(std::binary_search(planted.begin(), planted.end(), row));
  }
  // A factor no row reaches never triggers.
  CompressionPolicy never = policy;
  never.value_outlier_factor = 1e9;
  CompressedCache none = raw;
  ASSERT_TRUE(EncodeKept(*be, never, &*proj, &none).ok());
  EXPECT_TRUE(none.raw_value_rows.empty());
}

TEST(KvSplice, MissingOrWrongProjectionIsAClearError) {
  auto be = Cpu();
  testing::LowRankData data;
  data.tokens = 64;
  const std::vector<float> values = data.Make(1), keys = data.Make(2);
  auto proj = CalibratedOn(be.get(), data, values, 48);
  ASSERT_TRUE(proj.ok()) << proj.status();
  CompressionPolicy policy;
  policy.value_codec = ValueCodec::kOrthogonalInt8;
  CompressedCache c = RawCache(data, values, keys, DType::kF16, 1);
  CompressedCache no_proj = c;
  EXPECT_EQ(EncodeKept(*be, policy, nullptr, &no_proj).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(EncodeKept(*be, policy, &*proj, &c).ok());

  InMemoryProjectionStore store;
  auto missing = DecodeKept(*be, c, store, "m");
  ASSERT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("not available"), std::string::npos)
      << missing.status();
  EXPECT_EQ(DecodeKept(*be, c, nullptr).status().code(), absl::StatusCode::kNotFound);
  // A recalibration (other data) is a new version; decoding through it is refused.
  auto newer = CalibratedOn(be.get(), data, keys, 48);
  ASSERT_TRUE(newer.ok());
  EXPECT_NE(newer->version, proj->version);
  ASSERT_TRUE(store.Put(*newer).ok());
  EXPECT_EQ(DecodeKept(*be, c, store, "m").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(DecodeKept(*be, c, &*newer).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store.Put(*proj).ok());
  EXPECT_TRUE(DecodeKept(*be, c, store, "m").ok());
  EXPECT_EQ(*store.Latest("m"), proj->version);
  ASSERT_TRUE(store.Delete("m", proj->version).ok());
  EXPECT_EQ(DecodeKept(*be, c, store, "m").status().code(), absl::StatusCode::kNotFound);
  // A rank above the projection's rows.
  policy.rank = 64;
  CompressedCache big = RawCache(data, values, keys, DType::kF16, 1);
  EXPECT_EQ(EncodeKept(*be, policy, &*proj, &big).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(KvSplice, CompressEncodesWithTheProjectionAndBlockWiseToo) {
  auto be = Cpu();
  testing::LowRankData data;
  data.tokens = 256;
  const std::vector<float> values = data.Make(1), keys = data.Make(2);
  auto proj = CalibratedOn(be.get(), data, values, data.d);
  ASSERT_TRUE(proj.ok()) << proj.status();
  KvCacheView view;
  view.layout = KvLayout{data.layers, data.heads, data.heads, data.d, DType::kF32};
  view.num_tokens = data.tokens;
  for (uint32_t l = 0; l < data.layers; ++l) {
    view.keys.push_back(data.LayerView(keys, l));
    view.values.push_back(data.LayerView(values, l));
  }
  CompressionPolicy policy;
  policy.ratio = 0.5;
  policy.value_codec = ValueCodec::kOrthogonalInt4;
  policy.key_codec = KeyCodec::kInt8;
  EXPECT_EQ(Compress(*be, view, policy).status().code(), absl::StatusCode::kFailedPrecondition);
  CompressOptions opt;
  opt.projection = std::make_shared<const Projection>(*proj);
  auto c = Compress(*be, view, policy, opt);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->value_codec, ValueCodec::kOrthogonalInt4);
  EXPECT_EQ(c->projection_version, proj->version);
  EXPECT_EQ(c->rank, DefaultRank(ValueCodec::kOrthogonalInt4, data.d));
  const CacheBytes bytes = c->Breakdown();
  EXPECT_EQ(bytes.values, c->total_kept() * c->rank / 2);
  EXPECT_EQ(bytes.value_scales, c->total_kept() * c->ValueGroups() * 2);
  EXPECT_EQ(bytes.key_scales, c->num_heads() * data.d * 4);
  auto dec = DecodeKept(*be, *c, proj.operator->());
  ASSERT_TRUE(dec.ok()) << dec.status();
  // Kept rows decode close to the original values at their positions.
  const auto* got = reinterpret_cast<const float*>(dec->values.data());
  double err = 0, norm = 0;
  for (uint64_t h = 0; h < c->num_heads(); ++h) {
    for (uint64_t i = dec->offsets[h]; i < dec->offsets[h + 1]; ++i) {
      for (uint32_t k = 0; k < data.d; ++k) {
        const float want = values[(h * data.tokens + dec->positions[i]) * data.d + k];
        err += (got[i * data.d + k] - want) * (got[i * data.d + k] - want);
        norm += want * want;
      }
    }
  }
  EXPECT_LT(std::sqrt(err / norm), 0.15);
  policy.block_size = 64;
  BlockCompressorOptions bo;
  bo.budget = 100;
  bo.projection = opt.projection;
  auto bc = BlockCompressor::Create(*be, view.layout, policy, bo);
  ASSERT_TRUE(bc.ok()) << bc.status();
  for (uint32_t t0 = 0; t0 < data.tokens; t0 += 64) {
    for (uint32_t l = 0; l < data.layers; ++l) {
      HeadsView k = view.keys[l], v = view.values[l];
      k.data = static_cast<const float*>(k.data) + t0 * data.d;
      v.data = static_cast<const float*>(v.data) + t0 * data.d;
      k.num_tokens = v.num_tokens = 64;
      ASSERT_TRUE((*bc)->Append(l, k, v).ok());
    }
  }
  auto blockwise = (*bc)->Finish();
  ASSERT_TRUE(blockwise.ok()) << blockwise.status();
  EXPECT_EQ(blockwise->projection_version, proj->version);
  EXPECT_TRUE(DecodeKept(*be, *blockwise, proj.operator->()).ok());
}

}  // namespace
}  // namespace kvcomp
