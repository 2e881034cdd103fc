// The calibrated basis codec's CUDA twin (CodecOps::EncodePq / DecodePq on the CUDA backend)
// against the CPU backend (the library, kvcomp/codecs/pq.h), on fresh random bases and rows:
// records byte for byte and decoded values bit for bit, for every input and output dtype, head
// dims that are and are not powers of two, widths 0..8 anywhere in a head, ragged heads (empty
// ones too), host and device buffers, and the lowest failing row's error. gpu label; 77
// (skipped) without a device.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/codec_ops.h"

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace {

struct Backends {
  std::unique_ptr<Backend> cpu, cuda;
  Backends() {
    auto c = MakeCpuBackend(CpuBackendOptions{4});
    auto g = MakeCudaBackend();
    EXPECT_TRUE(c.ok() && g.ok()) << g.status();
    if (c.ok()) cpu = std::move(*c);
    if (g.ok()) cuda = std::move(*g);
  }
};

// A random basis: unnormalised random directions, scales over three decades, and bits_total bits
// spread over random components (0..8 each, so zero widths fall anywhere).
pq::Basis RandomBasis(uint32_t layers, uint32_t kv_heads, uint32_t d, uint32_t bits_total,
                      uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> expo(-1.5f, 1.5f);
  pq::Basis b;
  b.num_layers = layers;
  b.num_kv_heads = kv_heads;
  b.head_dim = d;
  b.bits_total = bits_total;
  const uint64_t heads = b.num_heads();
  b.mean.resize(heads * d);
  b.scale.resize(heads * d);
  b.inv_scale.resize(heads * d);
  b.widths.assign(heads * d, 0);
  b.basis.resize(heads * d * d);
  for (uint64_t h = 0; h < heads; ++h) {
    for (uint64_t c = 0; c < d; ++c) {
      b.mean[h * d + c] = 0.3f * normal(rng);
      b.scale[h * d + c] = std::pow(10.0f, expo(rng));
      b.inv_scale[h * d + c] = 1.0f / b.scale[h * d + c];
    }
    for (uint64_t i = 0; i < d * d; ++i) b.basis[h * d * d + i] = normal(rng) / std::sqrt(1.0f * d);
    std::uniform_int_distribution<uint32_t> pick(0, d - 1);
    for (uint32_t left = bits_total; left > 0;) {
      uint8_t& w = b.widths[h * d + pick(rng)];
      if (w < pq::kMaxWidth) {
        ++w;
        --left;
      }
    }
  }
  EXPECT_TRUE(b.Validate().ok()) << b.Validate();
  return b;
}

// Ragged rows per head (some heads empty) and their elements of dtype: the basis' mean plus
// noise of a few deviations, so codes cover the whole codebook.
struct Rows {
  std::vector<uint64_t> offsets;
  std::vector<uint8_t> bytes;
};
Rows RandomRows(const pq::Basis& b, DType dtype, uint64_t max_rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<uint64_t> count(0, max_rows);
  Rows r;
  r.offsets.push_back(0);
  for (uint64_t h = 0; h < b.num_heads(); ++h) {
    const uint64_t n = (h % 5 == 3) ? 0 : count(rng);
    r.offsets.push_back(r.offsets.back() + n);
  }
  const uint64_t d = b.head_dim;
  r.bytes.resize(DTypeBytes(dtype, r.offsets.back() * d));
  for (uint64_t h = 0; h < b.num_heads(); ++h) {
    for (uint64_t i = r.offsets[h]; i < r.offsets[h + 1]; ++i) {
      const float amp = std::pow(10.0f, 1.5f * normal(rng) / 2);
      for (uint64_t j = 0; j < d; ++j) {
        StoreFromFloat(r.bytes.data(), dtype, i * d + j,
                       b.mean[h * d + j] + amp * normal(rng));
      }
    }
  }
  return r;
}

TEST(PqCudaTest, RecordsAndDecodedValuesAreTheCpus) {
  Backends b;
  struct Shape {
    uint32_t layers, kv_heads, d, bits;
  };
  const Shape shapes[] = {{2, 4, 128, 3 * 128}, {3, 2, 128, 2 * 128}, {1, 3, 64, 3 * 64 + 5},
                          {2, 2, 96, 161},      {1, 2, 256, 2 * 256}, {1, 1, 40, 320},
                          {1, 2, 512, 7},       {4, 8, 128, 1}};
  uint64_t seed = 1;
  for (const Shape& sh : shapes) {
    const pq::Basis basis = RandomBasis(sh.layers, sh.kv_heads, sh.d, sh.bits, ++seed);
    const uint64_t fp = basis.Fingerprint();
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << sh.layers << "x" << sh.kv_heads << " d=" << sh.d
                                        << " bits=" << sh.bits << " " << DTypeName(dt));
      const Rows rows = RandomRows(basis, dt, sh.d >= 256 ? 300 : 700, ++seed);
      const uint64_t n = rows.offsets.back(), rec = basis.RecordBytes();
      std::vector<uint8_t> want(n * rec), got(n * rec, 0xab);
      ASSERT_TRUE(b.cpu->codec().EncodePq(basis, fp, rows.offsets, rows.bytes.data(), dt,
                                          want.data()).ok());
      auto st = b.cuda->codec().EncodePq(basis, fp, rows.offsets, rows.bytes.data(), dt,
                                         got.data());
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_TRUE(want == got) << "records differ";
      for (DType out : {DType::kF32, DType::kF16, DType::kBF16}) {
        std::vector<uint8_t> dw(DTypeBytes(out, n * sh.d)), dg(dw.size(), 0xcd);
        ASSERT_TRUE(b.cpu->codec().DecodePq(basis, fp, rows.offsets, want.data(), dw.data(),
                                            out).ok());
        st = b.cuda->codec().DecodePq(basis, fp, rows.offsets, want.data(), dg.data(), out);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_TRUE(dw == dg) << "decoded " << DTypeName(out) << " values differ";
      }
    }
  }
}

