// kvcomp::decode on the CPU backend: attention over a placed cache against a float64 reference,
// a KVSplice-encoded cache against the same cache decoded first (values expanded per token) and
// attended over its latent codes (expanded once per query row) against a float64 reference of
// the decoded values, layer subsets, and bad input.
#include "kvcomp/decode/attention.h"

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "decode/decode_test_util.h"
#include "gtest/gtest.h"

namespace kvcomp {
namespace decode {
namespace {

using testing::DecodeCaches;

class DecodeAttentionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto b = MakeCpuBackend(CpuBackendOptions{2});
    ASSERT_TRUE(b.ok()) << b.status();
    cpu_ = b->release();
    caches_ = new DecodeCaches(testing::MakeDecodeCaches(*cpu_, 64, 200));
  }
  static void TearDownTestSuite() {
    delete caches_;
    delete cpu_;
  }

  std::vector<float> Attend(Decoder& decoder, const ResidentCache& rc, uint32_t layer,
                            const std::vector<float>& q, uint32_t q_heads, uint32_t nq,
                            bool correct, bool expand_in_attention = false) {
    std::vector<float> out(q.size(), -1.0f);
    AttendParams p;
    p.queries = HeadsView::Dense(q.data(), DType::kF32, q_heads, nq, rc.layout().head_dim);
    p.layer = layer;
    p.correct = correct;
    p.expand_in_attention = expand_in_attention;
    p.out = out.data();
    const absl::Status st = decoder.Attend(rc, p);
    EXPECT_TRUE(st.ok()) << st;
    return out;
  }

  static Backend* cpu_;
  static DecodeCaches* caches_;
};
Backend* DecodeAttentionTest::cpu_ = nullptr;
DecodeCaches* DecodeAttentionTest::caches_ = nullptr;

TEST_F(DecodeAttentionTest, RawCacheMatchesReference) {
  const CompressedCache& c = caches_->raw;
  const uint32_t qh = c.layout.num_q_heads, nq = 3, d = c.layout.head_dim;
  auto rc = ResidentCache::Place(*cpu_, c);
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ((*rc)->transfers().host_to_device_bytes, 0u);  // a host backend views the cache
  Decoder decoder(*cpu_);
  const std::vector<float> q = testing::RandomQueries(qh, nq, d, 3);
  for (uint32_t layer = 0; layer < c.layout.num_layers; ++layer) {
    for (bool correct : {false, true}) {
      const std::vector<float> got = Attend(decoder, **rc, layer, q, qh, nq, correct);
      const std::vector<double> want = testing::ReferenceAttention(c, layer, q, qh, nq, correct);
      double worst = 0;
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
      EXPECT_LT(worst, 2e-4) << "layer " << layer << " correct " << correct;
    }
  }
  // The correction changes the output (the cache evicted half its tokens).
  const std::vector<float> plain = Attend(decoder, **rc, 0, q, qh, nq, false);
  const std::vector<float> corrected = Attend(decoder, **rc, 0, q, qh, nq, true);
  double diff = 0;
  for (size_t i = 0; i < plain.size(); ++i)
    diff = std::max<double>(diff, std::abs(plain[i] - corrected[i]));
  EXPECT_GT(diff, 1e-3);
  EXPECT_EQ(decoder.transfers().host_to_device_bytes, 0u);
  EXPECT_EQ(decoder.transfers().device_to_host_bytes, 0u);
}

TEST_F(DecodeAttentionTest, EncodedCacheMatchesDecodedFirst) {
  const CompressedCache& enc = caches_->encoded;
  ASSERT_EQ(enc.key_codec, KeyCodec::kInt8);
  ASSERT_EQ(enc.value_codec, ValueCodec::kOrthogonalInt8);
  ASSERT_EQ(enc.layer_rank, (std::vector<uint32_t>{16, 24}));
  ASSERT_FALSE(enc.raw_value_rows.empty());  // outliers in play
  const CompressedCache dense = testing::DecodedCopy(*cpu_, enc, caches_->projection.get());
  const uint32_t qh = enc.layout.num_q_heads, nq = 2, d = enc.layout.head_dim;
  auto rc = ResidentCache::Place(*cpu_, enc, caches_->projection);
  ASSERT_TRUE(rc.ok()) << rc.status();
  auto rd = ResidentCache::Place(*cpu_, dense);
  ASSERT_TRUE(rd.ok()) << rd.status();
  Decoder decoder(*cpu_);
  const std::vector<float> q = testing::RandomQueries(qh, nq, d, 4);
  for (uint32_t layer = 0; layer < enc.layout.num_layers; ++layer) {
    const std::vector<float> got = Attend(decoder, **rc, layer, q, qh, nq, true, false);
    const std::vector<float> want = Attend(decoder, **rd, layer, q, qh, nq, true);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-5) << "layer " << layer << " element " << i;
    }
  }
  // The outlier rows are used by both paths: without them the output moves.
  CompressedCache no_outliers = enc;
  no_outliers.raw_value_rows.clear();
  no_outliers.raw_values.clear();
  auto rn = ResidentCache::Place(*cpu_, no_outliers, caches_->projection);
  ASSERT_TRUE(rn.ok()) << rn.status();
  for (bool fused : {false, true}) {
    double diff = 0;
    for (uint32_t layer = 0; layer < enc.layout.num_layers; ++layer) {
      const std::vector<float> a = Attend(decoder, **rc, layer, q, qh, nq, true, fused);
      const std::vector<float> b = Attend(decoder, **rn, layer, q, qh, nq, true, fused);
      for (size_t i = 0; i < a.size(); ++i) diff = std::max<double>(diff, std::abs(a[i] - b[i]));
    }
    EXPECT_GT(diff, 1e-4) << "fused " << fused;
  }
}

