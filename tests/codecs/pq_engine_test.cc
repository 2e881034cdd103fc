// The calibrated basis codec as a codec of the engine's cache format: whole caches compressed
// with key and value codec pq through the CPU backend give the library's records and decoded
// values bit for bit (kvcomp/codecs/pq.h), round-trip through the byte format (1.5), and every
// refusal is a clear status (no calibration, other bits, another calibration, a device, pq keys
// beside KVSplice values); the calibration's own bytes; its storage per tenant/model in the
// tiered store's calibration family with the projections' lifetime rules.
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/codecs/projection_store.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/storage/tiered_store.h"
#include "storage/storage_test_util.h"

namespace kvcomp {
namespace {

// Rows with a steep, correlated spectrum (a random mixing of channels with falling scales) and
// a per-channel offset, as keys have: [heads][n][d] f32.
std::vector<float> Rows(std::mt19937_64& rng, uint64_t heads, uint64_t n, uint32_t d,
                        float offset) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> mix(uint64_t{d} * d);
  for (float& m : mix) m = g(rng) / std::sqrt(static_cast<float>(d));
  std::vector<float> out(heads * n * d);
  std::vector<float> z(d);
  for (uint64_t r = 0; r < heads * n; ++r) {
    for (uint32_t c = 0; c < d; ++c) z[c] = g(rng) * std::pow(0.93f, static_cast<float>(c));
    for (uint32_t j = 0; j < d; ++j) {
      float s = offset * static_cast<float>(j % 3);
      for (uint32_t c = 0; c < d; ++c) s += mix[uint64_t{c} * d + j] * z[c];
      out[r * d + j] = s;
    }
  }
  return out;
}

// A KvCacheView over [layers][heads][tokens][d] arrays of `dtype` (f32 or bf16).
class PqCache : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    layout_.num_layers = 2;
    layout_.num_kv_heads = 2;
    layout_.num_q_heads = 4;
    layout_.head_dim = 64;
    layout_.dtype = GetParam();
    const uint64_t heads = layout_.num_heads_total(), d = layout_.head_dim;
    std::mt19937_64 rng(41);
    // Calibration rows and the cache drawn alike (the same mixing per tensor: one "model").
    std::mt19937_64 krng(7), vrng(8);
    std::vector<float> kcal = Rows(krng, heads, 512 + tokens_, layout_.head_dim, 0.7f);
    std::vector<float> vcal = Rows(vrng, heads, 512 + tokens_, layout_.head_dim, 0.0f);
    // The first 512 rows of each head calibrate, the rest are the cache's tokens.
    std::vector<float> kfit, vfit;
    k32_.resize(heads * tokens_ * d);
    v32_.resize(k32_.size());
    for (uint64_t h = 0; h < heads; ++h) {
      const float* kh = kcal.data() + h * (512 + tokens_) * d;
      const float* vh = vcal.data() + h * (512 + tokens_) * d;
      kfit.insert(kfit.end(), kh, kh + 512 * d);
      vfit.insert(vfit.end(), vh, vh + 512 * d);
      std::memcpy(k32_.data() + h * tokens_ * d, kh + 512 * d, tokens_ * d * 4);
      std::memcpy(v32_.data() + h * tokens_ * d, vh + 512 * d, tokens_ * d * 4);
    }
    auto cal = pq::FitCalibration(kfit, vfit, 512, layout_.num_layers, layout_.num_kv_heads,
                                  layout_.head_dim, 3, 2);
    ASSERT_TRUE(cal.ok()) << cal.status();
    cal_ = std::make_shared<const pq::Calibration>(*std::move(cal));
    k_.resize(DTypeBytes(layout_.dtype, k32_.size()));
    v_.resize(k_.size());
    for (uint64_t i = 0; i < k32_.size(); ++i) {
      StoreFromFloat(k_.data(), layout_.dtype, i, k32_[i]);
      StoreFromFloat(v_.data(), layout_.dtype, i, v32_[i]);
    }
    const uint64_t per_layer = DTypeBytes(layout_.dtype, layout_.num_kv_heads * tokens_ * d);
    view_.layout = layout_;
    view_.num_tokens = tokens_;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      view_.keys.push_back(HeadsView::Dense(k_.data() + l * per_layer, layout_.dtype,
                                            layout_.num_kv_heads, tokens_, layout_.head_dim));
      view_.values.push_back(HeadsView::Dense(v_.data() + l * per_layer, layout_.dtype,
                                              layout_.num_kv_heads, tokens_, layout_.head_dim));
    }
    auto b = MakeCpuBackend(CpuBackendOptions{2});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }

  // Every token (or half), keys at 3 bits and values at 2 bits per element ("k3v2").
  CompressionPolicy Codec(double ratio) const {
    CompressionPolicy p;
    p.ratio = ratio;
    p.moments = false;
    p.key_codec = KeyCodec::kPq;
    p.value_codec = ValueCodec::kPq;
    p.key_bits = 3;
    p.value_bits = 2;
    return p;
  }

  KvLayout layout_;
  const uint64_t tokens_ = 160;
  std::vector<float> k32_, v32_;
  std::vector<uint8_t> k_, v_;
  KvCacheView view_;
  std::shared_ptr<const pq::Calibration> cal_;
  std::unique_ptr<Backend> backend_;
};

