// Device payloads against a real kvcompd (docs/protocol.md, "CUDA-aware UCX"), on a machine
// whose UCX has no CUDA memory (Debian's 1.13, or any UCX without a CUDA driver): kvcompd says
// at start that device memory is staged through host memory (log line, gauge); hello-ok offers
// no device payloads; device-memory claims are refused on both sides (counted by the daemon);
// the put then goes on over host memory, and tenants stay apart. Where this machine's UCX does
// have CUDA memory the refusals are skipped (bench/cuda_ucx/run.sh covers that case on a GPU).
#include <string>
#include <vector>

#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/ucx.h"

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;

class CudaUcxDaemonTest : public DaemonFixture {
 protected:
  void SetUp() override {
    absl::StatusOr<transport::UcxCapabilities> caps = transport::QueryUcxCapabilities();
    ASSERT_TRUE(caps.ok()) << caps.status();
    caps_ = *caps;
  }
  std::string Metrics(const KvcompdProcess& d) {
    return HttpGet(d.ports().metrics, "/metrics").body;
  }

  transport::UcxCapabilities caps_;
};

TEST_F(CudaUcxDaemonTest, SaysHowDeviceMemoryTravels) {
  auto d = StartDaemon();
  const std::string log = d->Log();
  const size_t at = log.find("data plane: UCX ");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string line = log.substr(at, log.find('\n', at) - at);
  EXPECT_NE(line.find(caps_.version), std::string::npos) << line;
  const std::string m = Metrics(*d);
  if (caps_.cuda_memory) {
    EXPECT_NE(line.find("is CUDA-aware"), std::string::npos) << line;
    EXPECT_EQ(MetricValue(m, "kvcomp_data_plane_cuda_memory"), 1);
  } else {
    EXPECT_NE(line.find("has no CUDA memory support"), std::string::npos) << line;
    EXPECT_NE(line.find("staged through host memory"), std::string::npos) << line;
    EXPECT_EQ(MetricValue(m, "kvcomp_data_plane_cuda_memory"), 0);
  }
  EXPECT_EQ(MetricValue(m, "kvcomp_data_plane_blocks_into_device_total"), 0);
}

TEST_F(CudaUcxDaemonTest, DeviceClaimsRefusedAndHostPathStands) {
  if (caps_.cuda_memory) GTEST_SKIP() << "this UCX has CUDA memory";
  WriteTokens("alpha: secret-a\nbeta: secret-b\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path()});
  auto alpha = Connect(*d, "alpha", "secret-a");
  ASSERT_NE(alpha, nullptr);
  EXPECT_EQ(alpha->server_info().server_flags & wire::kServerCudaMemory, 0);
  absl::Status s = alpha->DevicePayloads();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;

  KvLayout layout{1, 2, 2, 64, DType::kF16};
  wire::PutBegin begin;
  begin.layout = layout;
  begin.num_tokens = 16;
  begin.model_id = "m";
  begin.key = "dev";
  CompressionPolicy lossless;
  lossless.ratio = 0;
  lossless.moments = false;
  begin.has_policy = true;
  begin.policy = lossless;
  absl::StatusOr<uint64_t> put = alpha->PutBegin(begin);
  ASSERT_TRUE(put.ok()) << put.status();
  wire::Block b;
  b.put_id = *put;
  b.layer_begin = 0;
  b.layer_end = 1;
  b.token_begin = 0;
  b.token_end = 16;
  b.parts = wire::kPartBoth;
  b.key_bytes = layout.LayerBytes(16);
  b.value_bytes = b.key_bytes;
  std::vector<uint8_t> kv(b.payload_bytes());
  for (size_t i = 0; i + 1 < kv.size(); i += 2) {  // finite f16 values in [1, 2)
    kv[i] = static_cast<uint8_t>(i * 7 + 3);
    kv[i + 1] = static_cast<uint8_t>(0x3c | ((i / 2) & 3));
  }

  // Claimed as device memory: refused by the client before anything is sent.
  s = alpha->SendBlock(b, kv.data(), kv.data() + b.key_bytes, transport::MemoryType::kCuda);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  // Flagged as a device payload on the wire anyway: refused by kvcompd, and counted.
  wire::Block flagged = b;
  flagged.flags = wire::kBlockDevicePayload;
  absl::StatusOr<transport::RawReply> r = alpha->SendRawForTesting(
      4242, wire::Encode(4242, flagged),
      absl::string_view(reinterpret_cast<const char*>(kv.data()), kv.size()));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(r->status)) << r->status;
  EXPECT_GE(MetricValue(Metrics(*d),
                        "kvcomp_errors_total{code=\"failed_precondition\",op=\"transport\"}"),
            1);

  // The same bytes over host memory, with their CRC32C: stored, and read back as put.
  ASSERT_TRUE(alpha->SendBlock(b, kv.data(), kv.data() + b.key_bytes).ok());
  absl::StatusOr<wire::CacheSummary> sum = alpha->PutCommit(*put, 1);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->total_kept, 16u * layout.num_kv_heads);
  absl::StatusOr<transport::FetchedCache> got =
      alpha->Get("m", "dev", wire::Representation::kDecoded);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT(got->bytes.size(), kv.size());

  // A get into device memory without a CUDA-aware UCX is refused; another tenant sees nothing.
  std::vector<uint8_t> dst(got->bytes.size());
  absl::StatusOr<size_t> into = alpha->GetInto("m", "dev", wire::Representation::kDecoded,
                                               dst.data(), dst.size(),
                                               transport::MemoryType::kCuda);
  EXPECT_TRUE(absl::IsFailedPrecondition(into.status())) << into.status();
  auto beta = Connect(*d, "beta", "secret-b");
  ASSERT_NE(beta, nullptr);
  EXPECT_TRUE(absl::IsNotFound(beta->Get("m", "dev").status()));
  EXPECT_EQ(MetricValue(Metrics(*d), "kvcomp_data_plane_blocks_into_device_total"), 0);
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
