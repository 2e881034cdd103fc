// KVSplice on CUDA against the CPU reference: calibration (cuBLAS + cuSOLVER vs Eigen), value
// encode/decode for every codec, dtype and head_dim, keys, whole caches, device and host
// pointers, outputs poisoned first. gpu label; 77 (skipped) without a device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kernels/codec_test_util.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/kvsplice.h"

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace {

struct Backends {
  std::unique_ptr<Backend> cpu, cuda;
  Backends() {
    auto c = MakeCpuBackend(CpuBackendOptions{4});
    auto g = MakeCudaBackend();
    EXPECT_TRUE(c.ok() && g.ok()) << g.status();
    cpu = std::move(*c);
    cuda = std::move(*g);
  }
};

Projection Calibrated(Backend* be, const testing::LowRankData& data, uint32_t rows) {
  auto cal = Calibrator::Create({"m", data.layers, data.heads, data.d, 0, 0, 0}, be);
  EXPECT_TRUE(cal.ok());
  const std::vector<float> v = data.Make(1);
  for (uint32_t l = 0; l < data.layers; ++l) EXPECT_TRUE(cal->AddLayer(l, data.LayerView(v, l)).ok());
  auto p = cal->Finish(rows);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

RowSpan Span(const std::vector<uint64_t>& off) {
  RowSpan r;
  r.row_offsets = off;
  return r;
}

TEST(CodecCuda, CalibrationAgreesWithTheCpu) {
  Backends b;
  testing::LowRankData data;
  data.d = 128;
  data.true_rank = 24;
  data.tokens = 3000;
  const Projection pc = Calibrated(b.cpu.get(), data, 128);
  const Projection pg = Calibrated(b.cuda.get(), data, 128);
  for (uint64_t h = 0; h < pc.num_heads(); ++h) {
    for (uint32_t j = 0; j < data.d; ++j) {
      const float ec = pc.eigenvalues[h * data.d + j], eg = pg.eigenvalues[h * data.d + j];
      ASSERT_NEAR(eg, ec, 1e-4 * pc.eigenvalues[h * data.d] + 1e-6) << h << " " << j;
    }
    // Directions with a clear eigenvalue gap are the same vectors (signs are normalized).
    for (uint32_t j = 0; j < 16; ++j) {
      double dot = 0;
      for (uint32_t k = 0; k < data.d; ++k) {
        dot += pc.head_basis(h)[j * data.d + k] * pg.head_basis(h)[j * data.d + k];
      }
      EXPECT_NEAR(dot, 1.0, 1e-3) << "head " << h << " row " << j;
    }
  }
}

// Encodes the same host values on both backends, decodes both latents on both, compares.
void CompareCodec(Backends& b, uint32_t d, ValueCodec codec, uint32_t rank, uint32_t group,
                  bool gamma, DType dtype, uint64_t t = 700) {
  testing::LowRankData data;
  data.d = d;
  data.layers = 1;
  data.heads = 4;
  data.tokens = t;
  data.true_rank = d / 2;
  data.decay = 0.95;
  const Projection p = Calibrated(b.cpu.get(), data, rank);
  const std::vector<float> v32 = data.Make(5);
  // Ragged: heads keep t, 0, t / 2 - 17 and 1 rows (700, 0, 333, 1).
  const std::vector<uint64_t> off = {0, t, t, t + t / 2 - 17, t + t / 2 - 16};
  const uint64_t n = off.back();
  std::vector<uint8_t> in(DTypeBytes(dtype, n * d));
  const uint64_t src_row[4] = {0, 0, 2 * t, 3 * t};
  for (uint64_t h = 0, row = 0; h < 4; ++h) {
    for (uint64_t i = 0; i < off[h + 1] - off[h]; ++i, ++row) {
      for (uint32_t k = 0; k < d; ++k) {
        StoreFromFloat(in.data(), dtype, row * d + k, v32[(src_row[h] + i) * d + k]);
      }
    }
  }
  ValueCodecParams params{codec, rank, group, gamma};
  const uint64_t lb = params.LatentBytes(), g = params.Groups();
  std::vector<uint8_t> lat_c(n * lb), lat_g(n * lb, 0xCD);
  std::vector<uint16_t> sc_c(n * g + 1), sc_g(n * g + 1, 0xFFFF);
  ASSERT_TRUE(b.cpu->codec()
                  .EncodeValues(p, params, Span(off), in.data(), dtype, lat_c.data(), sc_c.data())
                  .ok());
  auto s = b.cuda->codec().EncodeValues(p, params, Span(off), in.data(), dtype, lat_g.data(),
                                        sc_g.data());
  ASSERT_TRUE(s.ok()) << s;
  // The same chain of f32 fused multiply-adds on both backends: the same bytes.
  for (uint64_t i = 0; i < n * lb; ++i) {
    ASSERT_EQ(lat_c[i], lat_g[i]) << "latent byte " << i << " (row " << i / lb << ")";
  }
  for (uint64_t i = 0; i < n * g; ++i) ASSERT_EQ(sc_c[i], sc_g[i]) << "scale " << i;
  EXPECT_EQ(sc_g[n * g], 0xFFFF);  // nothing written past the end
  // Decode the CPU latent on both, into every output dtype, outputs poisoned first.
  for (DType od : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<uint8_t> oc(DTypeBytes(od, n * d), 0xFF), og(DTypeBytes(od, n * d), 0xFF);
    ASSERT_TRUE(b.cpu->codec()
                    .DecodeValues(p, params, Span(off), lat_c.data(), sc_c.data(), oc.data(), od)
                    .ok());
    auto st = b.cuda->codec().DecodeValues(p, params, Span(off), lat_c.data(), sc_c.data(),
                                           og.data(), od);
    ASSERT_TRUE(st.ok()) << st;
    for (uint64_t i = 0; i < n; ++i) {
      double norm = 0;
      for (uint32_t k = 0; k < d; ++k) norm += std::pow(LoadAsFloat(oc.data(), od, i * d + k), 2);
      // f16 decode matrix on the GPU (relative 2^-11 per product), plus one unit in the last
      // place of the output dtype where the two sides round a near-tie differently.
      const double tol = 3e-3 * std::sqrt(norm / d) + 1e-4;
      const double ulp = od == DType::kBF16 ? 1.0 / 128 : od == DType::kF16 ? 1.0 / 1024 : 0.0;
      for (uint32_t k = 0; k < d; ++k) {
        const float c = LoadAsFloat(oc.data(), od, i * d + k);
        const float gg = LoadAsFloat(og.data(), od, i * d + k);
        ASSERT_TRUE(std::isfinite(gg)) << "unwritten output " << i << " " << k;
        ASSERT_NEAR(gg, c, tol + 1.01 * ulp * std::fabs(c)) << ValueCodecName(codec) << " d=" << d << " row " << i << " " << k;
      }
    }
  }
}

TEST(CodecCuda, ValuesAgreeWithTheCpu) {
  Backends b;
  for (uint32_t d : {64u, 128u, 256u}) {
    for (ValueCodec c : {ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                         ValueCodec::kOrthogonalInt4}) {
      SCOPED_TRACE(::testing::Message() << "d=" << d << " " << ValueCodecName(c));
      CompareCodec(b, d, c, d / 2, 32, true, DType::kBF16);
      CompareCodec(b, d, c, d * 3 / 4 - (d * 3 / 4) % 2, 32, false, DType::kF16);
      CompareCodec(b, d, c, d, 16, true, DType::kF32);
    }
  }
  CompareCodec(b, 128, ValueCodec::kOrthogonalInt8, 50, 7, true, DType::kF32);  // ragged groups
  CompareCodec(b, 128, ValueCodec::kOrthogonalInt4, 6, 32, true, DType::kF32);   // tiny rank
  // Ranks that end inside a k step of the pipelined expand (4-byte latent rows, padded columns).
  for (ValueCodec c : {ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                       ValueCodec::kOrthogonalInt4}) {
    SCOPED_TRACE(ValueCodecName(c));
    CompareCodec(b, 128, c, 40, 32, true, DType::kBF16);
    CompareCodec(b, 64, c, 24, 16, false, DType::kF32);
  }
}

// Heads long enough that the pipelined expand's blocks take several sub-tiles each (its
// shared-memory stages are reused), against the CPU.
TEST(CodecCuda, LongHeadsAgreeWithTheCpu) {
  Backends b;
  for (ValueCodec c : {ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                       ValueCodec::kOrthogonalInt4}) {
    SCOPED_TRACE(ValueCodecName(c));
    CompareCodec(b, 128, c, 64, 32, true, DType::kBF16, 40000);
    CompareCodec(b, 64, c, 32, 16, true, DType::kF16, 40000);
  }
}

TEST(CodecCuda, DevicePointersAndPoisonedDeviceOutputs) {
  Backends b;
  testing::LowRankData data;
  data.d = 128;
  data.layers = 1;
  data.heads = 2;
  data.tokens = 1000;
  const Projection p = Calibrated(b.cpu.get(), data, 64);
  const std::vector<float> v = data.Make(3);
  const std::vector<uint64_t> off = {0, 1000, 2000};
  ValueCodecParams params{ValueCodec::kOrthogonalInt4, 64, 32, true};
  const uint64_t n = 2000, d = 128, lb = params.LatentBytes(), g = params.Groups();
  void *dv, *dl, *ds, *dout;
  ASSERT_EQ(cudaMalloc(&dv, n * d * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dl, n * lb), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&ds, n * g * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, n * d * 2), cudaSuccess);
  cudaMemcpy(dv, v.data(), n * d * 4, cudaMemcpyHostToDevice);
  cudaMemset(dl, 0xAB, n * lb);
  cudaMemset(ds, 0xFF, n * g * 2);
  cudaMemset(dout, 0xFF, n * d * 2);
  ASSERT_TRUE(b.cuda->codec()
                  .EncodeValues(p, params, Span(off), dv, DType::kF32, dl,
                                static_cast<uint16_t*>(ds))
                  .ok());
  ASSERT_TRUE(b.cuda->codec()
                  .DecodeValues(p, params, Span(off), dl, static_cast<const uint16_t*>(ds), dout,
                                DType::kF16)
                  .ok());
  std::vector<uint16_t> out(n * d);
  cudaMemcpy(out.data(), dout, n * d * 2, cudaMemcpyDeviceToHost);
  double err = 0, norm = 0;
  for (uint64_t i = 0; i < n * d; ++i) {
    const float x = HalfToFloat(out[i]);
    ASSERT_TRUE(std::isfinite(x)) << i;
    err += (x - v[i]) * (x - v[i]);
    norm += v[i] * v[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 0.15);
  cudaFree(dv);
  cudaFree(dl);
  cudaFree(ds);
  cudaFree(dout);
}

TEST(CodecCuda, KeysAgreeWithTheCpu) {
  Backends b;
  const uint32_t d = 128;
  const std::vector<uint64_t> off = {0, 300, 300, 555};
  const uint64_t n = off.back();
  std::mt19937_64 rng(2);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<uint16_t> k(n * d);
  for (auto& x : k) x = FloatToBf16(nd(rng));
  for (KeyCodec kc : {KeyCodec::kRaw, KeyCodec::kFp16, KeyCodec::kInt8, KeyCodec::kInt4}) {
    const uint64_t bytes =
        kc == KeyCodec::kInt4 ? n * d / 2 : n * d * (kc == KeyCodec::kInt8 ? 1 : 2);
    std::vector<uint8_t> ec(bytes), eg(bytes, 0xEE);
    // int8: one scale set per head; int4: one per group of 128 rows (3 + 0 + 2 groups)
    const uint64_t nsc = (kc == KeyCodec::kInt4 ? 5 : 3) * d;
    std::vector<float> sc(nsc), sg(nsc, -1.0f);
    ASSERT_TRUE(
        b.cpu->codec().EncodeKeys(kc, Span(off), d, k.data(), DType::kBF16, ec.data(), sc.data()).ok());
    auto s = b.cuda->codec().EncodeKeys(kc, Span(off), d, k.data(), DType::kBF16, eg.data(),
                                        sg.data());
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(ec, eg) << KeyCodecName(kc);
    if (kc == KeyCodec::kInt8 || kc == KeyCodec::kInt4) {
      EXPECT_EQ(sc, sg) << KeyCodecName(kc);
    }
    std::vector<float> dc(n * d), dg(n * d, NAN);
    ASSERT_TRUE(b.cpu->codec()
                    .DecodeKeys(kc, Span(off), d, ec.data(), DType::kBF16, sc.data(), dc.data(),
                                DType::kF32)
                    .ok());
    ASSERT_TRUE(b.cuda->codec()
                    .DecodeKeys(kc, Span(off), d, ec.data(), DType::kBF16, sc.data(), dg.data(),
                                DType::kF32)
                    .ok());
    EXPECT_EQ(dc, dg) << KeyCodecName(kc);
  }
}

TEST(CodecCuda, WholeCacheDecodesLikeTheCpu) {
  Backends b;
  testing::LowRankData data;
  data.d = 128;
  data.layers = 2;
  data.heads = 2;
  data.tokens = 200;
  const Projection p = Calibrated(b.cuda.get(), data, 128);
  const std::vector<float> v = data.Make(8), k = data.Make(9);
  CompressedCache raw;
  raw.has_moments = false;
  raw.Reset(KvLayout{2, 2, 8, 128, DType::kF16}, 200);
  for (uint64_t h = 0; h < 4; ++h) {
    raw.kept[h] = 150;
    for (uint32_t t = 0; t < 150; ++t) {
      raw.positions.push_back(t + 50);
      for (uint32_t c = 0; c < 128; ++c) {
        const uint64_t src = (h * 200 + t + 50) * 128 + c;
        uint16_t hv = FloatToHalf(v[src]), hk = FloatToHalf(k[src]);
        raw.values.insert(raw.values.end(), reinterpret_cast<uint8_t*>(&hv),
                          reinterpret_cast<uint8_t*>(&hv) + 2);
        raw.keys.insert(raw.keys.end(), reinterpret_cast<uint8_t*>(&hk),
                        reinterpret_cast<uint8_t*>(&hk) + 2);
      }
    }
  }
  // The same projection with auto-tuned per-layer ranks: each layer encodes at its own rank.
  Projection tuned = p;
  tuned.tuned_rank = {24, 96};
  tuned.tuned_error = {0.01, 0.01};
  ASSERT_TRUE(tuned.Seal().ok());
  for (const Projection* proj : {&p, static_cast<const Projection*>(&tuned)}) {
    for (ValueCodec vc :
         {ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8, ValueCodec::kOrthogonalInt4}) {
      for (KeyCodec kc : {KeyCodec::kInt8, KeyCodec::kInt4}) {
        SCOPED_TRACE(proj == &tuned ? "per-layer ranks" : "one rank");
        SCOPED_TRACE(KeyCodecName(kc));
        CompressionPolicy policy;
        policy.value_codec = vc;
        policy.key_codec = kc;
        CompressedCache cc = raw, cg = raw;
        ASSERT_TRUE(EncodeKept(*b.cpu, policy, proj, &cc).ok());
        auto s = EncodeKept(*b.cuda, policy, proj, &cg);
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_EQ(cc.keys, cg.keys);
        EXPECT_EQ(cc.key_scales, cg.key_scales);
        {
          // Keys decoded on the GPU equal the CPU's, and stay within the codec's error.
          auto kcpu = DecodeKept(*b.cpu, cc, proj);
          auto kgpu = DecodeKept(*b.cuda, cc, proj);
          ASSERT_TRUE(kcpu.ok() && kgpu.ok()) << kgpu.status();
          EXPECT_EQ(kcpu->keys, kgpu->keys);
          auto kraw = DecodeKept(*b.cpu, raw, nullptr);
          ASSERT_TRUE(kraw.ok());
          const auto* a = reinterpret_cast<const float*>(kcpu->keys.data());
          const auto* w = reinterpret_cast<const float*>(kraw->keys.data());
          double e = 0, nn = 0;
          for (uint64_t i = 0; i < 600 * 128; ++i) {
            e += (a[i] - w[i]) * (a[i] - w[i]);
            nn += w[i] * w[i];
          }
          EXPECT_LT(std::sqrt(e / nn), kc == KeyCodec::kInt4 ? 0.15 : 0.02);
        }
        EXPECT_EQ(cc.layer_rank, cg.layer_rank);
        EXPECT_TRUE(cc.values == cg.values) << "latents differ";
        EXPECT_EQ(cc.value_scales, cg.value_scales);
        EXPECT_EQ(cc.raw_value_rows, cg.raw_value_rows);
        EXPECT_TRUE(cc.raw_values == cg.raw_values);
        if (proj == &tuned) {
          EXPECT_EQ(cc.layer_rank, (std::vector<uint32_t>{24, 96}));
        }
        // The GPU's latents decode on the CPU like the CPU's own (same numbers up to rounding).
        auto dgc = DecodeKept(*b.cpu, cg, proj);
        ASSERT_TRUE(dgc.ok()) << dgc.status();
        auto dc = DecodeKept(*b.cpu, cc, proj);
        auto dg = DecodeKept(*b.cuda, cc, proj);
        ASSERT_TRUE(dc.ok() && dg.ok()) << dg.status();
        const auto* fc = reinterpret_cast<const float*>(dc->values.data());
        const auto* fg = reinterpret_cast<const float*>(dg->values.data());
        double e = 0, nn = 0;
        for (uint64_t i = 0; i < 600 * 128; ++i) {
          e += (fc[i] - fg[i]) * (fc[i] - fg[i]);
          nn += fc[i] * fc[i];
        }
        EXPECT_LT(std::sqrt(e / nn), 2e-3) << ValueCodecName(vc);
        const auto* fgc = reinterpret_cast<const float*>(dgc->values.data());
        e = 0;
        for (uint64_t i = 0; i < 600 * 128; ++i) e += (fc[i] - fgc[i]) * (fc[i] - fgc[i]);
        EXPECT_LT(std::sqrt(e / nn), 2e-2) << ValueCodecName(vc);
        EXPECT_EQ(DecodeKept(*b.cuda, cc, nullptr).status().code(), absl::StatusCode::kNotFound);
      }
    }
  }
}

// The whole-cache encoder (EncodeValueLayers, one launch for every layer at its rank) against
// the CPU twin on fresh random inputs: latents, scales, energy and lost the same bits, for every
// codec and input dtype, ragged heads (empty ones included), per-layer ranks, with and without
// gamma. The seed is printed so that a failure can be replayed (KVCOMP_CODEC_SEED).
TEST(CodecCuda, WholeCacheEncodeIsBitIdenticalToTheCpu) {
  Backends b;
  uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("KVCOMP_CODEC_SEED")) seed = std::strtoull(s, nullptr, 10);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (uint32_t d : {64u, 128u, 256u}) {
    testing::LowRankData data;
    data.d = d;
    data.layers = 3;
    data.heads = 2;
    data.tokens = 300;
    const Projection p = Calibrated(b.cpu.get(), data, d);
    const uint32_t heads = data.layers * data.heads;
    std::vector<uint64_t> off(heads + 1, 0);
    for (uint32_t h = 0; h < heads; ++h) {
      off[h + 1] = off[h] + (h == 1 ? 0 : std::uniform_int_distribution<uint64_t>(1, 700)(rng));
    }
    const uint64_t n = off.back();
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> v32(n * d);
    for (auto& x : v32) x = nd(rng) * (nd(rng) > 2.0f ? 30.0f : 1.0f);  // some outlier rows
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      std::vector<uint8_t> in(DTypeBytes(dtype, n * d));
      for (uint64_t i = 0; i < n * d; ++i) StoreFromFloat(in.data(), dtype, i, v32[i]);
      for (ValueCodec codec : {ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                               ValueCodec::kOrthogonalInt4}) {
        for (bool gamma : {true, false}) {
          SCOPED_TRACE(::testing::Message() << "d=" << d << " " << ValueCodecName(codec) << " "
                                            << DTypeName(dtype) << " gamma " << gamma);
          ValueCodecParams params{codec, 0, gamma ? 32u : 16u, gamma};
          std::vector<uint32_t> ranks(data.layers);
          for (auto& r : ranks) {
            r = std::uniform_int_distribution<uint32_t>(1, d)(rng);
            if (codec == ValueCodec::kOrthogonalInt4) r = std::min(d, r + r % 2);
            params.rank = std::max(params.rank, r);
          }
          // Sizes: layer after layer at its rank.
          uint64_t lat = 0, sc = 0;
          for (uint32_t l = 0; l < data.layers; ++l) {
            ValueCodecParams lp = params;
            lp.rank = ranks[l];
            const uint64_t rows = off[(l + 1) * data.heads] - off[l * data.heads];
            lat += rows * lp.LatentBytes();
            sc += rows * lp.Groups();
          }
          std::vector<uint8_t> lc(lat), lg(lat, 0xCD);
          std::vector<uint16_t> sc_c(sc + 1), sc_g(sc + 1, 0xFFFF);
          std::vector<float> ec(n), eg(n, -1.0f), xc(n), xg(n, -1.0f);
          ASSERT_TRUE(b.cpu->codec()
                          .EncodeValueLayers(p, params, ranks, off, in.data(), dtype, lc.data(),
                                             sc_c.data(), ec.data(), xc.data())
                          .ok());
          auto s = b.cuda->codec().EncodeValueLayers(p, params, ranks, off, in.data(), dtype,
                                                     lg.data(), sc_g.data(), eg.data(), xg.data());
          ASSERT_TRUE(s.ok()) << s;
          for (uint64_t i = 0; i < lat; ++i) ASSERT_EQ(lc[i], lg[i]) << "latent byte " << i;
          for (uint64_t i = 0; i < sc; ++i) ASSERT_EQ(sc_c[i], sc_g[i]) << "scale " << i;
          EXPECT_EQ(sc_g[sc], 0xFFFF);  // nothing written past the end
          for (uint64_t i = 0; i < n; ++i) {
            ASSERT_EQ(std::memcmp(&ec[i], &eg[i], 4), 0) << "energy " << i;
            ASSERT_EQ(std::memcmp(&xc[i], &xg[i], 4), 0) << "lost " << i;
          }
          // The measure alone (ValueResiduals) at one layer's rank: the same bits again.
          RowSpan first;
          const std::vector<uint64_t> l0(off.begin(), off.begin() + data.heads + 1);
          first.row_offsets = l0;
          std::vector<float> rc(l0.back()), rg(l0.back()), qc(l0.back()), qg(l0.back());
          ASSERT_TRUE(b.cpu->codec()
                          .ValueResiduals(p, ranks[0], first, in.data(), dtype, rc.data(),
                                          qc.data())
                          .ok());
          ASSERT_TRUE(b.cuda->codec()
                          .ValueResiduals(p, ranks[0], first, in.data(), dtype, rg.data(),
                                          qg.data())
                          .ok());
          EXPECT_EQ(std::memcmp(rc.data(), rg.data(), rc.size() * 4), 0);
          EXPECT_EQ(std::memcmp(qc.data(), qg.data(), qc.size() * 4), 0);
          EXPECT_EQ(std::memcmp(rc.data(), ec.data(), rc.size() * 4), 0);
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvcomp
