// FindFp16KeyOverflow on device keys against its CPU twin (gpu label): the same first key and
// value, hence the same error text, for f32 and bf16 views, dense and strided, with none, one
// or many keys beyond +-65504, NaN and Inf beside them; f16 device keys are never scanned.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/fp16_range.h"

namespace kvcomp {
namespace {

KVCOMP_GPU_TEST_BINARY();

TEST(Fp16RangeGpuTest, DeviceScanMatchesTheCpu) {
  auto backend = MakeCudaBackend();
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int trial = 0; trial < 60; ++trial) {
    const DType dtype = trial % 2 ? DType::kBF16 : DType::kF32;
    const uint32_t heads = 1 + rng() % 8, dim = (trial % 3 == 0) ? 128 : 64;
    const uint64_t tokens = 1 + rng() % 700;
    const bool strided = trial % 4 >= 2;
    const uint64_t token_stride = strided ? dim + 16 : dim;
    const uint64_t head_stride = token_stride * tokens + (strided ? 32 : 0);
    const uint64_t elements = head_stride * heads;
    const size_t eb = DTypeBytes(dtype, 1);
    std::vector<unsigned char> host(elements * eb);
    for (uint64_t i = 0; i < elements; ++i) StoreFromFloat(host.data(), dtype, i, normal(rng));
    const int overflows = trial % 5 == 0 ? 0 : 1 + static_cast<int>(rng() % 4);
    for (int o = 0; o < overflows; ++o) {
      const uint64_t at = uint64_t{static_cast<uint32_t>(rng() % heads)} * head_stride +
                          (rng() % tokens) * token_stride + rng() % dim;
      StoreFromFloat(host.data(), dtype, at, (rng() % 2 ? 1.0f : -1.0f) * (7e4f + rng() % 100000));
    }
    StoreFromFloat(host.data(), dtype, 0, std::nanf(""));
    HeadsView hv{host.data(), dtype, heads, tokens, dim, token_stride, head_stride,
                 MemorySpace::kHost};
    auto want = FindFp16KeyOverflow(hv);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(want->found, overflows > 0) << "trial " << trial;

    auto buf = Buffer::Allocate((*backend)->allocator(), host.size());
    ASSERT_TRUE(buf.ok());
    ASSERT_TRUE((*backend)->CopyFromHost(buf->data(), host.data(), host.size()).ok());
    HeadsView dv = hv;
    dv.data = buf->data();
    dv.space = MemorySpace::kDevice;
    auto got = FindFp16KeyOverflow(dv, (*backend)->native_stream());
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->found, want->found) << "trial " << trial;
    if (!want->found) continue;
    EXPECT_EQ(got->head, want->head) << "trial " << trial;
    EXPECT_EQ(got->token, want->token) << "trial " << trial;
    EXPECT_EQ(got->channel, want->channel) << "trial " << trial;
    EXPECT_EQ(std::memcmp(&got->value, &want->value, 4), 0) << "trial " << trial;
    EXPECT_EQ(Fp16KeyRangeError(*got, 3, 17).ToString(),
              Fp16KeyRangeError(*want, 3, 17).ToString());
  }
  // The default stream of the calling thread works too.
  std::vector<float> one(64, 1e5f);
  auto buf = Buffer::Allocate((*backend)->allocator(), one.size() * 4);
  ASSERT_TRUE(buf.ok());
  ASSERT_TRUE((*backend)->CopyFromHost(buf->data(), one.data(), one.size() * 4).ok());
  auto got = FindFp16KeyOverflow(
      HeadsView::Dense(buf->data(), DType::kF32, 1, 1, 64, MemorySpace::kDevice));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->found);
  EXPECT_EQ(got->channel, 0u);
  EXPECT_EQ(got->value, 1e5f);
}

TEST(Fp16RangeGpuTest, HostMemoryMarkedDeviceIsRefused) {
  std::vector<float> one(64, 1e5f);
  auto got = FindFp16KeyOverflow(
      HeadsView::Dense(one.data(), DType::kF32, 1, 1, 64, MemorySpace::kDevice));
  EXPECT_TRUE(absl::IsInvalidArgument(got.status())) << got.status();
}

}  // namespace
}  // namespace kvcomp
