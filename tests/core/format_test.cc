#include "kvcomp/core/format.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "common/random_cache.h"
#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"

namespace kvcomp {
namespace {

using testing::RandomCache;
using testing::RandomCacheOptions;

std::vector<RandomCacheOptions> AllVariants() {
  std::vector<RandomCacheOptions> out;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (KeyCodec kc : {KeyCodec::kRaw, KeyCodec::kFp16, KeyCodec::kInt8, KeyCodec::kInt4}) {
      for (ValueCodec vc : {ValueCodec::kRaw, ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                            ValueCodec::kOrthogonalInt4}) {
        for (bool moments : {false, true}) {
          RandomCacheOptions o;
          o.layout.dtype = dt;
          o.key_codec = kc;
          o.value_codec = vc;
          o.rank = vc == ValueCodec::kRaw ? 0 : (vc == ValueCodec::kOrthogonalInt4 ? 40 : 37);
          o.group_size = 16;
          o.moments = moments;
          out.push_back(o);
          if (vc != ValueCodec::kRaw) {  // the same with per-layer ranks (2 layers)
            o.layer_rank = vc == ValueCodec::kOrthogonalInt4 ? std::vector<uint32_t>{12, 40}
                                                             : std::vector<uint32_t>{37, 5};
            o.raw_value_rows = 3;  // and KVSplice outliers
            out.push_back(o);
          }
        }
      }
    }
  }
  return out;
}

void Put32(std::string* s, size_t off, uint32_t v) { std::memcpy(s->data() + off, &v, 4); }
void Put64(std::string* s, size_t off, uint64_t v) { std::memcpy(s->data() + off, &v, 8); }
// Recomputes the header checksum after a deliberate edit, so the edit itself is what is tested.
void Reseal(std::string* s) { Put32(s, 124, Crc32c(s->data(), 124)); }
void ResealTable(std::string* s) {
  uint32_t n;
  std::memcpy(&n, s->data() + 52, 4);
  Put32(s, 80, Crc32c(s->data() + 128, 32ull * n));
  Reseal(s);
}

TEST(Format, RoundTripsEveryCodecAndDtype) {
  uint64_t seed = 1;
  for (const auto& o : AllVariants()) {
    const CompressedCache c = RandomCache(o, seed++);
    ASSERT_TRUE(c.Validate().ok()) << c.Validate();
    uint32_t crc = 0;
    auto bytes = format::EncodeCache(c, &crc);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(crc, Crc32c(bytes->data(), bytes->size()));  // combined from the sections'
    EXPECT_EQ(bytes->size(), *format::EncodedSize(c));
    EXPECT_EQ(bytes->size(), c.Breakdown().total());
    auto back = format::ParseCache(*bytes);
    ASSERT_TRUE(back.ok()) << back.status() << " " << c.DebugString();
    EXPECT_TRUE(*back == c) << c.DebugString();
    auto info = format::PeekCache(*bytes);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->total_kept, c.total_kept());
    EXPECT_EQ(info->layout, c.layout);
    // Encoding is deterministic: the same cache gives the same bytes.
    EXPECT_EQ(*format::EncodeCache(*back), *bytes);
  }
}

// A cache of the pq codecs (1.5): keys at `key_bits` bits a row, values at `value_bits`, random
// records with the bits after each row's codes zero, naming a calibration.
CompressedCache PqCache(uint32_t key_bits, uint32_t value_bits, uint64_t seed) {
  RandomCacheOptions o;
  o.moments = false;
  CompressedCache c = RandomCache(o, seed);
  std::mt19937_64 rng(seed);
  auto records = [&](uint32_t bits) {
    const uint64_t row = (bits + 7) / 8;
    std::vector<uint8_t> out(c.total_kept() * row);
    for (uint64_t i = 0; i < out.size(); ++i) {
      out[i] = static_cast<uint8_t>(rng());
      if (i % row == row - 1 && bits % 8 != 0) {
        out[i] &= static_cast<uint8_t>((1u << (bits % 8)) - 1);
      }
    }
    return out;
  };
  c.key_codec = KeyCodec::kPq;
  c.value_codec = ValueCodec::kPq;
  c.policy.key_codec = KeyCodec::kPq;
  c.policy.value_codec = ValueCodec::kPq;
  c.pq_key_bits = key_bits;
  c.pq_value_bits = value_bits;
  c.pq_key_basis = 0x1234567890abcdefull;
  c.pq_value_basis = 0x0fedcba987654321ull;
  c.projection_version = 0x5555aaaa5555aaaaull;
  c.keys = records(key_bits);
  c.values = records(value_bits);
  return c;
}

