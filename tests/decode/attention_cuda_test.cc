// kvcomp::decode on the CUDA backend against its CPU twin (gpu label): raw and KVSplice-encoded
// caches placed once on the device and attended many times, GQA, f32 and bf16 queries, host and
// device outputs, and the bytes that cross between host and device.
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "common/gpu.h"
#include "decode/decode_test_util.h"
#include "gtest/gtest.h"
#include "kvcomp/decode/attention.h"

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace decode {
namespace {

using testing::DecodeCaches;

class DecodeAttentionCudaTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto c = MakeCpuBackend(CpuBackendOptions{2});
    ASSERT_TRUE(c.ok()) << c.status();
    cpu_ = c->release();
    auto g = MakeCudaBackend();
    ASSERT_TRUE(g.ok()) << g.status();
    gpu_ = g->release();
    caches_ = new DecodeCaches(testing::MakeDecodeCaches(*cpu_, 128, 1024));
  }
  static void TearDownTestSuite() {
    delete caches_;
    delete gpu_;
    delete cpu_;
  }

  static std::vector<float> Attend(Decoder& decoder, const ResidentCache& rc, uint32_t layer,
                                   const void* q, DType dtype, uint32_t q_heads, uint32_t nq,
                                   bool expand_in_attention = false) {
    std::vector<float> out(uint64_t{q_heads} * nq * rc.layout().head_dim, -1.0f);
    AttendParams p;
    p.queries = HeadsView::Dense(q, dtype, q_heads, nq, rc.layout().head_dim);
    p.layer = layer;
    p.expand_in_attention = expand_in_attention;
    p.out = out.data();
    const absl::Status st = decoder.Attend(rc, p);
    EXPECT_TRUE(st.ok()) << st;
    return out;
  }

  // Runs the CPU and CUDA decoders over `cache` for every layer and query dtype; returns the
  // largest difference relative to the output's scale.
  static double CompareBackends(const CompressedCache& cache) {
    auto on_cpu = ResidentCache::Place(*cpu_, cache, caches_->projection);
    auto on_gpu = ResidentCache::Place(*gpu_, cache, caches_->projection);
    EXPECT_TRUE(on_cpu.ok()) << on_cpu.status();
    EXPECT_TRUE(on_gpu.ok()) << on_gpu.status();
    Decoder cd(*cpu_), gd(*gpu_);
    const uint32_t qh = cache.layout.num_q_heads, nq = 4, d = cache.layout.head_dim;
    const std::vector<float> q = testing::RandomQueries(qh, nq, d, 21);
    std::vector<uint16_t> q16(q.size());
    for (size_t i = 0; i < q.size(); ++i) StoreFromFloat(q16.data(), DType::kBF16, i, q[i]);
    double worst = 0;
    for (uint32_t layer = 0; layer < cache.layout.num_layers; ++layer) {
      for (DType dt : {DType::kF32, DType::kBF16}) {
        const void* qp = dt == DType::kF32 ? static_cast<const void*>(q.data()) : q16.data();
        const std::vector<float> a = Attend(cd, **on_cpu, layer, qp, dt, qh, nq);
        const std::vector<float> b = Attend(gd, **on_gpu, layer, qp, dt, qh, nq);
        double scale = 1e-6;
        for (float x : a) scale = std::max<double>(scale, std::abs(x));
        for (size_t i = 0; i < a.size(); ++i) {
          worst = std::max(worst, std::abs(double{a[i]} - b[i]) / scale);
        }
      }
    }
    return worst;
  }

  static Backend* cpu_;
  static Backend* gpu_;
  static DecodeCaches* caches_;
};
Backend* DecodeAttentionCudaTest::cpu_ = nullptr;
Backend* DecodeAttentionCudaTest::gpu_ = nullptr;
DecodeCaches* DecodeAttentionCudaTest::caches_ = nullptr;

TEST_F(DecodeAttentionCudaTest, RawCacheMatchesCpu) {
  EXPECT_LT(CompareBackends(caches_->raw), 2e-3);
}

TEST_F(DecodeAttentionCudaTest, EncodedCacheMatchesCpu) {
  ASSERT_FALSE(caches_->encoded.raw_value_rows.empty());
  ASSERT_FALSE(caches_->encoded.layer_rank.empty());
  EXPECT_LT(CompareBackends(caches_->encoded), 5e-3);
}

