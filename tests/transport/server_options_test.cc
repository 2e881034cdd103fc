// The data plane's flow-control bounds have one default each: the transport's ServerOptions and
// kvcompd's data_plane options (which the daemon passes to it) must state the same values.
#include "gtest/gtest.h"
#include "kvcomp/service/options.h"
#include "kvcomp/transport/server.h"

namespace kvcomp {
namespace {

TEST(ServerOptionsTest, DaemonDefaultsAreTheTransportDefaults) {
  const transport::ServerOptions t;
  const service::DataPlaneOptions d;
  EXPECT_EQ(t.max_payload_bytes, d.max_block_bytes);
  EXPECT_EQ(t.max_inflight_bytes, d.max_inflight_bytes_per_connection);
  EXPECT_EQ(t.max_inflight_bytes, transport::kDefaultMaxInflightBytes);
  EXPECT_EQ(t.max_buffered_bytes, d.max_buffered_bytes);
  EXPECT_EQ(t.max_buffered_bytes, transport::kDefaultMaxBufferedBytes);
  EXPECT_EQ(t.max_open_puts, d.max_open_puts);
  EXPECT_EQ(t.tenant_share, d.tenant_share);
  EXPECT_EQ(t.max_connections, d.max_connections);
  EXPECT_EQ(t.max_pre_hello_connections, d.max_pre_hello_connections);
  EXPECT_EQ(t.hello_timeout, absl::Seconds(d.hello_timeout_seconds));
  EXPECT_EQ(t.idle_timeout, absl::Seconds(d.idle_timeout_seconds));
  EXPECT_EQ(t.put_timeout, absl::Seconds(d.put_timeout_seconds));
  EXPECT_EQ(t.fd_reserve, d.fd_reserve);
  EXPECT_EQ(t.shared_memory, d.shared_memory);
  EXPECT_EQ(t.shm_max_region_bytes, d.shm_max_region_bytes);
  EXPECT_EQ(t.shm_copy_lanes, d.shm_copy_lanes);
}

}  // namespace
}  // namespace kvcomp
