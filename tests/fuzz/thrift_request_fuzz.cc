// libFuzzer target for the Thrift control plane's request decoding: the input is one frame body
// as kvcompd's TNonblockingServer hands it to the generated KvcompControlProcessor (the server
// strips the 4-byte frame length and bounds it by control_plane.max_frame_bytes first). The
// processor reads the message header with TBinaryProtocol, dispatches on the method name,
// deserializes the method's argument structs (Auth, CacheRef, Policy, CalibrateRequest, key
// lists) and writes a reply. The handler below applies the daemon's pure input checks, without a
// daemon: authentication against a token file, CacheKey validation of every key, key-list bounds
// and the policy conversion SetPolicy applies (service/src/policy_rpc.cc: each Policy field as
// policy_fields.def declares it, then CompressionPolicy::Validate). Decoding errors must surface as Thrift
// exceptions (the server closes the connection on them); any other exception, crash, sanitizer
// report or leak is a finding.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <thrift/TApplicationException.h>
#include <thrift/TOutput.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/rpc/kvcomp_constants.h"
#include "kvcomp/service/auth.h"
#include "kvcomp/service/config.h"
#include "kvcomp/service/options.h"
#include "policy_rpc.h"

namespace {

using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TMemoryBuffer;
namespace rpc = kvcomp::rpc;
namespace service = kvcomp::service;

rpc::Status ToRpc(const absl::Status& s) {
  rpc::Status out;
  out.code = static_cast<rpc::StatusCode::type>(static_cast<int>(s.code()));
  out.message = std::string(s.message());
  return out;
}

// rpc::Policy -> CompressionPolicy as SetPolicy converts it (service/src/policy_rpc.cc: each
// field as policy_fields.def declares it, then Validate), before anything is stored.
absl::Status CheckPolicy(const rpc::Policy& r) { return service::PolicyFromRpc(r).status(); }

class FuzzHandler : public rpc::KvcompControlIf {
 public:
  explicit FuzzHandler(const service::TokenStore* tokens) : tokens_(tokens) {}

  void Health(rpc::HealthResponse& out, const rpc::Auth& auth) override {
    out.status = ToRpc(Auth(auth).status());
  }
  void Stats(rpc::StatsResponse& out, const rpc::Auth& auth) override {
    out.status = ToRpc(Auth(auth).status());
  }
  void Lookup(rpc::LookupResponse& out, const rpc::Auth& auth, const rpc::CacheRef& ref) override {
    out.status = ToRpc(CheckRef(auth, ref.model_id, ref.key));
  }
  void Delete(rpc::DeleteResponse& out, const rpc::Auth& auth, const rpc::CacheRef& ref) override {
    out.status = ToRpc(CheckRef(auth, ref.model_id, ref.key));
  }
  void List(rpc::ListResponse& out, const rpc::Auth& auth, const std::string& model_id,
            const std::string& cursor, int32_t limit) override {
    absl::Status s = Auth(auth).status();
    if (s.ok() && !model_id.empty()) s = CheckRef(auth, model_id, "k");
    if (s.ok() && !cursor.empty()) s = CheckRef(auth, "m", cursor);
    if (s.ok() && limit < 0) s = absl::InvalidArgumentError("negative limit");
    out.status = ToRpc(s);
  }
  void GetPolicy(rpc::PolicyResponse& out, const rpc::Auth& auth,
                 const std::string& model_id) override {
    out.status = ToRpc(model_id.empty() ? Auth(auth).status() : CheckRef(auth, model_id, "k"));
  }
  void SetPolicy(rpc::PolicyResponse& out, const rpc::Auth& auth, const std::string& model_id,
                 const rpc::Policy& policy) override {
    absl::Status s = model_id.empty() ? Auth(auth).status() : CheckRef(auth, model_id, "k");
    if (s.ok()) s = CheckPolicy(policy);
    if (s.ok()) out.policy = policy;
    out.status = ToRpc(s);
  }
  void Calibrate(rpc::CalibrateResponse& out, const rpc::Auth& auth,
                 const rpc::CalibrateRequest& request) override {
    absl::Status s = CheckRef(auth, request.model_id, "k");
    if (s.ok()) {
      service::Options o;
      s = service::SetOption(o, "default_policy.value_codec", request.value_codec);
    }
    out.status = ToRpc(s);
  }
  void ServerInfo(rpc::ServerInfoResponse& out, const rpc::Auth& auth) override {
    out.status = ToRpc(Auth(auth).status());
  }
  void ListQuarantined(rpc::ListQuarantinedResponse& out, const rpc::Auth& auth,
                       const std::string& /*cursor*/, int32_t /*limit*/) override {
    out.status = ToRpc(Auth(auth).status());
  }
  void PurgeQuarantined(rpc::PurgeQuarantinedResponse& out, const rpc::Auth& auth,
                        const rpc::CacheRef& ref, bool all) override {
    absl::Status s = Auth(auth).status();
    if (s.ok() && !all && !ref.model_id.empty()) s = CheckRef(auth, ref.model_id, ref.key);
    out.status = ToRpc(s);
  }
  void LookupPrefix(rpc::LookupPrefixResponse& out, const rpc::Auth& auth,
                    const std::string& model_id, const std::vector<std::string>& keys) override {
    out.status = ToRpc(CheckKeys(auth, model_id, keys));
  }
  void GetChunks(rpc::GetChunksResponse& out, const rpc::Auth& auth, const std::string& model_id,
                 const std::vector<std::string>& keys, bool /*decoded*/,
                 int64_t /*max_bytes*/) override {
    out.status = ToRpc(CheckKeys(auth, model_id, keys));
  }
  // GPU channel calls: authenticated, no channel exists here (as on a daemon without a GPU).
  void OpenGpuChannel(rpc::GpuChannelResponse& out, const rpc::Auth& auth,
                      const rpc::GpuChannelRequest& /*request*/) override {
    absl::Status s = Auth(auth).status();
    if (s.ok()) s = absl::UnavailableError("no GPU channel");
    out.status = ToRpc(s);
  }
  void CloseGpuChannel(rpc::GpuCloseResponse& out, const rpc::Auth& auth,
                       int64_t /*channel_id*/) override {
    out.status = ToRpc(NoChannel(auth));
  }