// With eviction and without, the cache's records are the library's records of the kept rows,
// head by head, and its decoded rows the library's decode.
TEST_P(PqCache, RecordsAndDecodedRowsAreTheLibrarys) {
  for (double ratio : {0.0, 0.5}) {
    const CompressionPolicy p = Codec(ratio);
    EXPECT_EQ(p.key_codec, KeyCodec::kPq);
    EXPECT_EQ(p.value_codec, ValueCodec::kPq);
    CompressOptions o;
    o.pq = cal_;
    auto c = Compress(*backend_, view_, p, o);
    ASSERT_TRUE(c.ok()) << c.status();
    // The same selection with raw codecs: the kept rows the codec encoded.
    CompressionPolicy raw_p = p;
    raw_p.key_codec = KeyCodec::kRaw;
    raw_p.value_codec = ValueCodec::kRaw;
    auto raw = Compress(*backend_, view_, raw_p);
    ASSERT_TRUE(raw.ok()) << raw.status();
    ASSERT_EQ(raw->kept, c->kept);
    ASSERT_EQ(raw->positions, c->positions);

    const uint64_t d = layout_.head_dim;
    EXPECT_EQ(c->KeyTokenBytes(), 3 * d / 8);  // 24 bytes a key (bf16: 128), no scales
    EXPECT_EQ(c->ValueTokenBytes(), 2 * d / 8);
    EXPECT_EQ(c->pq_key_bits, 3 * d);
    EXPECT_EQ(c->pq_value_bits, 2 * d);
    EXPECT_EQ(c->projection_version, cal_->version);
    EXPECT_EQ(c->pq_key_basis, cal_->key_fingerprint);
    EXPECT_EQ(c->pq_value_basis, cal_->value_fingerprint);
    EXPECT_TRUE(c->key_scales.empty() && c->value_scales.empty());
    const std::vector<uint64_t> off = c->TokenOffsets();
    const uint64_t in_row = DTypeBytes(layout_.dtype, d);
    for (uint64_t h = 0; h < c->num_heads(); ++h) {
      const uint64_t n = off[h + 1] - off[h];
      std::vector<uint8_t> kw(n * cal_->keys.RecordBytes()), vw(n * cal_->values.RecordBytes());
      ASSERT_TRUE(pq::EncodeRows(cal_->keys, h, raw->keys.data() + off[h] * in_row, layout_.dtype,
                                 n, kw.data())
                      .ok());
      ASSERT_TRUE(pq::EncodeRows(cal_->values, h, raw->values.data() + off[h] * in_row,
                                 layout_.dtype, n, vw.data())
                      .ok());
      EXPECT_EQ(
          0, std::memcmp(kw.data(), c->keys.data() + off[h] * kw.size() / std::max<uint64_t>(n, 1),
                         kw.size()))
          << "keys of head " << h;
      EXPECT_EQ(0, std::memcmp(vw.data(),
                               c->values.data() + off[h] * vw.size() / std::max<uint64_t>(n, 1),
                               vw.size()))
          << "values of head " << h;
    }

    // The format (1.5) keeps it byte for byte and names the calibration.
    auto bytes = format::EncodeCache(*c);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    uint16_t minor;
    std::memcpy(&minor, bytes->data() + 6, 2);
    EXPECT_EQ(minor, 5);
    auto parsed = format::ParseCache(*bytes);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, *c);
    auto info = format::PeekCache(*bytes);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->projection_version, cal_->version);
    EXPECT_EQ(info->pq_key_basis, cal_->key_fingerprint);
    EXPECT_EQ(info->pq_value_bits, 2 * d);

    // Decoded: the library's decode of each head's records, in every output dtype.
    for (DType out : {DType::kF32, DType::kBF16}) {
      auto dec = DecodeKept(*backend_, *parsed, nullptr, out, cal_.get());
      ASSERT_TRUE(dec.ok()) << dec.status();
      const uint64_t out_row = DTypeBytes(out, d);
      for (uint64_t h = 0; h < c->num_heads(); ++h) {
        const uint64_t n = off[h + 1] - off[h];
        std::vector<uint8_t> kw(n * out_row), vw(n * out_row);
        ASSERT_TRUE(pq::DecodeRows(cal_->keys, h, c->keys.data() + off[h] * c->KeyTokenBytes(), n,
                                   kw.data(), out)
                        .ok());
        ASSERT_TRUE(pq::DecodeRows(cal_->values, h,
                                   c->values.data() + off[h] * c->ValueTokenBytes(), n, vw.data(),
                                   out)
                        .ok());
        EXPECT_EQ(0, std::memcmp(kw.data(), dec->keys.data() + off[h] * out_row, kw.size()));
        EXPECT_EQ(0, std::memcmp(vw.data(), dec->values.data() + off[h] * out_row, vw.size()));
      }
    }
    // Lossy, not broken: the values' relative error at 2 bits on this spectrum.
    auto dec = DecodeKept(*backend_, *parsed, nullptr, DType::kF32, cal_.get());
    ASSERT_TRUE(dec.ok());
    const auto* dv = reinterpret_cast<const float*>(dec->values.data());
    double err = 0, norm = 0;
    for (uint64_t h = 0; h < c->num_heads(); ++h) {
      for (uint64_t r = off[h]; r < off[h + 1]; ++r) {
        const float* src = v32_.data() + (h * tokens_ + c->positions[r]) * d;
        for (uint64_t j = 0; j < d; ++j) {
          err += double(dv[r * d + j] - src[j]) * (dv[r * d + j] - src[j]);
          norm += double(src[j]) * src[j];
        }
      }
    }
    EXPECT_LT(std::sqrt(err / norm), 0.5);
    // Raw codecs back: what a decoded get stores.
    auto back = DecodeToRawCodecs(*backend_, *parsed, nullptr, cal_.get());
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->key_codec, KeyCodec::kRaw);
    EXPECT_EQ(back->value_codec, ValueCodec::kRaw);
    EXPECT_EQ(back->projection_version, 0u);
    EXPECT_EQ(back->pq_key_bits, 0u);
    EXPECT_TRUE(format::EncodeCache(*back).ok());
  }
}

