// EncodeOnDevice against format::EncodeCache (gpu label): for every codec pair and dtype, with
// and without moments, per-layer ranks and KVSplice outliers, the bytes written on the device
// are the host encoder's bytes, the CRC is Crc32c of them, the header copy is theirs, and only
// the control bytes cross between host and device. An eviction's compression that wrote its
// sections straight into the format's layout encodes to the CPU's bytes too.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "common/random_cache.h"
#include "gtest/gtest.h"
#include "kernels/codec_test_util.h"
#include "kernels/scoring_test_util.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/format.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/device_format.h"
#include "kvcomp/kernels/pipeline.h"

namespace kvcomp {
namespace {

KVCOMP_GPU_TEST_BINARY();

using testing::RandomCache;
using testing::RandomCacheOptions;

std::vector<RandomCacheOptions> Variants() {
  std::vector<RandomCacheOptions> out;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (KeyCodec kc : {KeyCodec::kRaw, KeyCodec::kFp16, KeyCodec::kInt8, KeyCodec::kInt4}) {
      for (ValueCodec vc : {ValueCodec::kRaw, ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                            ValueCodec::kOrthogonalInt4}) {
        for (bool moments : {false, true}) {
          RandomCacheOptions o;
          o.layout = KvLayout{2, 3, 6, 64, dt};
          o.original_tokens = 300;
          o.key_codec = kc;
          o.value_codec = vc;
          o.rank = vc == ValueCodec::kRaw ? 0 : (vc == ValueCodec::kOrthogonalInt4 ? 40 : 37);
          o.group_size = 16;
          o.moments = moments;
          out.push_back(o);
          if (vc != ValueCodec::kRaw) {
            o.layer_rank = vc == ValueCodec::kOrthogonalInt4 ? std::vector<uint32_t>{12, 40}
                                                             : std::vector<uint32_t>{37, 5};
            o.raw_value_rows = 5;
            out.push_back(o);
          }
        }
      }
    }
  }
  return out;
}

class DeviceFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto b = MakeCudaBackend();
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
  }
  template <typename T>
  DeviceSection Up(uint32_t id, const std::vector<T>& v, size_t extra = 0) {
    const size_t bytes = v.size() * sizeof(T);
    auto buf = Buffer::Allocate(backend_->allocator(), std::max<size_t>(bytes + extra, 1));
    EXPECT_TRUE(buf.ok());
    EXPECT_TRUE(backend_->CopyFromHost(buf->data(), v.data(), bytes).ok());
    held_.push_back(*std::move(buf));
    return {id, held_.back().data(), bytes + extra};
  }
  // Every section of `c` that is not written from host fields, in device memory.
  std::vector<DeviceSection> DeviceSections(const CompressedCache& c) {
    std::vector<DeviceSection> s;
    s.push_back(Up(format::kPositions, c.positions));
    s.push_back(Up(format::kKeys, c.keys, 100));  // a buffer may be larger than its array
    if (c.key_codec == KeyCodec::kInt8 || c.key_codec == KeyCodec::kInt4) {
      s.push_back(Up(format::kKeyScales, c.key_scales));
    }
    s.push_back(Up(format::kValues, c.values));
    if (c.ValueGroups() > 0) s.push_back(Up(format::kValueScales, c.value_scales));
    if (c.has_moments) {
      s.push_back(Up(format::kMomentCount, c.moment_count));
      s.push_back(Up(format::kMomentKeySum, c.moment_key_sum));
      s.push_back(Up(format::kMomentValueSum, c.moment_value_sum));
      s.push_back(Up(format::kMomentVkSum, c.moment_vk_sum));
    }
    if (!c.raw_value_rows.empty()) {
      s.push_back(Up(format::kRawValueRows, c.raw_value_rows));
      s.push_back(Up(format::kRawValues, c.raw_values));
    }
    return s;
  }
  static CompressedCache ShapeOf(const CompressedCache& c) {
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
    return shape;
  }

  std::unique_ptr<Backend> backend_;
  std::vector<Buffer> held_;
};