// Device buffers in and out (the put path's case): the same bytes, and the fingerprint 0 (the
// basis fingerprinted by the call) names the same upload.
TEST(PqCudaTest, DeviceBuffersGiveTheSameBytes) {
  Backends b;
  const pq::Basis basis = RandomBasis(2, 8, 128, 3 * 128, 77);
  const Rows rows = RandomRows(basis, DType::kBF16, 1000, 78);
  const uint64_t n = rows.offsets.back(), rec = basis.RecordBytes();
  std::vector<uint8_t> want(n * rec);
  ASSERT_TRUE(b.cpu->codec().EncodePq(basis, 0, rows.offsets, rows.bytes.data(), DType::kBF16,
                                      want.data()).ok());
  auto in = Buffer::Allocate(b.cuda->allocator(), rows.bytes.size());
  auto out = Buffer::Allocate(b.cuda->allocator(), want.size());
  auto dec = Buffer::Allocate(b.cuda->allocator(), rows.bytes.size());
  ASSERT_TRUE(in.ok() && out.ok() && dec.ok());
  ASSERT_TRUE(b.cuda->CopyFromHost(in->data(), rows.bytes.data(), rows.bytes.size()).ok());
  for (uint64_t fp : {uint64_t{0}, basis.Fingerprint()}) {
    ASSERT_TRUE(b.cuda->codec().EncodePq(basis, fp, rows.offsets, in->data(), DType::kBF16,
                                         out->data()).ok());
    std::vector<uint8_t> got(want.size());
    ASSERT_TRUE(b.cuda->CopyToHost(got.data(), out->data(), got.size()).ok());
    EXPECT_TRUE(got == want);
    ASSERT_TRUE(b.cuda->codec().DecodePq(basis, fp, rows.offsets, out->data(), dec->data(),
                                         DType::kBF16).ok());
    std::vector<uint8_t> dg(rows.bytes.size()), dw(rows.bytes.size());
    ASSERT_TRUE(b.cuda->CopyToHost(dg.data(), dec->data(), dg.size()).ok());
    ASSERT_TRUE(b.cpu->codec().DecodePq(basis, 0, rows.offsets, want.data(), dw.data(),
                                        DType::kBF16).ok());
    EXPECT_TRUE(dg == dw);
  }
}