 private:
  absl::Status NoChannel(const rpc::Auth& auth) const {
    absl::Status s = Auth(auth).status();
    return s.ok() ? absl::NotFoundError("no such GPU channel") : s;
  }
  absl::StatusOr<std::string> Auth(const rpc::Auth& auth) const {
    return tokens_->Authenticate(auth.tenant, auth.token);
  }
  absl::Status CheckRef(const rpc::Auth& auth, const std::string& model_id,
                        const std::string& key) const {
    auto tenant = Auth(auth);
    if (!tenant.ok()) return tenant.status();
    return kvcomp::CacheKey{*tenant, model_id, key}.Validate();
  }
  absl::Status CheckKeys(const rpc::Auth& auth, const std::string& model_id,
                         const std::vector<std::string>& keys) const {
    if (keys.size() > static_cast<size_t>(rpc::g_kvcomp_constants.MAX_PREFIX_KEYS)) {
      return absl::InvalidArgumentError("too many keys");
    }
    for (const std::string& key : keys) {
      if (absl::Status s = CheckRef(auth, model_id, key); !s.ok()) return s;
    }
    return Auth(auth).status();
  }

  const service::TokenStore* tokens_;
};

std::unique_ptr<service::TokenStore> tokens;
std::unique_ptr<rpc::KvcompControlProcessor> processor;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  apache::thrift::GlobalOutput.setOutputFunction([](const char*) {});  // per-input log lines
  char dir[] = "/tmp/kvcomp-thrift-fuzz-XXXXXX";
  if (mkdtemp(dir) == nullptr) std::abort();
  const std::string path = std::string(dir) + "/tokens.yaml";
  std::ofstream(path) << "acme: s3cret-token\nbeta: other-token\n";
  auto opened = service::TokenStore::Open(path);
  if (!opened.ok()) {
    std::fprintf(stderr, "token store: %s\n", opened.status().ToString().c_str());
    std::abort();
  }
  tokens = *std::move(opened);
  std::remove(path.c_str());
  rmdir(dir);
  processor = std::make_unique<rpc::KvcompControlProcessor>(
      std::make_shared<FuzzHandler>(tokens.get()));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto in = std::make_shared<TMemoryBuffer>(const_cast<uint8_t*>(data),
                                            static_cast<uint32_t>(size));
  auto out = std::make_shared<TMemoryBuffer>();
  // kvcompd's protocol limits (daemon.cc): strings up to the frame bound, lists up to a quarter
  // of it, at the default control_plane.max_frame_bytes.
  static const auto frame = static_cast<int32_t>(service::Options().control_plane.max_frame_bytes);
  auto iprot = std::make_shared<TBinaryProtocol>(in, frame, frame / 4, false, true);
  auto oprot = std::make_shared<TBinaryProtocol>(out);
  try {
    processor->process(iprot, oprot, nullptr);
  } catch (const apache::thrift::TException&) {
    // Malformed bytes: the server closes the connection.
  }
  return 0;
}