TEST_F(DeviceFormatTest, BytesAreTheHostEncodersForEveryCodec) {
  uint64_t seed = 1;
  for (const RandomCacheOptions& o : Variants()) {
    const CompressedCache c = RandomCache(o, seed++);
    SCOPED_TRACE(c.DebugString());
    absl::StatusOr<std::string> want = format::EncodeCache(c);
    ASSERT_TRUE(want.ok()) << want.status();
    const std::vector<DeviceSection> sections = DeviceSections(c);
    TransferBytes moved;
    absl::StatusOr<DeviceEncodedCache> got =
        EncodeOnDevice(*backend_, ShapeOf(c), c.raw_value_rows.size(), sections, &moved);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size, want->size());
    std::string bytes(got->size, '\0');
    ASSERT_TRUE(backend_->CopyToHost(bytes.data(), got->bytes.data(), got->size).ok());
    ASSERT_TRUE(bytes == *want) << "first difference at "
                                << std::mismatch(bytes.begin(), bytes.end(), want->begin()).first -
                                       bytes.begin();
    EXPECT_EQ(got->crc32c, Crc32c(want->data(), want->size()));
    auto plan = format::PlanEncoding(c, c.raw_value_rows.size());
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(got->header, want->substr(0, plan->table_end()));
    // Up: the header region (through the policy section's padding) and the layer ranks; down:
    // one CRC per device section.
    uint64_t up = plan->sections[2].offset, device_sections = 0;
    for (const format::SectionSpan& s : plan->sections) {
      if (s.id == format::kLayerRanks) up += (s.size + 63) / 64 * 64;
      if (s.id != format::kHeads && s.id != format::kPolicy && s.id != format::kLayerRanks) {
        ++device_sections;
      }
    }
    EXPECT_EQ(moved.to_device, up);
    EXPECT_EQ(moved.to_host, device_sections * 4);
    held_.clear();
  }
}

TEST_F(DeviceFormatTest, EmptyHeadsAndTheLargestSectionsStillMatch) {
  RandomCacheOptions o;
  o.layout = KvLayout{4, 8, 32, 128, DType::kBF16};
  o.original_tokens = 2000;
  o.moments = true;
  CompressedCache c = RandomCache(o, 99);
  const CompressedCache empty = [&] {
    RandomCacheOptions e = o;
    e.original_tokens = 1;
    CompressedCache z = RandomCache(e, 5);
    std::fill(z.kept.begin(), z.kept.end(), 0);
    z.positions.clear();
    z.keys.clear();
    z.values.clear();
    for (auto& n : z.moment_count) n = 1;
    return z;
  }();
  for (const CompressedCache* x : {static_cast<const CompressedCache*>(&c), &empty}) {
    absl::StatusOr<std::string> want = format::EncodeCache(*x);
    ASSERT_TRUE(want.ok()) << want.status();
    auto got = EncodeOnDevice(*backend_, ShapeOf(*x), 0, DeviceSections(*x));
    ASSERT_TRUE(got.ok()) << got.status();
    std::string bytes(got->size, '\0');
    ASSERT_TRUE(backend_->CopyToHost(bytes.data(), got->bytes.data(), got->size).ok());
    EXPECT_TRUE(bytes == *want);
    EXPECT_EQ(got->crc32c, Crc32c(want->data(), want->size()));
  }
}

TEST_F(DeviceFormatTest, MissingRepeatedOrShortSectionsAreRefused) {
  RandomCacheOptions o;
  o.moments = true;
  const CompressedCache c = RandomCache(o, 7);
  std::vector<DeviceSection> s = DeviceSections(c);
  std::vector<DeviceSection> missing(s.begin() + 1, s.end());
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeOnDevice(*backend_, ShapeOf(c), 0, missing).status()));
  std::vector<DeviceSection> twice = s;
  twice.push_back(s[0]);
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeOnDevice(*backend_, ShapeOf(c), 0, twice).status()));
  std::vector<DeviceSection> shortened = s;
  shortened[1].size -= 101;
  EXPECT_TRUE(
      absl::IsInvalidArgument(EncodeOnDevice(*backend_, ShapeOf(c), 0, shortened).status()));
  std::vector<DeviceSection> host_one = s;
  host_one.push_back({format::kHeads, s[0].data, 1000});
  EXPECT_TRUE(
      absl::IsInvalidArgument(EncodeOnDevice(*backend_, ShapeOf(c), 0, host_one).status()));
  CompressedCache bad = ShapeOf(c);
  bad.kept.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeOnDevice(*backend_, bad, 0, s).status()));
  auto cpu = MakeCpuBackend();
  ASSERT_TRUE(cpu.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(EncodeOnDevice(**cpu, ShapeOf(c), 0, s).status()));
}