// pq on one tensor beside another codec on the other; the block-wise compressor encodes it too.
TEST_P(PqCache, MixesWithRawAndHqAndRunsBlockWise) {
  CompressionPolicy p = Codec(0.0);
  p.value_codec = ValueCodec::kHq3;
  CompressOptions o;
  o.pq = cal_;
  auto c = Compress(*backend_, view_, p, o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->pq_value_bits, 0u);
  EXPECT_EQ(c->pq_value_basis, 0u);
  EXPECT_EQ(c->projection_version, cal_->version);
  auto parsed = format::ParseCache(*format::EncodeCache(*c));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(DecodeKept(*backend_, *parsed, nullptr, DType::kF32, cal_.get()).ok());

  p = Codec(0.0);
  p.key_codec = KeyCodec::kRaw;
  c = Compress(*backend_, view_, p, o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->pq_key_bits, 0u);
  EXPECT_TRUE(format::ParseCache(*format::EncodeCache(*c)).ok());

  p = Codec(0.0);
  p.scorer = Scorer::kKeyDiff;
  p.block_size = 64;
  p.token_budget = 96;
  BlockCompressorOptions bo;
  bo.pq = cal_;
  auto bc = BlockCompressor::Create(*backend_, layout_, p, bo);
  ASSERT_TRUE(bc.ok()) << bc.status();
  const uint64_t d = layout_.head_dim, es = DTypeBytes(layout_.dtype, 1);
  for (uint64_t t = 0; t < tokens_; t += 64) {
    const uint64_t b = std::min<uint64_t>(64, tokens_ - t);
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      HeadsView k = view_.keys[l], v = view_.values[l];
      k.data = static_cast<const uint8_t*>(k.data) + t * d * es;
      v.data = static_cast<const uint8_t*>(v.data) + t * d * es;
      k.num_tokens = v.num_tokens = b;
      ASSERT_TRUE((*bc)->Append(l, k, v).ok());
    }
  }
  auto fin = (*bc)->Finish();
  ASSERT_TRUE(fin.ok()) << fin.status();
  EXPECT_EQ(fin->key_codec, KeyCodec::kPq);
  EXPECT_EQ(fin->total_kept(), 96 * layout_.num_heads_total());
}

