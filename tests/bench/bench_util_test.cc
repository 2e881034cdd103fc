#include "common/bench_util.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvcomp {
namespace bench {
namespace {

bool Parse(std::vector<std::string> args, TokensAndReps* out) {
  std::vector<char*> argv;
  args.insert(args.begin(), "bench");
  for (std::string& a : args) argv.push_back(a.data());
  return ParseTokensAndReps(static_cast<int>(argv.size()), argv.data(), "kvcomp_bench_x", out);
}

TEST(ParseTokensAndReps, KeepsTheDefaultsWithoutArguments) {
  TokensAndReps args{{8192, 32768}, 20};
  ASSERT_TRUE(Parse({}, &args));
  EXPECT_EQ(args.tokens, (std::vector<uint64_t>{8192, 32768}));
  EXPECT_EQ(args.reps, 20);
}

TEST(ParseTokensAndReps, ReadsTokenCountsAndRepsOfAtLeastOne) {
  TokensAndReps args{{8192, 32768}, 20};
  ASSERT_TRUE(Parse({"--tokens", "128,4096", "--reps", "0"}, &args));
  EXPECT_EQ(args.tokens, (std::vector<uint64_t>{128, 4096}));
  EXPECT_EQ(args.reps, 1);
  ASSERT_TRUE(Parse({"--reps", "7", "--tokens", "64"}, &args));
  EXPECT_EQ(args.tokens, (std::vector<uint64_t>{64}));
  EXPECT_EQ(args.reps, 7);
}

TEST(ParseTokensAndReps, RefusesBadInputWithTheUsageLine) {
  for (const std::vector<std::string>& bad :
       std::vector<std::vector<std::string>>{{"--tokens", "12,x"},
                                             {"--tokens", "8192,"},
                                             {"--tokens"},
                                             {"--reps"},
                                             {"--warmup", "3"}}) {
    TokensAndReps args{{8192, 32768}, 5};
    ::testing::internal::CaptureStderr();
    EXPECT_FALSE(Parse(bad, &args)) << bad[0];
    EXPECT_EQ(::testing::internal::GetCapturedStderr(),
              "usage: kvcomp_bench_x [--tokens 8192,32768] [--reps 5]\n");
  }
}

TEST(PrintRate, WritesTheResultLineTheScriptsParse) {
  ::testing::internal::CaptureStdout();
  PrintRate("gpu_channel", 28, "channel put transfer", 4294967296.0, {0.0123, 0.011, 0.0135});
  PrintRate("cuda_ucx", 32, "device-to-device copy", 1e9, {0.5});
  PrintRate("cuda_ucx", 32, "nothing timed", 1e9, {});
  EXPECT_EQ(::testing::internal::GetCapturedStdout(),
            "RESULT gpu_channel channel put transfer         best  390.45 GB/s  median  349.18 "
            "GB/s  (3 runs, 0.011 s best)\n"
            "RESULT cuda_ucx device-to-device copy            best    2.00 GB/s  median    2.00 "
            "GB/s  (1 runs, 0.500 s best)\n");
}

TEST(Median, IsTheUpperMiddleOfTheSortedValues) {
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 3, 2}), 3);
  EXPECT_EQ(Best({4, 1, 3, 2}), 1);
}

}  // namespace
}  // namespace bench
}  // namespace kvcomp