// The device compression's own result (CompressToDevice, every key codec with raw and KVSplice
// values, moments on and off) encoded on the device is the host encoding of its Download.
TEST_F(DeviceFormatTest, ACompressionsDeviceResultEncodesAsItsDownload) {
  const KvLayout layout{2, 2, 4, 128, DType::kBF16};
  const uint64_t n = 700;
  testing::LowRankData m;
  m.layers = layout.num_layers;
  m.heads = layout.num_kv_heads;
  m.tokens = static_cast<uint32_t>(n);
  m.d = layout.head_dim;
  m.true_rank = 32;
  m.decay = 0.93;
  m.noise = 0.01;
  const std::vector<float> vf = m.Make(5);
  std::vector<std::vector<uint8_t>> k, v;
  KvCacheView view;
  view.layout = layout;
  view.num_tokens = n;
  const uint64_t per_layer = uint64_t{layout.num_kv_heads} * n * layout.head_dim;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    k.push_back(testing::RandomHeads(layout.dtype, layout.num_kv_heads, n, layout.head_dim,
                                     40 + l)
                    .bytes);
    std::vector<uint8_t> vb(DTypeBytes(layout.dtype, per_layer));
    for (uint64_t i = 0; i < per_layer; ++i) {
      StoreFromFloat(vb.data(), layout.dtype, i, vf[l * per_layer + i]);
    }
    v.push_back(std::move(vb));
  }
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    view.keys.push_back(HeadsView::Dense(k[l].data(), layout.dtype, layout.num_kv_heads, n,
                                         layout.head_dim));
    view.values.push_back(HeadsView::Dense(v[l].data(), layout.dtype, layout.num_kv_heads, n,
                                           layout.head_dim));
  }
  auto cpu = MakeCpuBackend(CpuBackendOptions{2});
  ASSERT_TRUE(cpu.ok());
  CalibrationOptions co;
  co.model_id = "m";
  co.num_layers = layout.num_layers;
  co.num_kv_heads = layout.num_kv_heads;
  co.head_dim = layout.head_dim;
  auto cal = Calibrator::Create(co, cpu->get());
  ASSERT_TRUE(cal.ok()) << cal.status();
  const std::vector<float> train = m.Make(77);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    ASSERT_TRUE(cal->AddLayer(l, m.LayerView(train, l)).ok());
  }
  auto proj = cal->Finish(layout.head_dim);
  ASSERT_TRUE(proj.ok()) << proj.status();
  auto projection = std::make_shared<Projection>(*proj);
  for (ValueCodec vc : {ValueCodec::kRaw, ValueCodec::kOrthogonalInt8}) {
    for (KeyCodec kc : {KeyCodec::kRaw, KeyCodec::kFp16, KeyCodec::kInt8, KeyCodec::kInt4}) {
      for (bool moments : {false, true}) {
        SCOPED_TRACE(::testing::Message() << KeyCodecName(kc) << " / " << ValueCodecName(vc)
                                          << (moments ? " moments" : ""));
        CompressionPolicy p;
        p.scorer = Scorer::kManifold;
        p.ratio = 0.5;
        p.moments = moments;
        p.key_codec = kc;
        p.value_codec = vc;
        if (vc != ValueCodec::kRaw) {
          p.rank = 32;
          p.value_raw_fraction = 0.02;
        }
        CompressOptions o;
        o.projection = projection;
        auto dc = CompressToDevice(*backend_, view, p, o);
        ASSERT_TRUE(dc.ok()) << dc.status();
        auto down = dc->Download(*backend_);
        ASSERT_TRUE(down.ok()) << down.status();
        absl::StatusOr<std::string> want = format::EncodeCache(*down);
        ASSERT_TRUE(want.ok()) << want.status();
        auto got = EncodeOnDevice(*backend_, *dc);
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(got->size, want->size());
        std::string bytes(got->size, '\0');
        ASSERT_TRUE(backend_->CopyToHost(bytes.data(), got->bytes.data(), got->size).ok());
        EXPECT_TRUE(bytes == *want);
        EXPECT_EQ(got->crc32c, Crc32c(want->data(), want->size()));
        EXPECT_EQ(got->device, 0);
      }
    }
  }
}

