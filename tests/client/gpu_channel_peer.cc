// A peer that dies in the middle of a GPU transfer, for gpu_channel_gpu_test.cc (a process of
// its own, so that it can be killed for real):
//
//   gpu_channel_peer put-and-die CONTROL_PORT DATA_PORT TENANT TOKEN DEVICE
//     opens a GPU channel to the kvcompd at 127.0.0.1:CONTROL_PORT, begins a put on its data
//     plane (DATA_PORT) with the block that names the channel, sends only the keys of its
//     payload from DEVICE and kills itself (SIGKILL): the daemon's receive is left half done.
//   gpu_channel_peer join-and-die ID_FILE DEVICE
//     makes an NCCL unique id, writes it to ID_FILE, joins the communicator as rank 0 on DEVICE
//     and kills itself without posting anything: the other rank's send has no receiver.
#include <signal.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TSocket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/gpu_link.h"

namespace {

using kvcomp::transport::GpuRuntime;
using kvcomp::transport::NcclLink;

int Fail(const std::string& what) {
  std::fprintf(stderr, "gpu_channel_peer: %s\n", what.c_str());
  return 1;
}

int PutAndDie(int port, int data_port, const std::string& tenant, const std::string& token,
              int device) {
  using apache::thrift::protocol::TBinaryProtocol;
  using apache::thrift::transport::TFramedTransport;
  using apache::thrift::transport::TSocket;
  auto rt = GpuRuntime::Get();
  if (!rt.ok()) return Fail(rt.status().ToString());
  if (auto s = GpuRuntime::LoadNccl(); !s.ok()) return Fail(s.ToString());
  auto uuid = (*rt)->DeviceUuid(device);
  if (!uuid.ok()) return Fail(uuid.status().ToString());
  auto socket = std::make_shared<TSocket>("127.0.0.1", port);
  auto transport = std::make_shared<TFramedTransport>(socket);
  kvcomp::rpc::KvcompControlClient control(std::make_shared<TBinaryProtocol>(transport));
  transport->open();
  kvcomp::rpc::Auth auth;
  auth.tenant = tenant;
  auth.token = token;
  kvcomp::rpc::GpuChannelRequest req;
  req.nccl_version = GpuRuntime::nccl_version();
  req.device_uuid = *uuid;
  req.__set_data_plane_puts(true);
  req.__set_data_plane_gets(true);
  kvcomp::rpc::GpuChannelResponse open;
  control.OpenGpuChannel(open, auth, req);
  if (open.status.code != kvcomp::rpc::StatusCode::OK) return Fail(open.status.message);
  auto link = NcclLink::Join(open.nccl_unique_id, 1, device, absl::Seconds(30));
  if (!link.ok()) return Fail(link.status().ToString());
  auto conn = kvcomp::transport::UcxClient::Connect(
      kvcomp::transport::Endpoint{"127.0.0.1", static_cast<uint16_t>(data_port)}, tenant, token);
  if (!conn.ok()) return Fail(conn.status().ToString());
  // 4 layers x 8 heads x 8192 tokens x 128 x bf16: 64 MiB of keys per 4 layers.
  namespace wire = kvcomp::transport::wire;
  wire::PutBegin put;
  put.model_id = "m";
  put.key = "half-sent";
  put.layout = kvcomp::KvLayout{4, 8, 32, 128, kvcomp::DType::kBF16};
  put.num_tokens = 8192;
  const size_t layer = size_t{8} * 8192 * 128 * 2;
  auto put_id = (*conn)->PutBegin(put);
  if (!put_id.ok()) return Fail(put_id.status().ToString());
  wire::Block block;
  block.put_id = *put_id;
  block.layer_end = 4;
  block.token_end = 8192;
  block.parts = wire::kPartBoth;
  block.key_bytes = 4 * layer;
  block.value_bytes = 4 * layer;
  block.flags = wire::kBlockLinkPayload;
  block.link_channel = static_cast<uint64_t>(open.channel_id);
  (*conn)->SendLinkBlockAsync(block, "", [](absl::Status) {});
  if (auto s = (*rt)->SetDevice(device); !s.ok()) return Fail(s.ToString());
  auto buf = (*rt)->AllocDevice(4 * layer);
  if (!buf.ok()) return Fail(buf.status().ToString());
  auto stream = (*rt)->NewStream();
  if (!stream.ok()) return Fail(stream.status().ToString());
  std::vector<NcclLink::Chunk> keys;
  for (int l = 0; l < 4; ++l) keys.push_back({static_cast<char*>(*buf) + l * layer, layer});
  if (auto s = (*link)->Send(keys, *stream); !s.ok()) return Fail(s.ToString());
  if (auto s = (*link)->Wait(*stream, absl::Now() + absl::Seconds(20)); !s.ok()) {
    return Fail(s.ToString());
  }
  std::printf("sent the keys; dying\n");
  std::fflush(stdout);
  kill(getpid(), SIGKILL);
  return 0;
}

int JoinAndDie(const std::string& id_file, int device) {
  auto rt = GpuRuntime::Get();
  if (!rt.ok()) return Fail(rt.status().ToString());
  if (auto s = (*rt)->SetDevice(device); !s.ok()) return Fail(s.ToString());
  auto id = (*rt)->NewUniqueId();
  if (!id.ok()) return Fail(id.status().ToString());
  {
    std::ofstream tmp(id_file + ".tmp", std::ios::binary);
    tmp.write(id->data(), static_cast<std::streamsize>(id->size()));
  }
  std::rename((id_file + ".tmp").c_str(), id_file.c_str());
  auto link = NcclLink::Join(*id, 0, device, absl::Seconds(30));
  if (!link.ok()) return Fail(link.status().ToString());
  std::printf("joined; dying\n");
  std::fflush(stdout);
  kill(getpid(), SIGKILL);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  if (a.size() == 6 && a[0] == "put-and-die") {
    return PutAndDie(std::atoi(a[1].c_str()), std::atoi(a[2].c_str()), a[3], a[4],
                     std::atoi(a[5].c_str()));
  }
  if (a.size() == 3 && a[0] == "join-and-die") return JoinAndDie(a[1], std::atoi(a[2].c_str()));
  std::fprintf(stderr, "usage: gpu_channel_peer put-and-die PORT DATA_PORT TENANT TOKEN DEVICE | "
                       "join-and-die ID_FILE DEVICE\n");
  return 2;
}