TEST_P(PqCache, RefusalsAreClear) {
  const CompressionPolicy p = Codec(0.0);
  // No calibration: FailedPrecondition naming the calibration call.
  auto c = Compress(*backend_, view_, p);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "calibrate_pq")) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "Calibrate")) << c.status();
  // Other bits than the calibration's.
  CompressOptions o;
  o.pq = cal_;
  CompressionPolicy p4 = p;
  p4.key_bits = 4;
  c = Compress(*backend_, view_, p4, o);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "key_bits 4")) << c.status();
  // A calibration of another shape.
  std::mt19937_64 rng(3);
  std::vector<float> rows = Rows(rng, 2, 64, 64, 0.0f);
  auto other = pq::FitCalibration(rows, rows, 64, 1, 2, 64, 3, 2);
  ASSERT_TRUE(other.ok());
  o.pq = std::make_shared<const pq::Calibration>(*other);
  EXPECT_EQ(Compress(*backend_, view_, p, o).status().code(), absl::StatusCode::kInvalidArgument);
  // Decoding needs the calibration the cache names, never another one.
  o.pq = cal_;
  c = Compress(*backend_, view_, p, o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto no = DecodeKept(*backend_, *c, nullptr, DType::kF32);
  EXPECT_EQ(no.status().code(), absl::StatusCode::kNotFound);
  const uint64_t heads = layout_.num_heads_total();
  std::vector<float> r2 = Rows(rng, heads, 64, 64, 0.0f);
  auto wrong = pq::FitCalibration(r2, r2, 64, 2, 2, 64, 3, 2);
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ(DecodeKept(*backend_, *c, nullptr, DType::kF32, &*wrong).status().code(),
            absl::StatusCode::kNotFound);
  // Heads of a pq cache are not split (each head's basis is its own).
  // Policy rules: pq keys beside KVSplice values, a rank on pq values, bits out of range.
  CompressionPolicy mixed = p;
  mixed.value_codec = ValueCodec::kOrthogonalInt8;
  EXPECT_TRUE(absl::StrContains(mixed.Validate().message(), "one calibration"));
  CompressionPolicy ranked = p;
  ranked.rank = 8;
  EXPECT_EQ(ranked.Validate().code(), absl::StatusCode::kInvalidArgument);
  CompressionPolicy nine = p;
  nine.value_bits = 9;
  EXPECT_TRUE(absl::StrContains(nine.Validate().message(), "value_bits"));
  EXPECT_EQ(*ParseKeyCodec("pq"), KeyCodec::kPq);
  EXPECT_EQ(ValueCodecName(ValueCodec::kPq), "pq");
  // A record whose bits after its codes are set, and pq fields on a cache without pq codecs.
  CompressedCache bad = *c;
  bad.pq_value_bits = 2 * 64 - 3;  // 125 bits: the record is still 16 bytes, 3 spare bits
  bad.values[15] |= 0x80;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(format::EncodeCache(bad).ok());
  CompressedCache stray = *c;
  stray.key_codec = KeyCodec::kHq4;
  EXPECT_EQ(stray.Validate().code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PqCache, ::testing::Values(DType::kF32, DType::kBF16));

TEST(PqCalibration, BytesRoundTripAndDamageIsRefused) {
  std::mt19937_64 rng(9);
  std::vector<float> k = Rows(rng, 2, 80, 32, 0.5f), v = Rows(rng, 2, 80, 32, 0.0f);
  auto c = pq::FitCalibration(k, v, 80, 1, 2, 32, 4, 3);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->key_bits(), 4u);
  EXPECT_EQ(c->value_bits(), 3u);
  EXPECT_NE(c->version, 0u);
  EXPECT_EQ(c->key_fingerprint, c->keys.Fingerprint());
  const std::string bytes = c->Serialize();
  auto back = pq::Calibration::Parse(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->version, c->version);
  EXPECT_EQ(back->Serialize(), bytes);
  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 1;
  EXPECT_EQ(pq::Calibration::Parse(flipped).status().code(), absl::StatusCode::kDataLoss);
  std::string magic = bytes;
  magic[0] = 'X';
  EXPECT_EQ(pq::Calibration::Parse(magic).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pq::Calibration::Parse(bytes.substr(0, bytes.size() - 1)).status().code(),
            absl::StatusCode::kDataLoss);
  std::string version = bytes;
  version[8] ^= 1;
  EXPECT_EQ(pq::Calibration::Parse(version).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(pq::FitCalibration(k, v, 80, 1, 2, 32, 0, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pq::FitCalibration(k, v, 80, 1, 2, 32, 3, 9).status().code(),
            absl::StatusCode::kInvalidArgument);
}

std::unique_ptr<storage::TieredStore> OpenStore(const std::string& path) {
  storage::StoreOptions o;
  o.host.capacity_bytes = 1 << 20;
  o.rocksdb.enabled = true;
  o.rocksdb.path = path;
  o.rocksdb.capacity_bytes = 1ull << 30;
  auto s = storage::TieredStore::Open(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

pq::Calibration Fit(uint64_t seed, uint32_t key_bits, uint32_t value_bits) {
  std::mt19937_64 rng(seed);
  std::vector<float> k = Rows(rng, 1, 40, 16, 0.5f), v = Rows(rng, 1, 40, 16, 0.0f);
  return *pq::FitCalibration(k, v, 40, 1, 1, 16, key_bits, value_bits);
}

// pq calibrations per tenant/model beside the projections: the latest at the asked bits,
// pinned by a put, kept while a stored cache names it, other tenants' never visible, and the
// projections' own listing unaffected.
TEST(TieredPqStore, LatestAtTheBitsPinnedAndKeptWhileNamed) {
  storage::testing::TempDir dir;
  auto store = OpenStore(dir.path());
  codecs::TieredProjectionStore s(store.get());
  auto none = s.AcquireLatestPq("t/llama", 3, 2);
  ASSERT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(none.status().message(), "Calibrate")) << none.status();
  const pq::Calibration a = Fit(1, 3, 2), b = Fit(2, 3, 2), w = Fit(3, 4, 3);
  ASSERT_TRUE(s.PutPq("t/llama", a).ok());
  ASSERT_TRUE(s.PutPq("t/llama", w).ok());
  ASSERT_TRUE(s.PutPq("t/llama", a).ok());  // the same version again: kept where it is
  EXPECT_EQ(*s.CountPq(), 2u);
  EXPECT_EQ(*s.Count(), 0u);  // projections only
  {
    auto got = s.AcquireLatestPq("t/llama", 3, 2);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ((*got)->version, a.version);
    auto other = s.AcquireLatestPq("t/llama", 2, 2);
    ASSERT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(other.status().message(), "k3v2")) << other.status();
    EXPECT_TRUE(absl::IsFailedPrecondition(s.AcquireLatestPq("u/llama", 3, 2).status()));
  }
  // b is the latest at k3v2; a stays while a stored cache of the model names it.
  ASSERT_TRUE(s.PutPq("t/llama", b).ok());
  CacheKey key{"t", "llama", "x"};
  storage::CacheMeta meta;
  meta.projection_version = a.version;
  ASSERT_TRUE(store->Put(key, storage::testing::EncodedCache(3), meta, {}).ok());
  EXPECT_EQ(*s.Collect("t/llama"), 0u);
  EXPECT_EQ((*s.AcquireLatestPq("t/llama", 3, 2))->version, b.version);
  ASSERT_TRUE(store->Delete(key).ok());
  {
    auto pinned = s.AcquireLatestPq("t/llama", 3, 2);  // b: the latest is never collected
    ASSERT_TRUE(pinned.ok());
    EXPECT_EQ(*s.Collect(""), 1u);  // a: not the latest, named by nothing
  }
  EXPECT_TRUE(absl::IsNotFound(s.GetPq("t/llama", a.version).status()));
  EXPECT_EQ((*s.GetPq("t/llama", b.version))->version, b.version);
  EXPECT_EQ((*s.GetPq("t/llama", w.version))->key_bits(), 4u);  // the latest at k4v3
  EXPECT_EQ(*s.Collect(""), 0u);
  // Reopened: read back from RocksDB, the same bytes.
  codecs::TieredProjectionStore again(store.get());
  auto read = again.GetPq("t/llama", b.version);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)->Serialize(), b.Serialize());
  EXPECT_TRUE(absl::IsNotFound(again.GetPq("u/llama", b.version).status()));
}

}  // namespace
}  // namespace kvcomp
