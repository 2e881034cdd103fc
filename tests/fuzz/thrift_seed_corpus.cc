// Writes a seed corpus for thrift_request_fuzz into the directory given: one call of every
// control-plane method as the generated client serializes it (TBinaryProtocol, the frame body
// without its length prefix).
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include "kvcomp/rpc/KvcompControl.h"

using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TMemoryBuffer;
namespace rpc = kvcomp::rpc;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  rpc::Auth auth;
  auth.tenant = "acme";
  auth.token = "s3cret-token";
  rpc::Auth anonymous;
  rpc::CacheRef ref;
  ref.model_id = "llama-3-8b";
  ref.key = "prefix/0001";
  rpc::Policy policy;
  policy.ratio = 0.25;
  policy.key_codec = "int8";
  policy.value_codec = "orthogonal_int4";
  policy.rank = 4;
  policy.group_size = 8;
  policy.recent_fraction = 0.1;
  rpc::CalibrateRequest calibrate;
  calibrate.model_id = "llama-3-8b";
  calibrate.rank = 8;
  const std::vector<std::string> keys = {"prefix/0001", "prefix/0002", "prefix/0003"};

  using Call = std::function<void(rpc::KvcompControlClient&)>;
  const std::vector<Call> calls = {
      [&](auto& c) { c.send_Health(auth); },
      [&](auto& c) { c.send_Health(anonymous); },
      [&](auto& c) { c.send_Stats(auth); },
      [&](auto& c) { c.send_Lookup(auth, ref); },
      [&](auto& c) { c.send_Delete(auth, ref); },
      [&](auto& c) { c.send_List(auth, "llama-3-8b", "prefix/0001", 100); },
      [&](auto& c) { c.send_GetPolicy(auth, "llama-3-8b"); },
      [&](auto& c) { c.send_SetPolicy(auth, "llama-3-8b", policy); },
      [&](auto& c) { c.send_SetPolicy(auth, "", rpc::Policy()); },
      [&](auto& c) { c.send_Calibrate(auth, calibrate); },
      [&](auto& c) { c.send_ServerInfo(auth); },
      [&](auto& c) { c.send_ListQuarantined(auth, "", 0); },
      [&](auto& c) { c.send_PurgeQuarantined(auth, ref, false); },
      [&](auto& c) { c.send_LookupPrefix(auth, "llama-3-8b", keys); },
      [&](auto& c) { c.send_GetChunks(auth, "llama-3-8b", keys, true, 1 << 20); },
  };
  int n = 0;
  for (const Call& call : calls) {
    auto buffer = std::make_shared<TMemoryBuffer>();
    rpc::KvcompControlClient client(std::make_shared<TBinaryProtocol>(buffer));
    call(client);
    std::ofstream out(std::string(argv[1]) + "/seed-" + std::to_string(n++), std::ios::binary);
    out << buffer->getBufferAsString();
    if (!out) {
      std::fprintf(stderr, "cannot write to %s\n", argv[1]);
      return 1;
    }
  }
  std::printf("wrote %d seeds to %s\n", n, argv[1]);
  return 0;
}