// The fused form (attention over the latent codes, expand matrix applied once per query row)
// against a float64 reference over the same cache decoded to f32 values (keys decoded as the
// decoder decodes them, to the layout's dtype): every value codec, outliers in play, plain and
// corrected, GQA, fresh random queries each run.
TEST_F(DecodeAttentionTest, LatentAttentionMatchesExpandedReference) {
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
    auto keys = DecodeKept(*cpu_, enc, caches_->projection.get(), enc.layout.dtype);
    auto vals = DecodeKept(*cpu_, enc, caches_->projection.get(), DType::kF32);
    ASSERT_TRUE(keys.ok() && vals.ok());
    CompressedCache ref = testing::DecodedCopy(*cpu_, enc, caches_->projection.get());
    ref.layout.dtype = DType::kF32;
    const uint64_t elems = keys->keys.size() / 2;
    ref.keys.resize(elems * 4);
    for (uint64_t i = 0; i < elems; ++i) {
      StoreFromFloat(ref.keys.data(), DType::kF32, i,
                     LoadAsFloat(keys->keys.data(), enc.layout.dtype, i));
    }
    ref.values = vals->values;
    ASSERT_TRUE(ref.Validate().ok()) << ref.Validate();
    auto rc = ResidentCache::Place(*cpu_, enc, caches_->projection);
    ASSERT_TRUE(rc.ok()) << rc.status();
    Decoder decoder(*cpu_);
    const uint32_t qh = enc.layout.num_q_heads, nq = 3, d = enc.layout.head_dim;
    const std::vector<float> q = testing::RandomQueries(qh, nq, d, seed);
    for (uint32_t layer = 0; layer < enc.layout.num_layers; ++layer) {
      for (bool correct : {false, true}) {
        const std::vector<float> got = Attend(decoder, **rc, layer, q, qh, nq, correct, true);
        const std::vector<double> want =
            testing::ReferenceAttention(ref, layer, q, qh, nq, correct);
        const std::vector<float> dense = Attend(decoder, **rc, layer, q, qh, nq, correct, false);
        double worst = 0, vs_dense = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          worst = std::max(worst, std::abs(got[i] - want[i]));
          vs_dense = std::max<double>(vs_dense, std::abs(got[i] - dense[i]));
        }
        EXPECT_LT(worst, 2e-5) << ValueCodecName(codec) << " layer " << layer << " correct " << correct;
        // The dense path rounds each expanded value to bf16 first.
        EXPECT_LT(vs_dense, 2e-2) << ValueCodecName(codec) << " layer " << layer;
      }
    }
  }
}

// int4 keys (scales per group of kept tokens, ragged over heads): each layer's resident keys take
// that layer's scales, so attention over the encoded cache is attention over its decoded copy.
TEST_F(DecodeAttentionTest, Int4KeysMatchDecodedFirst) {
  CompressionPolicy policy = caches_->encoded.policy;
  policy.key_codec = KeyCodec::kInt4;
  CompressedCache enc = caches_->raw;
  enc.policy = policy;
  ASSERT_TRUE(EncodeKept(*cpu_, policy, caches_->projection.get(), &enc).ok());
  ASSERT_EQ(enc.key_codec, KeyCodec::kInt4);
  ASSERT_EQ(enc.KeyScaleCount(), enc.key_scales.size());
  const CompressedCache dense = testing::DecodedCopy(*cpu_, enc, caches_->projection.get());
  const uint32_t qh = enc.layout.num_q_heads, nq = 2, d = enc.layout.head_dim;
  auto rc = ResidentCache::Place(*cpu_, enc, caches_->projection);
  ASSERT_TRUE(rc.ok()) << rc.status();
  auto rd = ResidentCache::Place(*cpu_, dense);
  ASSERT_TRUE(rd.ok()) << rd.status();
  Decoder decoder(*cpu_);
  const std::vector<float> q = testing::RandomQueries(qh, nq, d, 5);
  for (uint32_t layer = 0; layer < enc.layout.num_layers; ++layer) {
    const std::vector<float> got = Attend(decoder, **rc, layer, q, qh, nq, true, false);
    const std::vector<float> want = Attend(decoder, **rd, layer, q, qh, nq, true);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-5) << "layer " << layer << " element " << i;
    }
  }
}

