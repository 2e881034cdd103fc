// Writes a seed corpus for wire_protocol_fuzz into the directory given: valid encodings of every
// message (made by the protocol's own encoders), each both as a typed body (selector = message
// type, 8-byte payload length, body) and as a raw frame (selector 0, whole frame).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kvcomp/transport/protocol.h"

namespace wire = kvcomp::transport::wire;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::vector<std::string> frames;

  frames.push_back(wire::Encode(1, wire::Hello{"acme", "s3cret-token", "vllm worker 0"}));
  frames.push_back(wire::Encode(2, wire::Hello{"", "", ""}));
  wire::HelloOk ok;
  ok.max_payload_bytes = 64 << 20;
  ok.max_inflight_bytes = 256 << 20;
  ok.tenant = "acme";
  ok.server_name = "kvcompd 0.1.0 host";
  frames.push_back(wire::Encode(3, ok));

  wire::PutBegin put;
  put.put_id = 9;
  put.layout.num_layers = 4;
  put.layout.num_kv_heads = 2;
  put.layout.num_q_heads = 4;
  put.layout.head_dim = 8;
  put.layout.dtype = kvcomp::DType::kF16;
  put.num_tokens = 64;
  put.model_id = "llama-3-8b";
  put.key = "prefix/0001";
  frames.push_back(wire::Encode(4, put));
  put.has_policy = true;
  put.block_wise = true;
  put.policy.ratio = 0.25;
  put.policy.n_sink = 4;
  put.policy.n_recent = 8;
  put.policy.key_codec = kvcomp::KeyCodec::kInt8;
  put.policy.value_codec = kvcomp::ValueCodec::kOrthogonalInt4;
  put.policy.rank = 4;
  put.policy.group_size = 8;
  put.policy.recent_fraction = 0.1;
  frames.push_back(wire::Encode(5, put));

  wire::Block block;
  block.put_id = 9;
  block.layer_begin = 1;
  block.layer_end = 3;
  block.token_begin = 16;
  block.token_end = 48;
  block.parts = wire::kPartBoth;
  block.key_bytes = block.ExpectedPartBytes(put.layout);
  block.value_bytes = block.key_bytes;
  block.key_crc = 0x1234;
  block.value_crc = 0x5678;
  frames.push_back(wire::Encode(6, block));
  block.parts = wire::kPartValues;
  block.key_bytes = 0;
  block.key_crc = 0;
  frames.push_back(wire::Encode(7, block));

  frames.push_back(wire::Encode(8, wire::PutCommit{9, 2}));
  wire::CacheSummary summary;
  summary.layout = put.layout;
  summary.key_codec = kvcomp::KeyCodec::kInt8;
  summary.value_codec = kvcomp::ValueCodec::kOrthogonalInt4;
  summary.tier = 1;
  summary.original_tokens = 64;
  summary.total_kept = 16;
  summary.original_bytes = 32768;
  summary.stored_bytes = 4096;
  frames.push_back(wire::Encode(9, summary));
  frames.push_back(wire::EncodeLookupReply(10, summary));
  summary.key_codec = kvcomp::KeyCodec::kInt4;  // int4 keys (format 1.3)
  frames.push_back(wire::EncodeLookupReply(10, summary));
  summary.key_codec = kvcomp::KeyCodec::kInt8;
  frames.push_back(wire::Encode(11, wire::PutAbort{9}));
  frames.push_back(
      wire::Encode(12, wire::Get{wire::Representation::kDecoded, "llama-3-8b", "prefix/0001"}));
  wire::GetReply reply;
  reply.has_crc = true;
  reply.payload_crc = 0xabcdef01;
  frames.push_back(wire::Encode(13, reply, 4096));
  frames.push_back(wire::Encode(14, wire::Lookup{"llama-3-8b", "prefix/0001"}));
  frames.push_back(wire::Encode(15, wire::Delete{"llama-3-8b", "prefix/0001"}));
  wire::StatusReply status;
  status.code = 5;
  status.message = "cache not found";
  frames.push_back(wire::Encode(16, status));
  frames.push_back(wire::Encode(17, wire::Busy{1000, 1 << 20, 4 << 20}));
  frames.push_back(wire::Encode(18, wire::Ping{}));

  int n = 0;
  for (const std::string& f : frames) {
    // Typed: selector, payload length, body.
    std::string typed(1, f[6]);
    typed.append(f, 16, 8);
    typed.append(f, wire::kFrameHeaderBytes, std::string::npos);
    std::string raw(1, '\0');
    raw += f;
    for (const std::string* seed : {&typed, &raw}) {
      std::ofstream out(dir + "/seed-" + std::to_string(n++), std::ios::binary);
      out << *seed;
      if (!out) {
        std::fprintf(stderr, "cannot write to %s\n", dir.c_str());
        return 1;
      }
    }
  }
  std::printf("wrote %d seeds to %s\n", n, dir.c_str());
  return 0;
}