// Eviction with raw codecs writes its kept rows, positions and moments straight at the format's
// section offsets (DeviceCompressedCache::encoding) and the format only adds the header, the
// padding and the CRCs there: on fresh random shapes, scorers, budgets and inputs (host and
// device, so layer groups too), the bytes are the CPU's. With the streaming scorer (both
// backends keep the same tokens, no moments) they are format::EncodeCache of the CPU backend's
// own compression; otherwise that of the device compression's download. The sections' CRCs
// are read when the format is written (KVCOMP_FORMAT_CRC_BESIDE=1: combined from the parts
// computed beside the compression). The encoding outlives the compression's result.
// KVCOMP_FORMAT_SEED replays a seed.
TEST_F(DeviceFormatTest, EvictionWrittenInPlaceIsTheCpusFormat) {
  const char* env = std::getenv("KVCOMP_FORMAT_SEED");
  const uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
  std::printf("seed %llu (KVCOMP_FORMAT_SEED replays it)\n", static_cast<unsigned long long>(seed));
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const char* off = std::getenv("KVCOMP_FORMAT_IN_PLACE");
  const bool in_place = off == nullptr || std::strcmp(off, "0") != 0;
  const char* crc_env = std::getenv("KVCOMP_FORMAT_CRC_BESIDE");
  const bool beside = crc_env != nullptr && std::strcmp(crc_env, "1") == 0;
  std::mt19937_64 rng(seed);
  auto pick = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  auto cpu = MakeCpuBackend(CpuBackendOptions{2});
  ASSERT_TRUE(cpu.ok());
  const Scorer scorers[] = {Scorer::kStreaming, Scorer::kManifold, Scorer::kKeyDiff,
                            Scorer::kKnorm};
  const DType dtypes[] = {DType::kBF16, DType::kF16, DType::kF32};
  for (int round = 0; round < 12; ++round) {
    const uint32_t kv = static_cast<uint32_t>(pick(1, 8));
    const KvLayout layout{static_cast<uint32_t>(pick(1, 5)), kv, kv * 2,
                          pick(0, 1) == 0 ? 64u : 128u, dtypes[pick(0, 2)]};
    const uint64_t n = pick(0, 3) == 0 ? pick(1, 40) : pick(41, 2500);
    CompressionPolicy p;
    p.scorer = round < 4 ? Scorer::kStreaming : scorers[pick(0, 3)];
    if (pick(0, 2) == 0) {
      p.token_budget = static_cast<uint32_t>(pick(1, n + 20));
    } else {
      p.ratio = 0.05 + 0.9 * std::uniform_real_distribution<double>(0, 1)(rng);
      // A ratio that keeps no token of a short head is refused (budget of zero) by every
      // backend: such a head is given a token budget instead, so the round compresses.
      if (p.KeptPerHead(n) == 0) p.token_budget = static_cast<uint32_t>(pick(1, n + 20));
    }
    p.moments = p.scorer != Scorer::kStreaming && pick(0, 1) == 1;
    p.moment_aware = p.moments && pick(0, 2) == 0;
    const bool on_device = pick(0, 1) == 1;
    SCOPED_TRACE(::testing::Message()
                 << "round " << round << ": " << layout.num_layers << " layers, " << kv
                 << " kv heads, d " << layout.head_dim << ", " << DTypeName(layout.dtype) << ", "
                 << n << " tokens, " << ScorerName(p.scorer) << " budget " << p.token_budget
                 << " ratio " << p.ratio << (p.moments ? " moments" : "")
                 << (p.moment_aware ? " aware" : "") << (on_device ? " device" : " host")
                 << " input");
    // Every layer's keys, then every layer's values, in one array (one view on the device).
    const uint64_t layer_elems = uint64_t{kv} * n * layout.head_dim;
    const uint64_t layer_bytes = DTypeBytes(layout.dtype, layer_elems);
    std::vector<uint8_t> all(2 * layout.num_layers * layer_bytes);
    for (uint32_t part = 0; part < 2 * layout.num_layers; ++part) {
      const std::vector<uint8_t> b =
          testing::RandomHeads(layout.dtype, kv, n, layout.head_dim, seed + 1000 * round + part)
              .bytes;
      std::memcpy(all.data() + part * layer_bytes, b.data(), layer_bytes);
    }
    Buffer dev;
    if (on_device) {
      auto d = Buffer::Allocate(backend_->allocator(), all.size());
      ASSERT_TRUE(d.ok());
      dev = *std::move(d);
      ASSERT_TRUE(backend_->CopyFromHost(dev.data(), all.data(), all.size()).ok());
    }
    auto make_view = [&](uint8_t* base, MemorySpace space) {
      KvCacheView view;
      view.layout = layout;
      view.num_tokens = n;
      for (uint32_t l = 0; l < layout.num_layers; ++l) {
        view.keys.push_back(HeadsView::Dense(base + l * layer_bytes, layout.dtype, kv, n,
                                             layout.head_dim, space));
        view.values.push_back(HeadsView::Dense(base + (layout.num_layers + l) * layer_bytes,
                                               layout.dtype, kv, n, layout.head_dim, space));
      }
      return view;
    };
    const KvCacheView host_view = make_view(all.data(), MemorySpace::kHost);
    const KvCacheView view =
        on_device ? make_view(dev.as<uint8_t>(), MemorySpace::kDevice) : host_view;
    auto dc = CompressToDevice(*backend_, view, p);
    ASSERT_TRUE(dc.ok()) << dc.status();
    EXPECT_EQ(dc->encoding != nullptr, in_place);
    EXPECT_EQ(!dc->crc_parts.empty(), in_place && beside) << "no CRC parts beside the work";
    auto down = dc->Download(*backend_);
    ASSERT_TRUE(down.ok()) << down.status();
    absl::StatusOr<std::string> want = format::EncodeCache(*down);
    ASSERT_TRUE(want.ok()) << want.status();
    if (p.scorer == Scorer::kStreaming) {
      auto ref = Compress(**cpu, host_view, p);
      ASSERT_TRUE(ref.ok()) << ref.status();
      absl::StatusOr<std::string> cpu_bytes = format::EncodeCache(*ref);
      ASSERT_TRUE(cpu_bytes.ok()) << cpu_bytes.status();
      EXPECT_TRUE(*cpu_bytes == *want) << "the device compression's cache is not the CPU's";
    }
    TransferBytes moved;
    auto got = EncodeOnDevice(*backend_, *dc, &moved);
    ASSERT_TRUE(got.ok()) << got.status();
    if (in_place) {
      EXPECT_EQ(got->bytes.data(), dc->encoding->data()) << "the sections were copied";
    }
    // Only the control bytes crossed: the header region up, a CRC word a device section down.
    EXPECT_LT(moved.to_host + moved.to_device, uint64_t{64} << 10);
    dc = absl::InternalError("released");  // the encoding holds its memory on its own
    ASSERT_EQ(got->size, want->size());
    std::string bytes(got->size, '\0');
    ASSERT_TRUE(backend_->CopyToHost(bytes.data(), got->bytes.data(), got->size).ok());
    EXPECT_TRUE(bytes == *want) << "the device's format is not the CPU's";
    EXPECT_EQ(got->crc32c, Crc32c(want->data(), want->size()));
    EXPECT_EQ(got->header, want->substr(0, got->header.size()));
  }
}

}  // namespace
}  // namespace kvcomp