TEST_F(DecodeAttentionTest, LayerSubsetAndAttendOnce) {
  const CompressedCache& enc = caches_->encoded;
  const uint32_t qh = enc.layout.num_q_heads, nq = 1, d = enc.layout.head_dim;
  auto all = ResidentCache::Place(*cpu_, enc, caches_->projection);
  ASSERT_TRUE(all.ok());
  ResidentCache::Options second;
  second.first_layer = 1;
  second.num_layers = 1;
  auto one = ResidentCache::Place(*cpu_, enc, caches_->projection, second);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_FALSE((*one)->layer(0).placed);
  EXPECT_TRUE((*one)->layer(1).placed);
  Decoder decoder(*cpu_);
  const std::vector<float> q = testing::RandomQueries(qh, nq, d, 5);
  EXPECT_EQ(Attend(decoder, **one, 1, q, qh, nq, true), Attend(decoder, **all, 1, q, qh, nq, true));

  std::vector<float> out(q.size());
  AttendParams p;
  p.queries = HeadsView::Dense(q.data(), DType::kF32, qh, nq, d);
  p.layer = 1;
  p.out = out.data();
  ASSERT_TRUE(AttendOnce(decoder, enc, caches_->projection, p).ok());
  EXPECT_EQ(out, Attend(decoder, **all, 1, q, qh, nq, true));

  p.out = nullptr;
  EXPECT_EQ(decoder.Attend(**one, p).code(), absl::StatusCode::kInvalidArgument);
  p.out = out.data();
  p.layer = 0;  // not placed
  EXPECT_EQ(decoder.Attend(**one, p).code(), absl::StatusCode::kInvalidArgument);
  p.layer = 2;  // outside the cache
  EXPECT_EQ(decoder.Attend(**all, p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AttendOnce(decoder, enc, caches_->projection, p).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(DecodeAttentionTest, BadInputIsAClearStatus) {
  const CompressedCache& enc = caches_->encoded;
  // Encoded values need their projection, of the right version and shape.
  EXPECT_EQ(ResidentCache::Place(*cpu_, enc).status().code(), absl::StatusCode::kNotFound);
  Projection other = *caches_->projection;
  other.tuned_rank = {24, 24};
  ASSERT_TRUE(other.Seal().ok());
  EXPECT_EQ(
      ResidentCache::Place(*cpu_, enc, std::make_shared<const Projection>(other)).status().code(),
      absl::StatusCode::kNotFound);
  ResidentCache::Options outside;
  outside.first_layer = 1;
  outside.num_layers = 2;
  EXPECT_EQ(ResidentCache::Place(*cpu_, enc, caches_->projection, outside).status().code(),
            absl::StatusCode::kInvalidArgument);
  CompressedCache broken = caches_->raw;
  broken.keys.pop_back();
  EXPECT_EQ(ResidentCache::Place(*cpu_, broken).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto rc = ResidentCache::Place(*cpu_, caches_->raw);
  ASSERT_TRUE(rc.ok());
  Decoder decoder(*cpu_);
  const uint32_t d = enc.layout.head_dim;
  std::vector<float> q(uint64_t{8} * d), out(q.size());
  AttendParams p;
  p.out = out.data();
  p.queries = HeadsView::Dense(q.data(), DType::kF32, 8, 1, d / 2);  // head_dim mismatch
  EXPECT_EQ(decoder.Attend(**rc, p).code(), absl::StatusCode::kInvalidArgument);
  p.queries = HeadsView::Dense(q.data(), DType::kF32, 3, 1, d);  // not a multiple of kv heads
  EXPECT_EQ(decoder.Attend(**rc, p).code(), absl::StatusCode::kInvalidArgument);
  p.queries = HeadsView::Dense(q.data(), DType::kF32, 4, 1, d);  // not the layout's q heads
  EXPECT_EQ(decoder.Attend(**rc, p).code(), absl::StatusCode::kInvalidArgument);
  p.queries = HeadsView::Dense(q.data(), DType::kF32, 8, 1, d, MemorySpace::kDevice);
  EXPECT_EQ(decoder.Attend(**rc, p).code(), absl::StatusCode::kInvalidArgument);
  p.queries = HeadsView::Dense(q.data(), DType::kF32, 8, 1, d);
  p.out_space = MemorySpace::kDevice;
  EXPECT_EQ(decoder.Attend(**rc, p).code(), absl::StatusCode::kInvalidArgument);

  auto other_backend = MakeCpuBackend(CpuBackendOptions{1});
  ASSERT_TRUE(other_backend.ok());
  Decoder elsewhere(**other_backend);
  p.out_space = MemorySpace::kHost;
  EXPECT_EQ(elsewhere.Attend(**rc, p).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace decode
}  // namespace kvcomp