// Encoded layers (ranks 16 and 24: a whole k step and one padded in the last) decode on the
// backend's stream from tables prepared at placement, keys (int8) and values; a group size that
// is not a multiple of 16 keeps the codec op. Both match the CPU (EncodedCacheMatchesCpu and
// below).
TEST_F(DecodeAttentionCudaTest, EncodedLayersTakeThePreparedDecode) {
  ASSERT_EQ(caches_->encoded.layer_rank, (std::vector<uint32_t>{16, 24}));
  auto on_gpu = ResidentCache::Place(*gpu_, caches_->encoded, caches_->projection);
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const LayerSections& l = (*on_gpu)->layer(layer);
    EXPECT_NE(l.expand_tiles, nullptr) << layer;
    EXPECT_NE(l.expand_f16, nullptr) << layer;
    EXPECT_GT(l.num_expand_tiles, 0u) << layer;
    EXPECT_NE(l.key_tiles, nullptr) << layer;
  }
  auto on_cpu = ResidentCache::Place(*cpu_, caches_->encoded, caches_->projection);
  ASSERT_TRUE(on_cpu.ok());
  EXPECT_EQ((*on_cpu)->layer(0).expand_tiles, nullptr);  // host backends keep the codec ops

  CompressionPolicy policy = caches_->encoded.policy;
  policy.group_size = 24;
  CompressedCache odd = caches_->raw;
  odd.policy = policy;
  ASSERT_TRUE(EncodeKept(*cpu_, policy, caches_->projection.get(), &odd).ok());
  auto odd_gpu = ResidentCache::Place(*gpu_, odd, caches_->projection);
  auto odd_cpu = ResidentCache::Place(*cpu_, odd, caches_->projection);
  ASSERT_TRUE(odd_gpu.ok() && odd_cpu.ok());
  EXPECT_EQ((*odd_gpu)->layer(0).expand_tiles, nullptr);
  Decoder cd(*cpu_), gd(*gpu_);
  const uint32_t qh = odd.layout.num_q_heads, nq = 2, d = odd.layout.head_dim;
  const std::vector<float> q = testing::RandomQueries(qh, nq, d, 24);
  for (uint32_t layer = 0; layer < odd.layout.num_layers; ++layer) {
    const std::vector<float> a = Attend(cd, **odd_cpu, layer, q.data(), DType::kF32, qh, nq);
    const std::vector<float> b = Attend(gd, **odd_gpu, layer, q.data(), DType::kF32, qh, nq);
    double scale = 1e-6, worst = 0;
    for (float x : a) scale = std::max<double>(scale, std::abs(x));
    for (size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::abs(double{a[i]} - b[i]) / scale);
    }
    EXPECT_LT(worst, 5e-3) << "layer " << layer;
  }
}

TEST_F(DecodeAttentionCudaTest, EncodedCacheMatchesDecodedFirst) {
  const CompressedCache dense =
      testing::DecodedCopy(*cpu_, caches_->encoded, caches_->projection.get());
  auto enc = ResidentCache::Place(*gpu_, caches_->encoded, caches_->projection);
  auto raw = ResidentCache::Place(*gpu_, dense);
  ASSERT_TRUE(enc.ok() && raw.ok());
  Decoder decoder(*gpu_);
  const uint32_t qh = dense.layout.num_q_heads, nq = 2, d = dense.layout.head_dim;
  const std::vector<float> q = testing::RandomQueries(qh, nq, d, 22);
  for (uint32_t layer = 0; layer < dense.layout.num_layers; ++layer) {
    const std::vector<float> a =
        Attend(decoder, **enc, layer, q.data(), DType::kF32, qh, nq, /*expand_in_attention=*/false);
    const std::vector<float> b = Attend(decoder, **raw, layer, q.data(), DType::kF32, qh, nq);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 2e-3) << i;
  }
}

// Attention over the latent codes on the device against its CPU twin (the same formula, fp32
// sums in another order), for every value codec, f32 and bf16 queries, 1 and 5 queries per q
// head, fresh random queries each run; and against the device's decode-first path.
TEST_F(DecodeAttentionCudaTest, LatentAttentionMatchesCpu) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "query seed " << seed);
  for (ValueCodec codec : {ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                           ValueCodec::kOrthogonalInt4}) {
    CompressionPolicy policy = caches_->encoded.policy;
    policy.value_codec = codec;
    CompressedCache enc = caches_->raw;
    enc.policy = policy;
    ASSERT_TRUE(EncodeKept(*cpu_, policy, caches_->projection.get(), &enc).ok());
    ASSERT_FALSE(enc.raw_value_rows.empty());
    auto on_cpu = ResidentCache::Place(*cpu_, enc, caches_->projection);
    auto on_gpu = ResidentCache::Place(*gpu_, enc, caches_->projection);
    ASSERT_TRUE(on_cpu.ok() && on_gpu.ok());
    Decoder cd(*cpu_), gd(*gpu_);
    for (uint32_t nq : {1u, 5u}) {
      const uint32_t qh = enc.layout.num_q_heads, d = enc.layout.head_dim;
      const std::vector<float> q = testing::RandomQueries(qh, nq, d, seed + nq);
      std::vector<uint16_t> q16(q.size());
      for (size_t i = 0; i < q.size(); ++i) StoreFromFloat(q16.data(), DType::kBF16, i, q[i]);
      for (uint32_t layer = 0; layer < enc.layout.num_layers; ++layer) {
        for (DType dt : {DType::kF32, DType::kBF16}) {
          const void* qp = dt == DType::kF32 ? static_cast<const void*>(q.data()) : q16.data();
          const std::vector<float> a = Attend(cd, **on_cpu, layer, qp, dt, qh, nq, true);
          const std::vector<float> b = Attend(gd, **on_gpu, layer, qp, dt, qh, nq, true);
          const std::vector<float> dense = Attend(gd, **on_gpu, layer, qp, dt, qh, nq);
          double scale = 1e-6, worst = 0, vs_dense = 0;
          for (float x : a) scale = std::max<double>(scale, std::abs(x));
          for (size_t i = 0; i < a.size(); ++i) {
            worst = std::max(worst, std::abs(double{a[i]} - b[i]) / scale);
            vs_dense = std::max(vs_dense, std::abs(double{dense[i]} - b[i]) / scale);
          }
          EXPECT_LT(worst, 5e-4) << ValueCodecName(codec) << " layer " << layer << " nq " << nq;
          EXPECT_LT(vs_dense, 2e-2) << ValueCodecName(codec) << " layer " << layer;
        }
      }
    }
  }
}