TEST(Format, PqCachesRoundTripAndTheirHeaderFieldsAreChecked) {
  for (uint32_t kb : {192u, 37u}) {
    const CompressedCache c = PqCache(kb, 128, kb);
    ASSERT_TRUE(c.Validate().ok()) << c.Validate();
    EXPECT_EQ(c.KeyTokenBytes(), (kb + 7) / 8);
    auto bytes = format::EncodeCache(c);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    uint16_t minor;
    std::memcpy(&minor, bytes->data() + 6, 2);
    EXPECT_EQ(minor, 5);
    auto back = format::ParseCache(*bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == c);
    auto info = format::PeekCache(*bytes);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->pq_key_bits, kb);
    EXPECT_EQ(info->pq_value_basis, c.pq_value_basis);
    EXPECT_EQ(info->projection_version, c.projection_version);
    // Header fields that disagree with the codecs: refused (header checksum resealed).
    auto refused = [&](size_t off, uint64_t v, int width) {
      std::string b = *bytes;
      if (width == 8) Put64(&b, off, v); else Put32(&b, off, static_cast<uint32_t>(v));
      Reseal(&b);
      return format::ParseCache(b).status().code() == absl::StatusCode::kInvalidArgument;
    };
    EXPECT_TRUE(refused(100, 0, 4));              // pq keys without bits
    EXPECT_TRUE(refused(100, 8 * 64 + 1, 4));     // more bits than 8 x head_dim
    EXPECT_TRUE(refused(84, 0, 8));               // pq keys without a basis fingerprint
    EXPECT_TRUE(refused(72, 0, 8));               // no calibration version
    EXPECT_TRUE(refused(108, 1, 4));              // reserved bytes
    EXPECT_TRUE(refused(100, kb + 8, 4));         // sizes no longer add up
    std::string raw_keys = *bytes;
    raw_keys[41] = static_cast<char>(KeyCodec::kRaw);  // raw keys still naming a basis
    Reseal(&raw_keys);
    EXPECT_FALSE(format::ParseCache(raw_keys).ok());
    std::string unknown = *bytes;
    unknown[41] = 7;  // no such codec
    Reseal(&unknown);
    EXPECT_EQ(format::ParseCache(unknown).status().code(), absl::StatusCode::kInvalidArgument);
  }
  // A record with a bit set after its codes (37 bits: 3 spare in the fifth byte).
  CompressedCache bad = PqCache(37, 128, 9);
  bad.keys[4] |= 0x20;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(format::EncodeCache(bad).ok());
  // pq beside KVSplice values: one calibration per cache.
  CompressedCache mixed = PqCache(192, 128, 10);
  mixed.value_codec = ValueCodec::kOrthogonal;
  mixed.pq_value_bits = 0;
  mixed.pq_value_basis = 0;
  mixed.rank = 8;
  mixed.values.assign(mixed.total_kept() * 16, 0);
  EXPECT_EQ(mixed.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// int4 keys: d scales per group of 128 kept tokens of each head, so the key-scale section follows
// the kept counts; a section of another size, and an unknown key codec, are refused.
TEST(Format, Int4KeyScalesFollowTheKeptCounts) {
  RandomCacheOptions o;
  o.original_tokens = 300;
  o.key_codec = KeyCodec::kInt4;
  for (uint64_t seed = 0; seed < 6; ++seed) {
    CompressedCache c = RandomCache(o, seed);
    uint64_t groups = 0;
    for (uint32_t k : c.kept) groups += (k + 127) / 128;
    ASSERT_EQ(c.key_scales.size(), groups * c.layout.head_dim);
    EXPECT_EQ(c.KeyTokenBytes(), c.layout.head_dim / 2);
    EXPECT_EQ(c.KeyScaleOffset(1), uint64_t{(c.kept[0] + 127) / 128} * c.layout.head_dim);
    auto bytes = format::EncodeCache(c);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    uint16_t minor;
    std::memcpy(&minor, bytes->data() + 6, 2);
    EXPECT_EQ(minor, format::kMinorVersion);
    auto back = format::ParseCache(*bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == c);
    EXPECT_EQ(c.Breakdown().key_scales, groups * c.layout.head_dim * 4);
    // One group of scales too few or too many: the cache is inconsistent.
    CompressedCache bad = c;
    bad.key_scales.resize(bad.key_scales.size() + c.layout.head_dim);
    EXPECT_FALSE(bad.Validate().ok());
    EXPECT_FALSE(format::EncodeCache(bad).ok());
    // The same bytes read as int8 keys (one scale set per head, d bytes a token) do not parse.
    std::string as_int8 = *bytes;
    as_int8[41] = static_cast<char>(KeyCodec::kInt8);
    Reseal(&as_int8);
    EXPECT_FALSE(format::ParseCache(as_int8).ok());
    std::string unknown = *bytes;
    unknown[41] = 4;
    Reseal(&unknown);
    EXPECT_EQ(format::ParseCache(unknown).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(Format, RoundTripsEdgeShapes) {
  RandomCacheOptions o;
  o.original_tokens = 1;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    auto c = RandomCache(o, seed);
    auto back = format::ParseCache(*format::EncodeCache(c));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == c);
  }
  o.layout = KvLayout{3, 8, 32, 256, DType::kF16};
  o.original_tokens = 300;
  auto c = RandomCache(o, 99);
  c.policy.scorer = Scorer::kWindowedManifold;
  c.policy.head_budget = HeadBudget::kAdaKV;
  c.policy.window = 77;
  c.policy.seed = 0xdeadbeefcafeull;
  auto back = format::ParseCache(*format::EncodeCache(c));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->policy, c.policy);
  EXPECT_TRUE(*back == c);
}

// The policy section (id 2) of an encoding: its table entry's byte offset.
size_t PolicyEntry(const std::string& b) {
  uint32_t n;
  std::memcpy(&n, b.data() + 52, 4);
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t id;
    std::memcpy(&id, b.data() + 128 + 32 * i, 4);
    if (id == format::kPolicy) return 128 + 32 * i;
  }
  return 0;
}