// The lowest failing row is reported as the CPU does: a non-finite element (its head, row and
// element), a projection that overflows, a record with padding bits set.
TEST(PqCudaTest, ErrorsNameTheLowestFailingRow) {
  Backends b;
  const pq::Basis basis = RandomBasis(1, 3, 64, 3 * 64 + 5, 5);
  Rows rows = RandomRows(basis, DType::kF32, 50, 6);
  rows.offsets = {0, 20, 45, 90};
  rows.bytes.resize(90 * 64 * 4);
  std::vector<uint8_t> rec(90 * basis.RecordBytes());
  auto* x = reinterpret_cast<float*>(rows.bytes.data());
  for (uint64_t i = 0; i < 90 * 64; ++i) x[i] = 0.01f * static_cast<float>(i % 17);
  x[(20 + 7) * 64 + 9] = std::numeric_limits<float>::quiet_NaN();   // head 1 row 7 element 9
  x[(20 + 7) * 64 + 30] = std::numeric_limits<float>::infinity();
  x[(45 + 2) * 64 + 1] = std::numeric_limits<float>::infinity();    // head 2, later
  for (Backend* be : {b.cpu.get(), b.cuda.get()}) {
    const absl::Status st =
        be->codec().EncodePq(basis, 0, rows.offsets, rows.bytes.data(), DType::kF32, rec.data());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("pq head 1"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("row 7 element 9 is not finite"), absl::string_view::npos) << st;
  }
  // Finite rows whose projection overflows: inf - inf in the sum.
  for (uint64_t i = 0; i < 90 * 64; ++i) x[i] = 0.01f * static_cast<float>(i % 17);
  for (uint64_t j = 0; j < 64; ++j) x[(45 + 4) * 64 + j] = (j % 2 ? 1 : -1) * 3.0e38f;
  for (Backend* be : {b.cpu.get(), b.cuda.get()}) {
    const absl::Status st =
        be->codec().EncodePq(basis, 0, rows.offsets, rows.bytes.data(), DType::kF32, rec.data());
    if (st.ok()) continue;  // the basis may keep the sum finite: both backends agree below
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("pq head 2"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("row 4 overflows"), absl::string_view::npos) << st;
  }
  {
    std::vector<uint8_t> a(rec.size()), g(rec.size());
    const absl::Status sa =
        b.cpu->codec().EncodePq(basis, 0, rows.offsets, rows.bytes.data(), DType::kF32, a.data());
    const absl::Status sg = b.cuda->codec().EncodePq(basis, 0, rows.offsets, rows.bytes.data(),
                                                      DType::kF32, g.data());
    EXPECT_EQ(sa.code(), sg.code()) << sa << " / " << sg;
  }
  // Padding bits: bits_total 197 leaves three spare bits in each record's last byte.
  for (uint64_t i = 0; i < 90 * 64; ++i) x[i] = 0.01f * static_cast<float>(i % 17);
  ASSERT_TRUE(b.cpu->codec().EncodePq(basis, 0, rows.offsets, rows.bytes.data(), DType::kF32,
                                      rec.data()).ok());
  const uint64_t rb = basis.RecordBytes();
  rec[(20 + 11) * rb + rb - 1] |= 0x80;  // head 1 record 11
  rec[(45 + 30) * rb + rb - 1] |= 0x40;  // head 2, later
  std::vector<float> y(90 * 64);
  for (Backend* be : {b.cpu.get(), b.cuda.get()}) {
    const absl::Status st =
        be->codec().DecodePq(basis, 0, rows.offsets, rec.data(), y.data(), DType::kF32);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("pq head 1"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("record 11 has nonzero padding bits"), absl::string_view::npos)
        << st;
  }
  // Bad arguments: offsets that do not cover the basis' heads, an unsupported dtype.
  for (Backend* be : {b.cpu.get(), b.cuda.get()}) {
    const std::vector<uint64_t> short_offsets = {0, 20, 45};
    EXPECT_EQ(be->codec()
                  .EncodePq(basis, 0, short_offsets, rows.bytes.data(), DType::kF32, rec.data())
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(be->codec()
                  .DecodePq(basis, 0, rows.offsets, rec.data(), y.data(), DType::kInt8)
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace kvcomp