// The cache crosses to the device once: later calls move only queries and outputs, and none at
// all when both are device memory.
TEST_F(DecodeAttentionCudaTest, CacheIsUploadedOnce) {
  const CompressedCache& c = caches_->encoded;
  auto rc = ResidentCache::Place(*gpu_, c, caches_->projection);
  ASSERT_TRUE(rc.ok()) << rc.status();
  const CacheBytes b = c.Breakdown();
  const uint64_t sections =
      b.keys + b.key_scales + b.values + b.value_scales + b.raw_values + b.moments;
  // Each section once, plus the per-layer row offsets and expand matrices.
  uint64_t expand = 0;
  for (uint32_t l = 0; l < c.layout.num_layers; ++l) {
    expand += uint64_t{c.layout.num_kv_heads} * c.LayerRank(l) * c.layout.head_dim * 4;
  }
  // The dense decode's launch tables: f16 expand matrices where the layer takes the pipelined
  // expand, 16-byte tiles.
  for (uint32_t l = 0; l < c.layout.num_layers; ++l) {
    const LayerSections& s = (*rc)->layer(l);
    if (s.expand_f16 != nullptr) {  // rows padded to a multiple of 16
      expand += uint64_t{c.layout.num_kv_heads} * ((c.LayerRank(l) + 15) / 16 * 16) *
                c.layout.head_dim * 2;
    }
    expand += (s.num_expand_tiles + s.num_key_tiles) * 16;
  }
  EXPECT_GE((*rc)->transfers().host_to_device_bytes, sections + expand);
  EXPECT_LE((*rc)->transfers().host_to_device_bytes, sections + expand + 1024);
  Decoder decoder(*gpu_);
  const uint32_t qh = c.layout.num_q_heads, nq = 1, d = c.layout.head_dim;
  const std::vector<float> q = testing::RandomQueries(qh, nq, d, 23);
  const uint64_t qbytes = q.size() * sizeof(float);
  constexpr int kSteps = 20;
  for (int s = 0; s < kSteps; ++s) {
    for (uint32_t layer = 0; layer < c.layout.num_layers; ++layer) {
      Attend(decoder, **rc, layer, q.data(), DType::kF32, qh, nq);
    }
  }
  const uint64_t calls = uint64_t{kSteps} * c.layout.num_layers;
  EXPECT_EQ(decoder.transfers().host_to_device_bytes, calls * qbytes);
  EXPECT_EQ(decoder.transfers().device_to_host_bytes, calls * qbytes);

  // Device queries and output: nothing crosses.
  auto dq = Buffer::Allocate(gpu_->allocator(), qbytes);
  auto dout = Buffer::Allocate(gpu_->allocator(), qbytes);
  ASSERT_TRUE(dq.ok() && dout.ok());
  ASSERT_TRUE(gpu_->CopyFromHost(dq->data(), q.data(), qbytes).ok());
  Decoder resident(*gpu_);
  AttendParams p;
  p.queries = HeadsView::Dense(dq->data(), DType::kF32, qh, nq, d, MemorySpace::kDevice);
  p.layer = 1;
  p.out = dout->as<float>();
  p.out_space = MemorySpace::kDevice;
  ASSERT_TRUE(resident.Attend(**rc, p).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  EXPECT_EQ(resident.transfers().host_to_device_bytes, 0u);
  EXPECT_EQ(resident.transfers().device_to_host_bytes, 0u);
  std::vector<float> got(q.size());
  ASSERT_TRUE(gpu_->CopyToHost(got.data(), dout->data(), qbytes).ok());
  EXPECT_EQ(got, Attend(decoder, **rc, 1, q.data(), DType::kF32, qh, nq));
}

}  // namespace
}  // namespace decode
}  // namespace kvcomp