// Rewrites the policy section's record `want_tag` (an f64 value) after an edit: `drop` removes it
// (as a writer that did not know the tag: the records after it move up), otherwise its value
// becomes `value`. Checksums resealed.
void EditPolicyRecord(std::string* b, uint16_t want_tag, bool drop, double value) {
  const size_t e = PolicyEntry(*b);
  ASSERT_NE(e, 0u);
  uint64_t off, size;
  std::memcpy(&off, b->data() + e + 8, 8);
  std::memcpy(&size, b->data() + e + 16, 8);
  uint64_t at = 0;
  uint16_t tag = 0, len = 0;
  while (at + 4 <= size) {
    std::memcpy(&tag, b->data() + off + at, 2);
    std::memcpy(&len, b->data() + off + at + 2, 2);
    if (tag == want_tag) break;
    at += 4 + len;
  }
  ASSERT_EQ(tag, want_tag);
  ASSERT_EQ(len, 8);
  if (drop) {
    char* rec = b->data() + off + at;
    std::memmove(rec, rec + 12, size - at - 12);
    std::memset(b->data() + off + size - 12, 0, 12);  // becomes padding before the next section
    size -= 12;
    Put64(b, e + 16, size);
  } else {
    std::memcpy(b->data() + off + at + 4, &value, 8);
  }
  Put32(b, e + 24, Crc32c(b->data() + off, size));
  ResealTable(b);
}

TEST(Format, RecentFractionRoundTrips) {
  RandomCacheOptions o;
  auto c = RandomCache(o, 5);
  for (double f : {0.0, 0.25, 0.5, 0.999}) {
    c.policy.recent_fraction = f;
    c.policy.n_recent = 3;
    auto back = format::ParseCache(*format::EncodeCache(c));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->policy.recent_fraction, f);
    EXPECT_EQ(back->policy, c.policy);
    EXPECT_TRUE(*back == c);
  }
}

TEST(Format, ReadsAVersion11PolicyWithoutRecentFraction) {
  RandomCacheOptions o;
  auto c = RandomCache(o, 6);
  c.policy.n_recent = 7;
  c.policy.recent_fraction = 0.5;
  std::string b = *format::EncodeCache(c);
  // As a 1.1 writer produced it: no tag 23, minor version 1.
  EditPolicyRecord(&b, 23, /*drop=*/true, 0);
  const uint16_t minor = 1;
  std::memcpy(b.data() + 6, &minor, 2);
  Reseal(&b);
  auto back = format::ParseCache(b);
  ASSERT_TRUE(back.ok()) << back.status();
  // the field's absent value, the 1.1 behaviour (not today's default of a new policy)
  EXPECT_EQ(back->policy.recent_fraction, 0.0);
  EXPECT_NE(back->policy.recent_fraction, CompressionPolicy().recent_fraction);
  EXPECT_EQ(back->policy.n_recent, 7u);
  CompressedCache want = c;
  want.policy.recent_fraction = 0.0;
  EXPECT_TRUE(*back == want);
  // Re-encoding writes the current version, with the tag.
  auto again = format::ParseCache(*format::EncodeCache(*back));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again == want);
}

TEST(Format, StoredRecentFractionOutOfRangeIsRejected) {
  RandomCacheOptions o;
  auto c = RandomCache(o, 7);
  for (double bad : {1.0, -0.25, std::nan("")}) {
    std::string b = *format::EncodeCache(c);
    EditPolicyRecord(&b, 23, /*drop=*/false, bad);
    auto back = format::ParseCache(b);
    ASSERT_FALSE(back.ok());
    EXPECT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(back.status().message().find("recent_fraction"), std::string::npos)
        << back.status();
  }
}

