// FindFp16KeyOverflow on host keys (the CPU twin of the device scan) and the error a put gets:
// the first key beyond +-65504 in head, token, channel order, strided views, f32 and bf16 in,
// f16 never, NaN and Inf left to the scoring pass, and the exact text.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/fp16_range.h"

namespace kvcomp {
namespace {

TEST(Fp16RangeTest, FindsTheFirstKeyBeyondTheHalfRangeInHeadTokenChannelOrder) {
  constexpr uint32_t kHeads = 3, kDim = 64;
  constexpr uint64_t kTokens = 5;
  std::vector<float> k(kHeads * kTokens * kDim, 1.0f);
  HeadsView v = HeadsView::Dense(k.data(), DType::kF32, kHeads, kTokens, kDim);
  auto none = FindFp16KeyOverflow(v);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->found);
  k[v.offset(2, 1) + 7] = -1e6f;
  k[v.offset(1, 4) + 63] = 65505.0f;  // the first in order (head 1 before head 2)
  k[v.offset(1, 0) + 3] = 65504.0f;   // the largest half itself fits
  k[v.offset(0, 0) + 0] = std::numeric_limits<float>::infinity();  // the scoring pass's
  k[v.offset(0, 0) + 1] = std::nanf("");
  auto got = FindFp16KeyOverflow(v);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->found);
  EXPECT_EQ(got->head, 1u);
  EXPECT_EQ(got->token, 4u);
  EXPECT_EQ(got->channel, 63u);
  EXPECT_EQ(got->value, 65505.0f);
  EXPECT_EQ(Fp16KeyRangeError(*got, 7, 100).ToString(),
            "INVALID_ARGUMENT: keys: 65505 at layer 7, head 1, token 104 is beyond the fp16 key "
            "codec's range (65504); use key_codec raw or int8 for this model");
}

TEST(Fp16RangeTest, StridedBf16ViewsAndF16Keys) {
  // Keys of head h, token t at h * 1000 + t * 70 (a view into a larger buffer).
  constexpr uint32_t kHeads = 2, kDim = 64;
  constexpr uint64_t kTokens = 9;
  std::vector<uint16_t> buf(2000 + kTokens * 70, FloatToBf16(0.5f));
  HeadsView v{buf.data(), DType::kBF16, kHeads, kTokens, kDim, 70, 1000, MemorySpace::kHost};
  buf[1000 + 8 * 70 + 10] = FloatToBf16(-3e38f);
  buf[64] = FloatToBf16(1e9f);  // between two tokens' rows: not a key of the view
  auto got = FindFp16KeyOverflow(v);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->found);
  EXPECT_EQ(got->head, 1u);
  EXPECT_EQ(got->token, 8u);
  EXPECT_EQ(got->channel, 10u);
  EXPECT_EQ(got->value, Bf16ToFloat(FloatToBf16(-3e38f)));

  std::vector<uint16_t> half(kDim, FloatToHalf(65504.0f));
  auto f16 = FindFp16KeyOverflow(HeadsView::Dense(half.data(), DType::kF16, 1, 1, kDim));
  ASSERT_TRUE(f16.ok());
  EXPECT_FALSE(f16->found);
}

TEST(Fp16RangeTest, BadArguments) {
  HeadsView v = HeadsView::Dense(nullptr, DType::kF32, 1, 1, 64);
  EXPECT_TRUE(absl::IsInvalidArgument(FindFp16KeyOverflow(v).status()));
  v.num_tokens = 0;  // empty: nothing to read
  EXPECT_TRUE(FindFp16KeyOverflow(v).ok());
}

}  // namespace
}  // namespace kvcomp
