// Helper process for server_client_test: connects, opens a put, sends `blocks` acknowledged
// blocks of it, prints "SENT" and dies by SIGKILL, without closing or committing anything.
//   transport_vanishing_client <port> <ucx_tls> <blocks>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kvcomp/transport/client.h"

int main(int argc, char** argv) {
  using kvcomp::transport::ClientOptions;
  using kvcomp::transport::Endpoint;
  using kvcomp::transport::UcxClient;
  namespace wire = kvcomp::transport::wire;
  if (argc != 4) return 2;
  ClientOptions o;
  o.ucx.overrides["TLS"] = argv[2];
  auto c = UcxClient::Connect(Endpoint{"127.0.0.1", static_cast<uint16_t>(std::atoi(argv[1]))},
                              "acme", "secret", o);
  if (!c.ok()) {
    std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return 1;
  }
  wire::PutBegin b;
  b.layout = kvcomp::KvLayout{4, 2, 2, 64, kvcomp::DType::kBF16};
  b.num_tokens = 64;
  b.model_id = "test/model";
  b.key = "vanished";
  auto put = (*c)->PutBegin(b);
  if (!put.ok()) return 1;
  std::vector<uint8_t> half(b.layout.LayerBytes(64), 1);
  for (int l = 0; l < std::atoi(argv[3]); ++l) {
    wire::Block blk;
    blk.put_id = *put;
    blk.layer_begin = l;
    blk.layer_end = l + 1;
    blk.token_end = 64;
    blk.key_bytes = blk.value_bytes = half.size();
    if (!(*c)->SendBlock(blk, half.data(), half.data()).ok()) return 1;
  }
  std::printf("SENT\n");
  std::fflush(stdout);
  raise(SIGKILL);
  return 0;
}