TEST(Format, GammaAwareFlagRoundTripsAndNeedsQuantizedValues) {
  RandomCacheOptions o;
  o.value_codec = ValueCodec::kOrthogonalInt4;
  o.rank = 64;
  auto c = RandomCache(o, 21);
  c.value_gamma = true;
  const std::string bytes = *format::EncodeCache(c);
  auto back = format::ParseCache(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->value_gamma);
  EXPECT_TRUE(*back == c);
  EXPECT_TRUE(format::PeekCache(bytes)->value_gamma);
  back->value_gamma = false;
  EXPECT_FALSE(*back == c);
  o.value_codec = ValueCodec::kOrthogonal;
  auto f16 = RandomCache(o, 22);
  f16.value_gamma = true;
  EXPECT_EQ(format::EncodeCache(f16).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Format, EncodeRejectsInconsistentCache) {
  auto c = RandomCache(RandomCacheOptions{}, 3);
  c.positions.push_back(0);
  EXPECT_EQ(format::EncodeCache(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = RandomCache(RandomCacheOptions{}, 3);
  if (c.kept[0] >= 2) {
    std::swap(c.positions[0], c.positions[1]);
    EXPECT_FALSE(format::EncodeCache(c).ok());
  }
  c = RandomCache(RandomCacheOptions{}, 4);
  c.moment_count[0] += 1;
  EXPECT_FALSE(format::EncodeCache(c).ok());
}

TEST(Format, TruncatedAtEveryOffsetFails) {
  RandomCacheOptions o;
  o.key_codec = KeyCodec::kInt8;
  o.value_codec = ValueCodec::kOrthogonalInt4;
  o.rank = 32;
  o.original_tokens = 9;
  const std::string bytes = *format::EncodeCache(RandomCache(o, 5));
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = format::ParseCache(absl::string_view(bytes.data(), n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << n << " " << r.status();
  }
  std::string longer = bytes + std::string(64, '\0');
  EXPECT_EQ(format::ParseCache(longer).status().code(), absl::StatusCode::kDataLoss);
}

TEST(Format, EveryFlippedBitIsDetected) {
  RandomCacheOptions o;
  o.layout = KvLayout{1, 2, 2, 64, DType::kF16};
  o.original_tokens = 5;
  o.value_codec = ValueCodec::kOrthogonalInt8;
  o.rank = 8;
  o.group_size = 4;
  const std::string bytes = *format::EncodeCache(RandomCache(o, 11));
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit : {0, 3, 7}) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      EXPECT_FALSE(format::ParseCache(bad).ok()) << "byte " << i << " bit " << bit;
    }
  }
}

TEST(Format, WrongMagic) {
  std::string b = *format::EncodeCache(RandomCache(RandomCacheOptions{}, 1));
  b[0] = 'X';
  auto r = format::ParseCache(b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("magic"), std::string::npos);
}

TEST(Format, VersionFromTheFuture) {
  std::string b = *format::EncodeCache(RandomCache(RandomCacheOptions{}, 1));
  b[4] = 2;
  Reseal(&b);
  auto r = format::ParseCache(b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("newer"), std::string::npos);
}

TEST(Format, HeaderChecksumMismatch) {
  std::string b = *format::EncodeCache(RandomCache(RandomCacheOptions{}, 1));
  b[60] ^= 1;  // original_tokens, without resealing
  EXPECT_EQ(format::ParseCache(b).status().code(), absl::StatusCode::kDataLoss);
}

TEST(Format, SectionChecksumMismatch) {
  std::string b = *format::EncodeCache(RandomCache(RandomCacheOptions{}, 1));
  b[b.size() - 100] ^= 0x40;  // inside the last (moments) section
  auto r = format::ParseCache(b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("checksum"), std::string::npos);
}

// Sections of several 256 KiB pieces (the encoder copies and checksums a piece at a time): the
// encoding parses back equal, and a flipped bit in a later piece of the keys is found.
TEST(Format, SectionsOfManyPiecesRoundTripAndAreChecked) {
  RandomCacheOptions o;
  o.layout = KvLayout{2, 4, 8, 128, DType::kBF16};
  o.original_tokens = 2000;  // keys and values of up to 2 x 4 x 2000 x 256 bytes each
  const CompressedCache c = RandomCache(o, 7);
  ASSERT_GT(c.keys.size(), uint64_t{5} << 18);
  uint32_t crc = 0;
  auto bytes = format::EncodeCache(c, &crc);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(crc, Crc32c(bytes->data(), bytes->size()));
  auto back = format::ParseCache(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == c);
  std::vector<format::SectionSpan> spans;
  ASSERT_TRUE(format::PeekHeader(*bytes, bytes->size(), &spans).ok());
  for (const auto& span : spans) {
    if (span.size < (uint64_t{3} << 18)) continue;
    std::string bad = *bytes;
    bad[span.offset + (uint64_t{5} << 17) + 11] ^= 0x10;  // in the third piece
    auto r = format::ParseCache(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << "section " << span.id;
  }
}

TEST(Format, CountsBeyondLayout) {
  // original_tokens smaller than a head's kept count: sealed so only the semantics are wrong.
  RandomCacheOptions o;
  o.moments = false;
  auto c = RandomCache(o, 2);
  std::string b = *format::EncodeCache(c);
  Put64(&b, 56, 1);
  Reseal(&b);
  EXPECT_EQ(format::ParseCache(b).status().code(), absl::StatusCode::kInvalidArgument);
  // More kv heads than the layout allows.
  b = *format::EncodeCache(c);
  Put32(&b, 28, 100000);
  Reseal(&b);
  EXPECT_EQ(format::ParseCache(b).status().code(), absl::StatusCode::kInvalidArgument);
  // total_kept that disagrees with the head table.
  b = *format::EncodeCache(c);
  Put64(&b, 64, c.total_kept() + 1);
  Reseal(&b);
  EXPECT_EQ(format::ParseCache(b).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Format, SizesThatOverflow) {
  auto c = RandomCache(RandomCacheOptions{}, 2);
  std::string b = *format::EncodeCache(c);
  // First section entry: size near 2^64 (offset + size wraps).
  Put64(&b, 128 + 16, ~uint64_t{0} - 10);
  ResealTable(&b);
  EXPECT_EQ(format::ParseCache(b).status().code(), absl::StatusCode::kInvalidArgument);
  b = *format::EncodeCache(c);
  Put64(&b, 64, ~uint64_t{0});  // total_kept
  Reseal(&b);
  EXPECT_FALSE(format::ParseCache(b).ok());
  b = *format::EncodeCache(c);
  Put32(&b, 52, 0xffffffffu);  // num_sections
  Reseal(&b);
  EXPECT_FALSE(format::ParseCache(b).ok());
}

TEST(Format, PerLayerRanksRoundTripInARequiredSection) {
  RandomCacheOptions o;
  o.layout = KvLayout{3, 2, 4, 64, DType::kF16};
  o.value_codec = ValueCodec::kOrthogonalInt8;
  o.layer_rank = {8, 30, 17};
  o.group_size = 16;
  const CompressedCache c = RandomCache(o, 31);
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  EXPECT_EQ(c.rank, 30u);
  // Values and scales take each layer's own rank: fewer bytes than all layers at the largest.
  uint64_t want_values = 0, want_scales = 0;
  for (uint32_t h = 0; h < c.num_heads(); ++h) {
    const uint32_t r = o.layer_rank[h / 2];
    want_values += uint64_t{c.kept[h]} * r;
    want_scales += uint64_t{c.kept[h]} * ((r + 15) / 16);
  }
  EXPECT_EQ(c.values.size(), want_values);
  EXPECT_EQ(c.value_scales.size(), want_scales);
  EXPECT_LT(c.values.size(), c.total_kept() * c.rank);
  const std::string b = *format::EncodeCache(c);
  EXPECT_EQ(b.size(), c.Breakdown().total());
  auto back = format::ParseCache(b);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == c);
  EXPECT_EQ(back->layer_rank, o.layer_rank);
  auto info = format::PeekCache(b);
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->layer_ranks);
  EXPECT_EQ(info->rank, 30u);
  // Section 12 is the last one and flagged required: a 1.0 reader, which does not know it,
  // refuses the cache instead of reading the values at the wrong rank.
  uint32_t n, id, flags;
  std::memcpy(&n, b.data() + 52, 4);
  std::memcpy(&id, b.data() + 128 + 32 * (n - 1), 4);
  std::memcpy(&flags, b.data() + 128 + 32 * (n - 1) + 4, 4);
  EXPECT_EQ(id, format::kLayerRanks);
  EXPECT_EQ(flags & format::kSectionRequired, format::kSectionRequired);
  uint16_t minor;
  std::memcpy(&minor, b.data() + 6, 2);
  EXPECT_EQ(minor, format::kMinorVersion);
  // A uniform cache has no section 12 and reads as before.
  o.layer_rank.clear();
  o.rank = 30;
  const CompressedCache u = RandomCache(o, 32);
  EXPECT_FALSE(format::PeekCache(*format::EncodeCache(u))->layer_ranks);
}

TEST(Format, InconsistentLayerRanksAreRejected) {
  RandomCacheOptions o;
  o.value_codec = ValueCodec::kOrthogonalInt4;
  o.layer_rank = {20, 40};
  o.group_size = 16;
  const CompressedCache good = RandomCache(o, 41);
  ASSERT_TRUE(good.Validate().ok()) << good.Validate();
  auto bad = good;
  bad.layer_rank = {21, 40};  // odd rank for int4
  EXPECT_EQ(format::EncodeCache(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = good;
  bad.layer_rank = {20};  // one per layer
  EXPECT_EQ(format::EncodeCache(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = good;
  bad.rank = 48;  // rank must be the largest layer rank
  EXPECT_EQ(format::EncodeCache(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = good;
  bad.layer_rank = {0, 40};
  EXPECT_EQ(format::EncodeCache(bad).status().code(), absl::StatusCode::kInvalidArgument);
  // On the wire: a layer rank above the header's rank, with every checksum right, is refused.
  std::string b = *format::EncodeCache(good);
  uint32_t n;
  uint64_t off;
  std::memcpy(&n, b.data() + 52, 4);
  std::memcpy(&off, b.data() + 128 + 32 * (n - 1) + 8, 8);
  Put32(&b, off, 42);
  Put32(&b, 128 + 32 * (n - 1) + 24, Crc32c(b.data() + off, 8));
  ResealTable(&b);
  EXPECT_EQ(format::ParseCache(b).status().code(), absl::StatusCode::kInvalidArgument);
  // Raw values never carry layer ranks.
  RandomCacheOptions r;
  r.layer_rank = {};
  auto raw = RandomCache(r, 42);
  raw.layer_rank = {1, 1};
  EXPECT_EQ(format::EncodeCache(raw).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Format, RawValueRowsRoundTripAndAreChecked) {
  RandomCacheOptions o;
  o.layout = KvLayout{2, 2, 4, 64, DType::kBF16};
  o.original_tokens = 90;
  o.value_codec = ValueCodec::kOrthogonalInt8;
  o.rank = 24;
  o.raw_value_rows = 7;
  const CompressedCache c = RandomCache(o, 51);
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  ASSERT_EQ(c.raw_value_rows.size(), 7u);
  EXPECT_EQ(c.Breakdown().raw_values, 7u * 8 + 7u * 64 * 2);
  const std::string b = *format::EncodeCache(c);
  EXPECT_EQ(b.size(), c.Breakdown().total());
  auto back = format::ParseCache(b);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == c);
  EXPECT_EQ(format::PeekCache(b)->raw_value_rows, 7u);
  auto bad = c;
  std::swap(bad.raw_value_rows[0], bad.raw_value_rows[1]);  // not ascending
  EXPECT_EQ(format::EncodeCache(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = c;
  bad.raw_value_rows.back() = c.total_kept();  // beyond the kept rows
  EXPECT_EQ(format::EncodeCache(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = c;
  bad.raw_values.pop_back();  // one byte short
  EXPECT_EQ(format::EncodeCache(bad).status().code(), absl::StatusCode::kInvalidArgument);
  // On the wire: section 13 claiming a row beyond the kept tokens, checksums right, is refused.
  std::string w = b;
  uint32_t n;
  std::memcpy(&n, w.data() + 52, 4);
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t id;
    uint64_t off;
    std::memcpy(&id, w.data() + 128 + 32 * i, 4);
    std::memcpy(&off, w.data() + 128 + 32 * i + 8, 8);
    if (id != format::kRawValueRows) continue;
    Put64(&w, off + 6 * 8, c.total_kept() + 5);
    Put32(&w, 128 + 32 * i + 24, Crc32c(w.data() + off, 7 * 8));
  }
  ResealTable(&w);
  EXPECT_EQ(format::ParseCache(w).status().code(), absl::StatusCode::kInvalidArgument);
  // Raw values never carry outlier rows.
  RandomCacheOptions r;
  auto plain = RandomCache(r, 52);
  plain.raw_value_rows = {0};
  plain.raw_values.assign(DTypeBytes(plain.layout.dtype, plain.layout.head_dim), 1);
  EXPECT_EQ(format::EncodeCache(plain).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Format, UnknownRequiredSectionIsRejectedOptionalIgnored) {
  auto c = RandomCache(RandomCacheOptions{}, 2);
  std::string b = *format::EncodeCache(c);
  uint32_t n;
  std::memcpy(&n, b.data() + 52, 4);
  // Renumber the last section (moment vk sum, id 11) to an unknown id 40.
  Put32(&b, 128 + 32 * (n - 1), 40);
  ResealTable(&b);
  EXPECT_EQ(format::ParseCache(b).status().code(), absl::StatusCode::kFailedPrecondition);
  Put32(&b, 128 + 32 * (n - 1) + 4, 0);  // optional: skipped, then vk sum is missing
  ResealTable(&b);
  auto r = format::ParseCache(b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("missing"), std::string::npos);
}

TEST(Format, RandomGarbageNeverCrashes) {
  std::mt19937_64 rng(5);
  const std::string good = *format::EncodeCache(RandomCache(RandomCacheOptions{}, 8));
  for (int i = 0; i < 2000; ++i) {
    std::string b = good;
    const int edits = 1 + static_cast<int>(rng() % 8);
    for (int e = 0; e < edits; ++e) b[rng() % b.size()] = static_cast<char>(rng());
    if (rng() % 2) {
      Reseal(&b);
      if (rng() % 2) ResealTable(&b);
    }
    auto r = format::ParseCache(b);
    if (r.ok()) {
      EXPECT_TRUE(r->Validate().ok());
    }
  }
}

}  // namespace
}  // namespace kvcomp

namespace kvcomp {
namespace {

// The plan from the counts alone (the arrays emptied, as a device encoder holds the cache) is
// the layout EncodeCache writes, and WriteHeaderAndTable with the sections' CRCs writes its
// header and table byte for byte.
TEST(FormatPlan, ThePlanFromTheCountsIsTheEncodersLayout) {
  uint64_t seed = 500;
  for (const RandomCacheOptions& o : AllVariants()) {
    const CompressedCache c = RandomCache(o, seed++);
    absl::StatusOr<std::string> bytes = format::EncodeCache(c);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    CompressedCache shape = c;
    shape.positions.clear();
    shape.keys.clear();
    shape.key_scales.clear();
    shape.values.clear();
    shape.value_scales.clear();
    shape.raw_value_rows.clear();
    shape.raw_values.clear();
    shape.moment_count.clear();
    shape.moment_key_sum.clear();
    shape.moment_value_sum.clear();
    shape.moment_vk_sum.clear();
    absl::StatusOr<format::EncodingPlan> plan =
        format::PlanEncoding(shape, c.raw_value_rows.size());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->total_bytes, bytes->size());
    std::vector<uint32_t> crcs;
    for (size_t i = 0; i < plan->sections.size(); ++i) {
      const char* e = bytes->data() + 128 + 32 * i;
      uint32_t id, crc;
      uint64_t off, size;
      std::memcpy(&id, e, 4);
      std::memcpy(&off, e + 8, 8);
      std::memcpy(&size, e + 16, 8);
      std::memcpy(&crc, e + 24, 4);
      EXPECT_EQ(plan->sections[i].id, id);
      EXPECT_EQ(plan->sections[i].offset, off);
      EXPECT_EQ(plan->sections[i].size, size);
      crcs.push_back(crc);
    }
    std::string header(plan->table_end(), '\x55');
    ASSERT_TRUE(format::WriteHeaderAndTable(
                    shape, *plan, crcs,
                    absl::MakeSpan(reinterpret_cast<uint8_t*>(header.data()), header.size()))
                    .ok());
    EXPECT_EQ(header, bytes->substr(0, plan->table_end()));
    EXPECT_TRUE(absl::IsInvalidArgument(
        format::WriteHeaderAndTable(shape, *plan, absl::MakeSpan(crcs).subspan(1),
                                    absl::MakeSpan(reinterpret_cast<uint8_t*>(header.data()),
                                                   header.size()))));
  }
}

TEST(FormatPlan, PeekHeaderReadsTheHeaderAndTableAlone) {
  const CompressedCache c = RandomCache(RandomCacheOptions{}, 11);
  const std::string bytes = *format::EncodeCache(c);
  auto plan = format::PlanEncoding(c, 0);
  ASSERT_TRUE(plan.ok());
  const std::string head = bytes.substr(0, plan->table_end());
  absl::StatusOr<format::CacheInfo> a = format::PeekHeader(head, bytes.size());
  absl::StatusOr<format::CacheInfo> b = format::PeekCache(bytes);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->total_bytes, b->total_bytes);
  EXPECT_EQ(a->total_kept, b->total_kept);
  EXPECT_EQ(a->has_moments, b->has_moments);
  EXPECT_FALSE(format::PeekHeader(head, bytes.size() + 64).ok());
  EXPECT_FALSE(format::PeekHeader(head.substr(0, head.size() - 1), bytes.size()).ok());
  std::string flipped = head;
  flipped[130] ^= 1;  // inside the table
  EXPECT_TRUE(absl::IsDataLoss(format::PeekHeader(flipped, bytes.size()).status()));
  // The sections where the plan put them: a reader finds the keys and values in place.
  std::vector<format::SectionSpan> spans;
  ASSERT_TRUE(format::PeekHeader(head, bytes.size(), &spans).ok());
  ASSERT_EQ(spans.size(), plan->sections.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_EQ(spans[i].id, plan->sections[i].id);
    EXPECT_EQ(spans[i].offset, plan->sections[i].offset);
    EXPECT_EQ(spans[i].size, plan->sections[i].size);
    if (spans[i].id == 4) {
      EXPECT_EQ(bytes.substr(spans[i].offset, spans[i].size),
                std::string(c.keys.begin(), c.keys.end()));
    }
  }
}

// A cache of `l` that kept all `T` tokens of every head (no keys or values yet).
CompressedCache KeptEveryToken(const KvLayout& l, uint64_t T) {
  CompressedCache c;
  c.layout = l;
  c.original_tokens = T;
  c.policy.ratio = 0;
  for (uint64_t h = 0; h < l.num_heads_total(); ++h) {
    c.kept.push_back(T);
    for (uint32_t t = 0; t < T; ++t) c.positions.push_back(t);
  }
  return c;
}

TEST(FormatPlan, DenseKvSectionsOfACacheThatKeptEveryTokenRaw) {
  const KvLayout l{2, 2, 4, 64, DType::kBF16};
  const uint64_t T = 7;
  CompressedCache c = KeptEveryToken(l, T);
  std::mt19937 rng(std::random_device{}());
  c.keys.resize(l.CacheBytes(T) / 2);
  c.values.resize(c.keys.size());
  for (uint8_t& b : c.keys) b = static_cast<uint8_t>(rng());
  for (uint8_t& b : c.values) b = static_cast<uint8_t>(rng());
  const std::string bytes = *format::EncodeCache(c);
  auto plan = format::PlanEncoding(c, 0);
  ASSERT_TRUE(plan.ok());
  // From the header and table alone, the sections hold exactly the dense K and V.
  absl::StatusOr<format::DenseSections> d =
      format::DenseKvSections(bytes.substr(0, plan->table_end()), bytes.size());
  ASSERT_TRUE(d.ok()) << d.status();
  std::string dense(l.CacheBytes(T), '\0');
  ASSERT_TRUE(c.WriteDenseKv(reinterpret_cast<uint8_t*>(dense.data())).ok());
  EXPECT_EQ(bytes.substr(d->keys.offset, d->keys.size), dense.substr(0, dense.size() / 2));
  EXPECT_EQ(bytes.substr(d->values.offset, d->values.size), dense.substr(dense.size() / 2));
  EXPECT_EQ(d->info.original_tokens, T);
  // A cache that evicted tokens, or encodes them, has no dense form in place.
  const CompressedCache evicted = RandomCache(RandomCacheOptions{}, 5);
  const std::string eb = *format::EncodeCache(evicted);
  EXPECT_TRUE(absl::IsFailedPrecondition(format::DenseKvSections(eb, eb.size()).status()));
  RandomCacheOptions int8;
  int8.key_codec = KeyCodec::kInt8;
  const std::string ib = *format::EncodeCache(RandomCache(int8, 6));
  EXPECT_TRUE(absl::IsFailedPrecondition(format::DenseKvSections(ib, ib.size()).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(format::DenseRowSections(ib, ib.size()).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(format::DenseRowSections(eb, eb.size()).status()));
  // Raw is a dense-row cache too, its sections the same.
  absl::StatusOr<format::DenseSections> r =
      format::DenseRowSections(bytes.substr(0, plan->table_end()), bytes.size());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->keys.offset, d->keys.offset);
  EXPECT_EQ(r->values.size, d->values.size);
}

// A cache that kept every token with hq4 keys and hq3 values: its sections hold one record per
// (layer, head, token) in order, which a decoder turns into the dense K and V; it has no raw
// dense form in place.
TEST(FormatPlan, DenseRowSectionsOfAnHqCacheThatKeptEveryToken) {
  const KvLayout l{2, 2, 4, 64, DType::kBF16};
  const uint64_t T = 9;
  CompressedCache c = KeptEveryToken(l, T);
  c.policy.key_codec = c.key_codec = KeyCodec::kHq4;
  c.policy.value_codec = c.value_codec = ValueCodec::kHq3;
  const uint64_t rows = l.num_heads_total() * T;
  std::mt19937 rng(std::random_device{}());
  // Records with lo = step = 0 (valid for any codes) and random codes.
  auto records = [&](uint64_t row_bytes) {
    std::vector<uint8_t> v(rows * row_bytes, 0);
    for (uint64_t i = 0; i < rows; ++i) {
      for (uint64_t b = 4; b < row_bytes; ++b) v[i * row_bytes + b] = static_cast<uint8_t>(rng());
    }
    return v;
  };
  c.keys = records(4 + 64 * 4 / 8);
  c.values = records(4 + 64 * 3 / 8);
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  const std::string bytes = *format::EncodeCache(c);
  auto plan = format::PlanEncoding(c, 0);
  ASSERT_TRUE(plan.ok());
  const std::string head = bytes.substr(0, plan->table_end());
  absl::StatusOr<format::DenseSections> d = format::DenseRowSections(head, bytes.size());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(bytes.substr(d->keys.offset, d->keys.size), std::string(c.keys.begin(), c.keys.end()));
  EXPECT_EQ(bytes.substr(d->values.offset, d->values.size),
            std::string(c.values.begin(), c.values.end()));
  EXPECT_EQ(d->info.key_codec, KeyCodec::kHq4);
  EXPECT_EQ(d->info.value_codec, ValueCodec::kHq3);
  EXPECT_TRUE(absl::IsFailedPrecondition(format::DenseKvSections(head, bytes.size()).status()));
}

TEST(FormatPlan, InconsistentShapesAreRefused) {
  CompressedCache c = RandomCache(RandomCacheOptions{}, 3);
  CompressedCache bad = c;
  bad.kept.push_back(1);
  EXPECT_TRUE(absl::IsInvalidArgument(format::PlanEncoding(bad, 0).status()));
  bad = c;
  bad.layer_rank = {1, 2, 3};
  EXPECT_TRUE(absl::IsInvalidArgument(format::PlanEncoding(bad, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(format::PlanEncoding(c, 1).status()));  // raw values
}

}  // namespace
}  // namespace kvcomp
