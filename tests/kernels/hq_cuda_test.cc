// The Hadamard codec on CUDA (CodecOps::EncodeHq / DecodeHq, kernels/src/cuda/hq_cuda.cu) against
// the CPU reference (kvcomp/codecs/hq.h): records byte for byte and decoded values bit for bit,
// on fresh random rows each run (the seed is printed; KVCOMP_HQ_SEED replays one) with outliers,
// zero and constant rows, signed zeros, subnormals and odd row counts, from host and device
// pointers; errors name the same row as the CPU's; a whole cache through CompressToDevice with the
// device encoder enabled equals the host-encoded one. gpu label; 77 (skipped) without a device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kvcomp/codecs/hq.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/pipeline.h"

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace {

uint64_t Seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("KVCOMP_HQ_SEED");
    const uint64_t s = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("hq CUDA test seed %llu (replay with KVCOMP_HQ_SEED=%llu)\n",
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

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

// rows x d f32 values of many kinds: normal rows at scales 1e-3..1e2, a channel outlier (x100),
// zero rows, constant rows, rows of signed zeros, rows of subnormals, a row at the edge of what
// the f16 grid holds.
std::vector<float> MakeRows(std::mt19937_64& rng, uint64_t rows, uint32_t d) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9);
  std::vector<float> x(rows * d);
  for (uint64_t r = 0; r < rows; ++r) {
    float* row = x.data() + r * d;
    const int k = kind(rng);
    const float scale = std::pow(10.0f, static_cast<float>(static_cast<int>(r % 6)) - 3.0f);
    for (uint32_t i = 0; i < d; ++i) row[i] = n(rng) * scale;
    switch (k) {
      case 0:
        row[rng() % d] *= 100.0f;  // outlier channel
        break;
      case 1:
        for (uint32_t i = 0; i < d; ++i) row[i] = 0.0f;
        break;
      case 2:
        for (uint32_t i = 0; i < d; ++i) row[i] = 0.75f;
        break;
      case 3:
        for (uint32_t i = 0; i < d; ++i) row[i] = (rng() & 1) ? -0.0f : 0.0f;
        break;
      case 4:
        for (uint32_t i = 0; i < d; ++i) row[i] = n(rng) * 1e-40f;  // f32 subnormals
        break;
      case 5:
        for (uint32_t i = 0; i < d; ++i) row[i] = n(rng) * 2000.0f;  // large, still in range
        break;
      default:
        break;
    }
  }
  return x;
}

// The rows as `dtype` (f16 / bf16 round to nearest even, as the engine stores them).
std::vector<uint8_t> AsDType(const std::vector<float>& x, DType dtype) {
  std::vector<uint8_t> out(x.size() * DTypeBytes(dtype, 1));
  for (size_t i = 0; i < x.size(); ++i) StoreFromFloat(out.data(), dtype, i, x[i]);
  return out;
}

struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(size_t n) { EXPECT_EQ(cudaMalloc(&p, n == 0 ? 1 : n), cudaSuccess); }
  ~DeviceBytes() { cudaFree(p); }
  void Put(const void* src, size_t n) {
    ASSERT_EQ(cudaMemcpy(p, src, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Get(void* dst, size_t n) const {
    ASSERT_EQ(cudaMemcpy(dst, p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  }
};

size_t FirstDiff(const uint8_t* a, const uint8_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return i;
  }
  return n;
}

void CompareOne(Backends& b, std::mt19937_64& rng, uint64_t rows, uint32_t d, uint32_t bits,
                DType dtype, bool device_pointers) {
  SCOPED_TRACE(::testing::Message() << "rows " << rows << " d " << d << " bits " << bits
                                  << " dtype " << DTypeName(dtype) << " device "
                                  << device_pointers);
  const std::vector<uint8_t> in = AsDType(MakeRows(rng, rows, d), dtype);
  const uint64_t rb = hq::RowBytes(bits, d);
  std::vector<uint8_t> want(rows * rb, 0xa5), got(rows * rb, 0x5a);
  ASSERT_TRUE(hq::EncodeRows(in.data(), dtype, rows, d, bits, want.data()).ok());
  if (device_pointers) {
    DeviceBytes din(in.size()), dout(got.size());
    din.Put(in.data(), in.size());
    ASSERT_EQ(cudaMemset(dout.p, 0x5a, got.size()), cudaSuccess);
    const absl::Status s = b.cuda->codec().EncodeHq(bits, rows, d, din.p, dtype, dout.p);
    ASSERT_TRUE(s.ok()) << s;
    dout.Get(got.data(), got.size());
  } else {
    const absl::Status s = b.cuda->codec().EncodeHq(bits, rows, d, in.data(), dtype, got.data());
    ASSERT_TRUE(s.ok()) << s;
  }
  const size_t at = FirstDiff(want.data(), got.data(), want.size());
  ASSERT_EQ(at, want.size()) << "first differing byte " << at << " (row " << at / rb
                             << ", byte " << at % rb << "): CPU " << int{want[at]} << ", CUDA "
                             << int{got[at]};
  // Decode the (common) records on both into every dtype: the same bits.
  for (DType out_dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    const size_t ob = rows * DTypeBytes(out_dtype, d);
    std::vector<uint8_t> cpu_out(ob, 0x11), cuda_out(ob, 0x22);
    ASSERT_TRUE(hq::DecodeRows(want.data(), rows, d, bits, cpu_out.data(), out_dtype).ok());
    if (device_pointers) {
      DeviceBytes din(want.size()), dout(ob);
      din.Put(want.data(), want.size());
      const absl::Status s = b.cuda->codec().DecodeHq(bits, rows, d, din.p, dout.p, out_dtype);
      ASSERT_TRUE(s.ok()) << s;
      dout.Get(cuda_out.data(), ob);
    } else {
      const absl::Status s =
          b.cuda->codec().DecodeHq(bits, rows, d, want.data(), cuda_out.data(), out_dtype);
      ASSERT_TRUE(s.ok()) << s;
    }
    const size_t e = FirstDiff(cpu_out.data(), cuda_out.data(), ob);
    ASSERT_EQ(e, ob) << "decoded " << DTypeName(out_dtype) << ": first differing byte " << e
                     << " (row " << e / DTypeBytes(out_dtype, d) << ")";
  }
}

TEST(HqCuda, RecordsAndDecodedRowsAreTheCpuBits) {
  Backends b;
  std::mt19937_64 rng(Seed());
  for (uint32_t d : {8u, 16u, 32u, 64u, 128u, 256u}) {
    for (uint32_t bits : {2u, 3u, 4u}) {
      for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
        for (uint64_t rows : {uint64_t{1}, uint64_t{7}, uint64_t{333}}) {
          CompareOne(b, rng, rows, d, bits, dtype, (rows + d + bits) % 2 == 0);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// More rows than the resident blocks cover in one sweep (the kernels loop), odd count.
TEST(HqCuda, LargeOddBatches) {
  Backends b;
  std::mt19937_64 rng(Seed() + 1);
  for (uint32_t d : {64u, 128u}) {
    CompareOne(b, rng, 100001, d, 4, DType::kBF16, true);
    if (HasFatalFailure()) return;
    CompareOne(b, rng, 65537, d, 3, DType::kF16, false);
    if (HasFatalFailure()) return;
  }
}

TEST(HqCuda, ZeroRowsAndArgumentErrors) {
  Backends b;
  CodecOps& ops = b.cuda->codec();
  EXPECT_TRUE(ops.EncodeHq(4, 0, 128, nullptr, DType::kF32, nullptr).ok());
  EXPECT_TRUE(ops.DecodeHq(3, 0, 128, nullptr, nullptr, DType::kF16).ok());
  std::vector<float> x(128, 1.0f);
  std::vector<uint8_t> rec(hq::RowBytes(4, 128));
  EXPECT_EQ(ops.EncodeHq(4, 1, 96, x.data(), DType::kF32, rec.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.EncodeHq(5, 1, 128, x.data(), DType::kF32, rec.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.EncodeHq(4, 1, 128, nullptr, DType::kF32, rec.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.DecodeHq(4, 1, 128, rec.data(), nullptr, DType::kF32).code(),
            absl::StatusCode::kInvalidArgument);
}

// Bad rows: the status is the CPU's, naming the lowest failing row.
TEST(HqCuda, ErrorsNameTheCpuRow) {
  Backends b;
  std::mt19937_64 rng(Seed() + 2);
  const uint32_t d = 128, bits = 4;
  const uint64_t rows = 20001;
  std::vector<float> x = MakeRows(rng, rows, d);
  const uint64_t rb = hq::RowBytes(bits, d);
  std::vector<uint8_t> a(rows * rb), g(rows * rb);
  auto expect_same = [&](const char* what) {
    const absl::Status want = hq::EncodeRows(x.data(), DType::kF32, rows, d, bits, a.data());
    const absl::Status got = b.cuda->codec().EncodeHq(bits, rows, d, x.data(), DType::kF32,
                                                      g.data());
    ASSERT_FALSE(want.ok()) << what;
    EXPECT_EQ(got.code(), want.code()) << what;
    EXPECT_EQ(got.message(), want.message()) << what;
  };
  x[17000 * d + 77] = std::nanf("");
  expect_same("nan");
  x[9000 * d + 3] = INFINITY;
  x[9000 * d + 2] = -INFINITY;
  expect_same("inf");
  x[4000 * d + 5] = 3e6f;  // the rotated row leaves f16 (3e6 / sqrt(128) > 65504)
  expect_same("rotated range");
  x[1000 * d + 9] = 3e38f;  // the transform overflows
  x[1000 * d + 10] = 3e38f;
  expect_same("overflow");

  // Decode: a damaged record deep in the batch.
  x = MakeRows(rng, rows, d);
  ASSERT_TRUE(hq::EncodeRows(x.data(), DType::kF32, rows, d, bits, a.data()).ok());
  std::vector<float> yc(rows * d), yg(rows * d);
  for (uint16_t bad_step : {uint16_t{0x7c00}, uint16_t{0x7e00}, uint16_t{0xbc00}}) {
    std::vector<uint8_t> r = a;
    r[12345 * rb + 2] = static_cast<uint8_t>(bad_step & 0xff);
    r[12345 * rb + 3] = static_cast<uint8_t>(bad_step >> 8);
    r[19999 * rb + 1] = 0xfc;  // lo = -inf, a later row
    r[19999 * rb + 0] = 0x00;
    const absl::Status want = hq::DecodeRows(r.data(), rows, d, bits, yc.data(), DType::kF32);
    const absl::Status got = b.cuda->codec().DecodeHq(bits, rows, d, r.data(), yg.data(),
                                                      DType::kF32);
    ASSERT_FALSE(want.ok());
    EXPECT_EQ(got.code(), want.code());
    EXPECT_EQ(got.message(), want.message());
  }
}

// A whole cache: Compress on the CUDA backend with the device encoder enabled (CompressToDevice,
// every row of the put in one launch per section) against the default path (selection on the
// device, the host's encoder): the same cache.
TEST(HqCuda, DeviceEncodedCacheEqualsTheHostEncodedOne) {
  Backends b;
  std::mt19937_64 rng(Seed() + 3);
  KvLayout layout;
  layout.num_layers = 3;
  layout.num_kv_heads = 4;
  layout.num_q_heads = 16;
  layout.head_dim = 128;
  layout.dtype = DType::kBF16;
  const uint64_t tokens = 777;
  const uint64_t elems = uint64_t{layout.num_layers} * layout.num_kv_heads * tokens * 128;
  const std::vector<uint8_t> k = AsDType(MakeRows(rng, elems / 128, 128), layout.dtype);
  std::vector<float> vf(elems);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& v : vf) v = n(rng);
  const std::vector<uint8_t> v = AsDType(vf, layout.dtype);
  KvCacheView view;
  view.layout = layout;
  view.num_tokens = tokens;
  const uint64_t layer_bytes = uint64_t{layout.num_kv_heads} * tokens * 128 * 2;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    view.keys.push_back(HeadsView::Dense(k.data() + l * layer_bytes, layout.dtype,
                                         layout.num_kv_heads, tokens, 128));
    view.values.push_back(HeadsView::Dense(v.data() + l * layer_bytes, layout.dtype,
                                           layout.num_kv_heads, tokens, 128));
  }
  CompressionPolicy p;
  p.ratio = 0.5;
  p.moments = false;
  p.key_codec = KeyCodec::kHq4;
  p.value_codec = ValueCodec::kHq3;
  setenv("KVCOMP_HQ_DEVICE_ENCODE", "0", 1);
  ASSERT_FALSE(DeviceEncodes(p));
  auto host_encoded = Compress(*b.cuda, view, p);
  unsetenv("KVCOMP_HQ_DEVICE_ENCODE");
  ASSERT_TRUE(host_encoded.ok()) << host_encoded.status();
  ASSERT_TRUE(DeviceEncodes(p));
  auto device_encoded = Compress(*b.cuda, view, p);
  ASSERT_TRUE(device_encoded.ok()) << device_encoded.status();
  EXPECT_EQ(device_encoded->keys, host_encoded->keys);
  EXPECT_EQ(device_encoded->values, host_encoded->values);
  EXPECT_EQ(*device_encoded, *host_encoded);
  // Decoding the cache on the device (a decoded get, a placed cache) gives the CPU's values.
  for (DType out : {DType::kBF16, DType::kF32}) {
    auto on_device = DecodeKept(*b.cuda, *device_encoded, nullptr, out);
    auto on_host = DecodeKept(*b.cpu, *device_encoded, nullptr, out);
    ASSERT_TRUE(on_device.ok()) << on_device.status();
    ASSERT_TRUE(on_host.ok()) << on_host.status();
    EXPECT_EQ(on_device->keys, on_host->keys) << DTypeName(out);
    EXPECT_EQ(on_device->values, on_host->values) << DTypeName(out);
  }
}

}  // namespace
}  // namespace kvcomp
