#include "kvcomp/service/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvcomp/core/policy_fields.h"
#include "kvcomp/core/policy_presets.h"
#include "kvcomp/core/status.h"
#include "kvcomp/service/daemon.h"

namespace kvcomp {
namespace service {
namespace {

absl::Status BadValue(absl::string_view key, absl::string_view value, absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat("option ", key, ": '", value, "' is not ", want));
}

absl::StatusOr<bool> ParseBool(absl::string_view key, absl::string_view v) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(v));
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  return BadValue(key, v, "a boolean (true/false)");
}

absl::StatusOr<int64_t> ParseInt(absl::string_view key, absl::string_view v, int64_t lo,
                                 int64_t hi) {
  int64_t x = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &x) || x < lo || x > hi) {
    return BadValue(key, v, absl::StrCat("an integer in [", lo, ", ", hi, "]"));
  }
  return x;
}

// Integers with an optional binary (Ki, Mi, Gi, Ti) or decimal (K, M, G, T) suffix, as Kubernetes
// writes quantities.
absl::StatusOr<uint64_t> ParseBytes(absl::string_view key, absl::string_view v) {
  absl::string_view s = absl::StripAsciiWhitespace(v);
  static const std::pair<const char*, uint64_t> kSuffixes[] = {{"Ki", uint64_t{1} << 10},
                                                               {"Mi", uint64_t{1} << 20},
                                                               {"Gi", uint64_t{1} << 30},
                                                               {"Ti", uint64_t{1} << 40},
                                                               {"K", 1000},
                                                               {"M", 1000000},
                                                               {"G", 1000000000},
                                                               {"T", 1000000000000}};
  uint64_t mult = 1;
  for (const auto& [suffix, m] : kSuffixes) {
    if (absl::EndsWith(s, suffix)) {
      s.remove_suffix(strlen(suffix));
      mult = m;
      break;
    }
  }
  uint64_t x = 0;
  if (!absl::SimpleAtoi(s, &x) || (x != 0 && x > std::numeric_limits<uint64_t>::max() / mult)) {
    return BadValue(key, v, "a byte count (an integer, optionally with Ki, Mi, Gi, Ti)");
  }
  return x * mult;
}

absl::StatusOr<double> ParseDouble(absl::string_view key, absl::string_view v, double lo,
                                   double hi) {
  double x = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(v), &x) || !std::isfinite(x) || x < lo ||
      x > hi) {
    return BadValue(key, v, absl::StrCat("a number in [", lo, ", ", hi, "]"));
  }
  return x;
}

std::string DoubleText(double d) {
  std::ostringstream os;
  os << d;
  return os.str();
}

// A comma-separated list of distinct CUDA device ordinals ("0,1,3"); empty text is an empty
// list.
absl::StatusOr<std::vector<int>> ParseDeviceList(absl::string_view key, absl::string_view v) {
  std::vector<int> out;
  absl::string_view text = absl::StripAsciiWhitespace(v);
  if (text.empty()) return out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0 || d > 64) {
      return BadValue(key, v, "a comma-separated list of CUDA device ordinals in [0, 64]");
    }
    if (std::find(out.begin(), out.end(), static_cast<int>(d)) != out.end()) {
      return BadValue(key, v, absl::StrCat("a list of distinct devices (", d, " repeats)"));
    }
    out.push_back(static_cast<int>(d));
  }
  return out;
}

// Builders of table rows. `access` maps an Options to the field; get() reads through a
// const_cast, never writes.
template <typename Access>
ConfigField StringField(std::string key, std::string help, Access access) {
  return ConfigField{key, "string", std::move(help),
                     [key, access](Options& o, absl::string_view v) {
                       // Paths, addresses and names: a control character (a stray carriage
                       // return folded into a YAML scalar, a tab) is refused, never kept.
                       for (char c : v) {
                         const auto u = static_cast<unsigned char>(c);
                         if (u < 0x20 || u == 0x7f) {
                           return absl::InvalidArgumentError(
                               absl::StrCat(key, " contains a control character (byte ",
                                            static_cast<int>(u), ")"));
                         }
                       }
                       access(o) = std::string(v);
                       return absl::OkStatus();
                     },
                     [access](const Options& o) { return access(const_cast<Options&>(o)); }};
}

template <typename Access>
ConfigField EnumField(std::string key, std::vector<std::string> allowed, std::string help,
                      Access access) {
  std::string type = "enum";
  help += " One of: " + absl::StrJoin(allowed, ", ") + ".";
  return ConfigField{key, type, std::move(help),
                     [key, allowed, access](Options& o, absl::string_view v) {
                       std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(v));
                       for (const auto& a : allowed) {
                         if (a == s) {
                           access(o) = s;
                           return absl::OkStatus();
                         }
                       }
                       return BadValue(key, v, "one of " + absl::StrJoin(allowed, ", "));
                     },
                     [access](const Options& o) { return access(const_cast<Options&>(o)); }};
}

template <typename Access>
ConfigField BoolField(std::string key, std::string help, Access access) {
  return ConfigField{key, "bool", std::move(help),
                     [key, access](Options& o, absl::string_view v) -> absl::Status {
                       KVCOMP_ASSIGN_OR_RETURN(access(o), ParseBool(key, v));
                       return absl::OkStatus();
                     },
                     [access](const Options& o) -> std::string {
                       return access(const_cast<Options&>(o)) ? "true" : "false";
                     }};
}

template <typename Access>
ConfigField IntField(std::string key, int64_t lo, int64_t hi, std::string help, Access access) {
  using T = std::decay_t<decltype(access(std::declval<Options&>()))>;
  return ConfigField{
      key, lo < 0 ? "int" : "uint", std::move(help),
      [key, lo, hi, access](Options& o, absl::string_view v) -> absl::Status {
        KVCOMP_ASSIGN_OR_RETURN(int64_t x, ParseInt(key, v, lo, hi));
        access(o) = static_cast<T>(x);
        return absl::OkStatus();
      },
      [access](const Options& o) { return absl::StrCat(access(const_cast<Options&>(o))); }};
}

template <typename Access>
ConfigField BytesField(std::string key, std::string help, Access access) {
  return ConfigField{
      key, "bytes", std::move(help),
      [key, access](Options& o, absl::string_view v) -> absl::Status {
        KVCOMP_ASSIGN_OR_RETURN(access(o), ParseBytes(key, v));
        return absl::OkStatus();
      },
      [access](const Options& o) { return absl::StrCat(access(const_cast<Options&>(o))); }};
}

template <typename Access>
ConfigField DoubleField(std::string key, std::string type, double lo, double hi, std::string help,
                        Access access) {
  return ConfigField{
      key, std::move(type), std::move(help),
      [key, lo, hi, access](Options& o, absl::string_view v) -> absl::Status {
        KVCOMP_ASSIGN_OR_RETURN(access(o), ParseDouble(key, v, lo, hi));
        return absl::OkStatus();
      },
      [access](const Options& o) { return DoubleText(access(const_cast<Options&>(o))); }};
}

// A field of default_policy, parsed, range-checked and printed as core declares it; remembered
// so that a preset given later keeps it.
ConfigField PolicyRow(const PolicyFieldInfo& pf) {
  std::string key = absl::StrCat("default_policy.", pf.name);
  return ConfigField{key, std::string(pf.unit), pf.Help(),
                     [key, &pf](Options& o, absl::string_view v) -> absl::Status {
                       KVCOMP_RETURN_IF_ERROR(Annotate(pf.set(o.default_policy, v),
                                                       absl::StrCat("option ", key)));
                       auto& given = o.default_policy_fields;
                       given.erase(std::remove_if(given.begin(), given.end(),
                                                  [&pf](const auto& e) { return e.first == pf.name; }),
                                   given.end());
                       given.emplace_back(std::string(pf.name), std::string(v));
                       return absl::OkStatus();
                     },
                     [&pf](const Options& o) { return pf.text(o.default_policy); }};
}

// default_policy.preset: the policy becomes the preset, then the field keys given (in any
// source, before or after) are applied over it again.
ConfigField PolicyPresetRow() {
  const std::string key = "default_policy.preset";
  return ConfigField{
      key, "enum",
      absl::StrCat("Named policy the default policy starts from; the default_policy.<field> keys "
                   "override its fields. Empty = the field defaults. One of: ",
                   absl::StrJoin(PolicyPresetNames(), ", "), "."),
      [key](Options& o, absl::string_view v) -> absl::Status {
        CompressionPolicy p;
        if (!v.empty()) {
          absl::StatusOr<CompressionPolicy> preset = PolicyPreset(v);
          if (!preset.ok()) return Annotate(preset.status(), absl::StrCat("option ", key));
          p = *preset;
        }
        for (const auto& [name, text] : o.default_policy_fields) {
          for (const PolicyFieldInfo& pf : PolicyFields()) {
            if (pf.name == name) KVCOMP_RETURN_IF_ERROR(pf.set(p, text));
          }
        }
        o.default_policy = p;
        o.default_policy_preset = std::string(v);
        return absl::OkStatus();
      },
      [](const Options& o) { return o.default_policy_preset; }};
}

std::vector<ConfigField> BuildFields() {
  constexpr int64_t kPortMax = 65535;
  std::vector<ConfigField> f;
  // --- data_plane ---
  f.push_back(StringField(
      "data_plane.address", "UCX listen address. Default 127.0.0.1.",
      [](Options & o) -> auto& { return o.data_plane.address; }));
  f.push_back(IntField(
      "data_plane.port", 0, kPortMax, "UCX listener port; 0 picks a free one. Default 7470.",
      [](Options & o) -> auto& { return o.data_plane.port; }));
  f.push_back(BytesField(
      "data_plane.max_put_bytes",
      "Largest cache a put may announce (uncompressed K+V bytes). Default 16Gi.",
      [](Options & o) -> auto& { return o.data_plane.max_put_bytes; }));
  f.push_back(BytesField(
      "data_plane.max_block_bytes",
      "Largest block payload (K+V of one block), bytes. Default 256Mi.",
      [](Options & o) -> auto& { return o.data_plane.max_block_bytes; }));
  f.push_back(BytesField(
      "data_plane.max_inflight_bytes_per_connection",
      "Bytes of blocks a connection may have in flight (received, not yet acknowledged); beyond "
      "it blocks get busy. Default 1Gi.",
      [](Options & o) -> auto& { return o.data_plane.max_inflight_bytes_per_connection; }));
  f.push_back(DoubleField(
      "data_plane.put_timeout_seconds", "seconds", 0.1, 86400,
      "A put with no traffic for this long is aborted. Default 60.",
      [](Options & o) -> auto& { return o.data_plane.put_timeout_seconds; }));
  f.push_back(BytesField(
      "data_plane.max_buffered_bytes",
      "Received block bytes held by all open puts until compressed or dropped, admitted before "
      "their buffers are allocated; beyond it blocks get busy. Default 4Gi.",
      [](Options & o) -> auto& { return o.data_plane.max_buffered_bytes; }));
  f.push_back(IntField(
      "data_plane.max_open_puts", 1, 1 << 20,
      "Puts receiving blocks at once; beyond it put-begin gets busy. Default 256.",
      [](Options & o) -> auto& { return o.data_plane.max_open_puts; }));
  f.push_back(DoubleField(
      "data_plane.tenant_share", "fraction", 0.01, 1,
      "Share of max_buffered_bytes, max_open_puts, max_connections and engine.queue_capacity one "
      "tenant may hold; 1 = no per-tenant bound. Default 0.5.",
      [](Options & o) -> auto& { return o.data_plane.tenant_share; }));
  f.push_back(IntField(
      "data_plane.max_connections", 1, 1 << 20, "UCX endpoints at once. Default 1024.",
      [](Options & o) -> auto& { return o.data_plane.max_connections; }));
  f.push_back(IntField(
      "data_plane.max_pre_hello_connections", 1, 1 << 20,
      "Endpoints still waiting for their hello; a new one beyond it closes the oldest. Default "
      "64.",
      [](Options & o) -> auto& { return o.data_plane.max_pre_hello_connections; }));
  f.push_back(DoubleField(
      "data_plane.hello_timeout_seconds", "seconds", 0.1, 3600,
      "A connection without a hello this long after connecting is closed. Default 3.",
      [](Options & o) -> auto& { return o.data_plane.hello_timeout_seconds; }));
  f.push_back(DoubleField(
      "data_plane.idle_timeout_seconds", "seconds", 1, 604800,
      "A connection with no message for this long is closed. Default 600.",
      [](Options & o) -> auto& { return o.data_plane.idle_timeout_seconds; }));
  f.push_back(IntField(
      "data_plane.fd_reserve", 0, 1 << 20,
      "Free file descriptors below which the UCX listener closes (new connections refused), "
      "reopening at twice as many; 0 = never. Default 64.",
      [](Options & o) -> auto& { return o.data_plane.fd_reserve; }));
  f.push_back(StringField(
      "data_plane.ucx_tls",
      "UCX transports (UCX_TLS syntax, e.g. tcp or posix,tcp; tcp is needed for connection "
      "set-up). Empty = UCX_TLS from the environment or UCX's default. Default empty.",
      [](Options & o) -> auto& { return o.data_plane.ucx_tls; }));
  f.push_back(StringField(
      "data_plane.ucx_net_devices",
      "UCX network devices (UCX_NET_DEVICES syntax). Empty = UCX's choice. Default empty.",
      [](Options & o) -> auto& { return o.data_plane.ucx_net_devices; }));
  f.push_back(EnumField(
      "data_plane.ucx_interop", {"defaults", "auto"},
      "On a UCX release before 1.14: auto makes connections on one device "
      "(UCX_CM_USE_ALL_DEVICES=n) so that clients on UCX 1.14 or later connect, but clients of "
      "earlier kvcomp releases on UCX before 1.14 do not; defaults keeps UCX's defaults, the reverse. "
      "Clients of this release on UCX before 1.14 connect either way. No effect on UCX 1.14 or "
      "later. Default defaults.",
      [](Options & o) -> auto& { return o.data_plane.ucx_interop; }));
  f.push_back(BoolField(
      "data_plane.shared_memory",
      "Offer same-host shared memory: clients on this host move put and get payloads through "
      "memory regions they pass over an abstract Unix socket instead of UCX. Default true.",
      [](Options & o) -> auto& { return o.data_plane.shared_memory; }));
  f.push_back(BytesField(
      "data_plane.shm_max_region_bytes",
      "Largest shared region of a client the daemon maps; a get larger than a client's region "
      "goes over UCX. Default 1Gi.",
      [](Options & o) -> auto& { return o.data_plane.shm_max_region_bytes; }));
  f.push_back(IntField(
      "data_plane.shm_copy_lanes", 0, 16,
      "Threads that copy shared-memory payloads: blocks out of clients' memory, several at "
      "once, and one direct get (8 MiB or more a thread) into the client's memory; 0 = one per "
      "4 CPUs the daemon may run on, 1 to 4. Default 0.",
      [](Options & o) -> auto& { return o.data_plane.shm_copy_lanes; }));
  f.push_back(BoolField(
      "data_plane.gpu_channel",
      "Offer the GPU channel (NCCL from the client's GPU to the engine's) when NCCL and a CUDA "
      "device are present. Default true.",
      [](Options & o) -> auto& { return o.data_plane.gpu_channel; }));
  f.push_back(IntField(
      "data_plane.gpu_max_channels", 1, 4096,
      "GPU channels open at once (a tenant its tenant_share of them). Default 64.",
      [](Options & o) -> auto& { return o.data_plane.gpu_max_channels; }));
  f.push_back(DoubleField(
      "data_plane.gpu_transfer_timeout_seconds", "seconds", 0.1, 3600,
      "A GPU channel's communicator forming, or one transfer, longer than this is aborted and "
      "the channel closed. Default 30.",
      [](Options & o) -> auto& { return o.data_plane.gpu_transfer_timeout_seconds; }));
  f.push_back(DoubleField(
      "data_plane.gpu_idle_timeout_seconds", "seconds", 0, 86400,
      "A GPU channel with no transfer for this long is closed; 0 = never. Default 600.",
      [](Options & o) -> auto& { return o.data_plane.gpu_idle_timeout_seconds; }));
  // --- control_plane ---
  f.push_back(StringField(
      "control_plane.address", "Thrift listen address. Default 127.0.0.1.",
      [](Options & o) -> auto& { return o.control_plane.address; }));
  f.push_back(IntField(
      "control_plane.port", 0, kPortMax,
      "Thrift port (framed binary); 0 picks a free one. Default 7471.",
      [](Options & o) -> auto& { return o.control_plane.port; }));
  f.push_back(IntField(
      "control_plane.io_threads", 1, 64, "I/O threads of the nonblocking Thrift server. Default 1.",
      [](Options & o) -> auto& { return o.control_plane.io_threads; }));
  f.push_back(IntField(
      "control_plane.worker_threads", 1, 256, "Threads running control-plane handlers. Default 4.",
      [](Options & o) -> auto& { return o.control_plane.worker_threads; }));
  f.push_back(BoolField(
      "control_plane.tls", "Serve the Thrift port over TLS. Default false.",
      [](Options & o) -> auto& { return o.control_plane.tls; }));
  f.push_back(StringField(
      "control_plane.tls_cert_file", "PEM certificate chain for TLS. Default empty.",
      [](Options & o) -> auto& { return o.control_plane.tls_cert_file; }));
  f.push_back(StringField(
      "control_plane.tls_key_file", "PEM private key for TLS. Default empty.",
      [](Options & o) -> auto& { return o.control_plane.tls_key_file; }));
  f.push_back(StringField(
      "control_plane.tls_ca_file",
      "PEM CA bundle; when set, TLS clients must present a certificate it signs. Default empty.",
      [](Options & o) -> auto& { return o.control_plane.tls_ca_file; }));
  f.push_back(BytesField(
      "control_plane.max_frame_bytes",
      "Largest Thrift request frame read; a larger one closes the connection before it is "
      "buffered (the largest control request, 1024 prefix keys of 1 KiB, is about 1Mi). "
      "Default 1280Ki.",
      [](Options & o) -> auto& { return o.control_plane.max_frame_bytes; }));
  f.push_back(BytesField(
      "control_plane.max_reply_bytes",
      "Largest reply one control call builds: a GetChunks reply stops before passing it (a first "
      "cache larger than it is RESOURCE_EXHAUSTED). Default 64Mi.",
      [](Options & o) -> auto& { return o.control_plane.max_reply_bytes; }));
  f.push_back(BytesField(
      "control_plane.tenant_reply_bytes",
      "Reply bytes one tenant's control calls hold at once; a call that would pass it is "
      "RESOURCE_EXHAUSTED, or truncated after its first cache; at least twice max_reply_bytes. "
      "Default 128Mi.",
      [](Options & o) -> auto& { return o.control_plane.tenant_reply_bytes; }));
  f.push_back(IntField(
      "control_plane.max_connections", 1, 1 << 20,
      "Open Thrift connections at once; beyond it new ones are closed on accept. Default 1024.",
      [](Options & o) -> auto& { return o.control_plane.max_connections; }));
  f.push_back(IntField(
      "control_plane.max_unauthenticated_connections", 1, 1 << 20,
      "Connections no call has authenticated yet; a new one beyond it closes the oldest such "
      "connection with no call running. Default 256.",
      [](Options & o) -> auto& { return o.control_plane.max_unauthenticated_connections; }));
  f.push_back(DoubleField(
      "control_plane.auth_timeout_seconds", "seconds", 0.1, 3600,
      "A Thrift connection on which no call has authenticated this long after accept is closed, "
      "whatever it sends. Default 10.",
      [](Options & o) -> auto& { return o.control_plane.auth_timeout_seconds; }));
  f.push_back(DoubleField(
      "control_plane.tenant_share", "fraction", 0.01, 1,
      "Share of max_connections one tenant's authenticated Thrift connections may hold; 1 = no "
      "per-tenant bound (none in open mode). Default 0.5.",
      [](Options & o) -> auto& { return o.control_plane.tenant_share; }));
  f.push_back(IntField(
      "control_plane.max_policies_per_tenant", 0, 1 << 24,
      "Policies (models plus its default) one tenant may hold; SetPolicy of a new one beyond it "
      "is RESOURCE_EXHAUSTED. 0 = no bound. Default 1024.",
      [](Options & o) -> auto& { return o.control_plane.max_policies_per_tenant; }));
  f.push_back(DoubleField(
      "control_plane.policy_updates_per_second", "rate", 0, 1e6,
      "SetPolicy calls per second one tenant may make (bursts of twice as many); beyond it "
      "RESOURCE_EXHAUSTED. 0 = no bound. Default 50.",
      [](Options & o) -> auto& { return o.control_plane.policy_updates_per_second; }));
  f.push_back(DoubleField(
      "control_plane.idle_timeout_seconds", "seconds", 0, 86400,
      "An authenticated Thrift connection with no authenticated call for this long is closed; "
      "0 = never. Default 60.",
      [](Options & o) -> auto& { return o.control_plane.idle_timeout_seconds; }));
  // --- metrics ---
  f.push_back(BoolField(
      "metrics.enabled", "Serve /metrics, /healthz and /readyz over HTTP. Default true.",
      [](Options & o) -> auto& { return o.metrics.enabled; }));
  f.push_back(StringField(
      "metrics.address", "HTTP listen address. Default 127.0.0.1.",
      [](Options & o) -> auto& { return o.metrics.address; }));
  f.push_back(IntField(
      "metrics.port", 0, kPortMax,
      "HTTP port for metrics and probes; 0 picks a free one. Default 7472.",
      [](Options & o) -> auto& { return o.metrics.port; }));
  // --- auth ---
  f.push_back(StringField(
      "auth.token_file",
      "File of `tenant: token` lines or a directory of one file per tenant (a mounted secret). "
      "Empty path: open single-tenant daemon; once set, auth is required (a missing or empty "
      "source stops the start and keeps the previous tokens at a reload). Default empty.",
      [](Options & o) -> auto& { return o.auth.token_file; }));
  f.push_back(DoubleField(
      "auth.reload_interval_seconds", "seconds", 0, 86400,
      "How often the token file's mtime is checked for a reload (SIGHUP reloads at once); 0 = "
      "only on SIGHUP. Default 5.",
      [](Options & o) -> auto& { return o.auth.reload_interval_seconds; }));
  // --- engine ---
  f.push_back(EnumField(
      "engine.backend", {"auto", "cpu", "cuda"},
      "Compression backend; auto = cuda when a GPU is present. Default auto.",
      [](Options & o) -> auto& { return o.engine.backend; }));
  f.push_back(IntField(
      "engine.cuda_device", 0, 64, "CUDA device ordinal. Default 0.",
      [](Options & o) -> auto& { return o.engine.cuda_device; }));
  f.push_back(ConfigField{
      "engine.cuda_devices", "string",
      "CUDA devices to run one engine each on, comma-separated ordinals (0,1,2,3); puts are "
      "spread over them. Empty = one engine on engine.cuda_device. Default empty.",
      [](Options& o, absl::string_view v) -> absl::Status {
        KVCOMP_ASSIGN_OR_RETURN(std::vector<int> devices,
                                ParseDeviceList("engine.cuda_devices", v));
        o.engine.cuda_devices = absl::StrJoin(devices, ",");
        return absl::OkStatus();
      },
      [](const Options& o) { return o.engine.cuda_devices; }});
  f.push_back(IntField(
      "engine.cpu_threads", 0, 1024,
      "Threads per CPU backend; 0 = hardware threads / workers. Default 0.",
      [](Options & o) -> auto& { return o.engine.cpu_threads; }));
  f.push_back(IntField(
      "engine.workers", 1, 256, "Compression workers, each with its own backend. Default 2.",
      [](Options & o) -> auto& { return o.engine.workers; }));
  f.push_back(IntField(
      "engine.queue_capacity", 1, 1 << 20,
      "Committed puts waiting for a worker; when full, commits get busy. Default 16.",
      [](Options & o) -> auto& { return o.engine.queue_capacity; }));
  f.push_back(BytesField(
      "engine.gpu_memory_bytes",
      "GPU memory the CUDA engine's open puts may hold at once (K and V staged on the device "
      "plus their compressed arrays), per device; a put beyond it is RESOURCE_EXHAUSTED. 0 = no "
      "cap. Default 0.",
      [](Options & o) -> auto& { return o.engine.gpu_memory_bytes; }));
  // --- storage ---
  f.push_back(StringField(
      "storage.data_dir", "Directory of the RocksDB tier and daemon state. Default ./.kvcomp-data.",
      [](Options & o) -> auto& { return o.storage.data_dir; }));
  f.push_back(EnumField(
      "storage.durability", {"memory", "disk", "behind"},
      "When a put is acknowledged: memory (in its first tier), disk (RocksDB, synced) or behind "
      "(in its first tier, then written to RocksDB behind the put; a crash loses at most "
      "storage.behind_max_bytes of acknowledged puts). Default disk.",
      [](Options & o) -> auto& { return o.storage.durability; }));
  f.push_back(EnumField(
      "storage.put_tier", {"device", "host", "rocksdb"}, "Tier a new cache lands in. Default host.",
      [](Options & o) -> auto& { return o.storage.put_tier; }));
  f.push_back(BytesField(
      "storage.device_capacity_bytes",
      "GPU-memory tier capacity, on each engine device; 0 = no GPU tier. Default 0.",
      [](Options & o) -> auto& { return o.storage.device_capacity_bytes; }));
  f.push_back(BytesField(
      "storage.host_capacity_bytes", "Host-memory tier capacity; 0 = no host tier. Default 1Gi.",
      [](Options & o) -> auto& { return o.storage.host_capacity_bytes; }));
  f.push_back(BoolField(
      "storage.rocksdb_enabled", "RocksDB tier under <data_dir>/rocksdb. Default true.",
      [](Options & o) -> auto& { return o.storage.rocksdb_enabled; }));
  f.push_back(BytesField(
      "storage.rocksdb_capacity_bytes", "RocksDB tier capacity (payload bytes). Default 64Gi.",
      [](Options & o) -> auto& { return o.storage.rocksdb_capacity_bytes; }));
  f.push_back(BytesField(
      "storage.rocksdb_reserve_bytes",
      "Free space kept on the RocksDB volume: a put that would leave less is refused "
      "(RESOURCE_EXHAUSTED, disk full) and puts resume by themselves once there is room. "
      "Default 64Mi.",
      [](Options & o) -> auto& { return o.storage.rocksdb_reserve_bytes; }));
  f.push_back(BytesField(
      "storage.behind_max_bytes",
      "With storage.durability behind: bytes of acknowledged puts not yet written to RocksDB, at "
      "most (the loss window of a crash); a put past it is written through. Default 1Gi.",
      [](Options & o) -> auto& { return o.storage.behind_max_bytes; }));
  f.push_back(DoubleField(
      "storage.high_watermark", "fraction", 0, 1,
      "A tier above this fraction of its capacity demotes. Default 0.9.",
      [](Options & o) -> auto& { return o.storage.high_watermark; }));
  f.push_back(DoubleField(
      "storage.low_watermark", "fraction", 0, 1,
      "Demotion stops below this fraction. Default 0.75.",
      [](Options & o) -> auto& { return o.storage.low_watermark; }));
  f.push_back(BoolField(
      "storage.promote_on_read",
      "A get served from RocksDB copies the cache into the host tier. "
      "Default true.",
      [](Options & o) -> auto& { return o.storage.promote_on_read; }));
  f.push_back(DoubleField(
      "storage.ttl_seconds", "seconds", 0, 1e9,
      "Caches expire this long after their put; 0 = never. Default 0.",
      [](Options & o) -> auto& { return o.storage.ttl_seconds; }));
  f.push_back(BytesField(
      "storage.tenant_quota_bytes", "Stored bytes per tenant; 0 = unlimited. Default 0.",
      [](Options & o) -> auto& { return o.storage.tenant_quota_bytes; }));
  f.push_back(BoolField(
      "storage.verify_checksums_on_open",
      "Check every RocksDB payload's CRC32C at start. Default true.",
      [](Options & o) -> auto& { return o.storage.verify_checksums_on_open; }));
  f.push_back(DoubleField(
      "storage.sweep_interval_seconds", "seconds", 0, 1e9,
      "How often expired caches are removed and projection versions no stored cache names "
      "(other than a model's latest) are deleted; 0 = only on Delete and Calibrate. Default 60.",
      [](Options & o) -> auto& { return o.storage.sweep_interval_seconds; }));
  // --- default_policy: one row per policy field, from its declaration (policy_fields.def) ---
  f.push_back(PolicyPresetRow());
  for (const PolicyFieldInfo& pf : PolicyFields()) f.push_back(PolicyRow(pf));
  // --- process ---
  f.push_back(DoubleField(
      "process.shutdown_grace_seconds", "seconds", 0, 3600,
      "On SIGTERM, time to finish in-flight work before flushing and exiting. Default 30.",
      [](Options & o) -> auto& { return o.process.shutdown_grace_seconds; }));
  f.push_back(EnumField(
      "process.log_level", {"debug", "info", "warning", "error"}, "Log verbosity. Default info.",
      [](Options & o) -> auto& { return o.process.log_level; }));
  f.push_back(EnumField(
      "process.log_format", {"text", "json"},
      "Log lines on stderr: text, or json (one object per line with ts, level, logger, msg). "
      "Default text.",
      [](Options & o) -> auto& { return o.process.log_format; }));
  f.push_back(StringField(
      "process.ready_file",
      "Written when ready: YAML with data_port, control_port, metrics_port and pid (for "
      "port 0 users). Default empty.",
      [](Options & o) -> auto& { return o.process.ready_file; }));
  return f;
}

const ConfigField* FindField(absl::string_view key) {
  for (const auto& f : ConfigFields()) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

absl::Status FlattenYaml(const YAML::Node& node, const std::string& prefix,
                         std::vector<std::pair<std::string, std::string>>* out) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
      if (!prefix.empty()) out->emplace_back(prefix, "");
      return absl::OkStatus();
    case YAML::NodeType::Scalar:
      if (prefix.empty()) return absl::InvalidArgumentError("configuration is not a YAML map");
      out->emplace_back(prefix, node.Scalar());
      return absl::OkStatus();
    case YAML::NodeType::Map:
      for (const auto& kv : node) {
        std::string k = kv.first.as<std::string>();
        KVCOMP_RETURN_IF_ERROR(FlattenYaml(kv.second, prefix.empty() ? k : prefix + "." + k, out));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("configuration key ", prefix, ": lists are not options"));
  }
}

}  // namespace

std::string ConfigField::flag() const { return "--" + key; }

std::string ConfigField::env_var() const {
  std::string e = "KVCOMP_";
  for (char c : key) e += c == '.' ? '_' : static_cast<char>(absl::ascii_toupper(c));
  return e;
}

const std::vector<ConfigField>& ConfigFields() {
  static const auto* fields = new std::vector<ConfigField>(BuildFields());
  return *fields;
}

absl::Status SetOption(Options& options, absl::string_view key, absl::string_view value) {
  const ConfigField* f = FindField(key);
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("unknown option ", key));
  return f->set(options, value);
}

absl::Status ApplyYaml(Options& options, absl::string_view yaml_text) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("configuration YAML: ", e.what()));
  }
  if (root.IsNull()) return absl::OkStatus();
  if (!root.IsMap()) return absl::InvalidArgumentError("configuration is not a YAML map");
  std::vector<std::pair<std::string, std::string>> flat;
  try {
    KVCOMP_RETURN_IF_ERROR(FlattenYaml(root, "", &flat));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("configuration YAML: ", e.what()));
  }
  for (const auto& [k, v] : flat) {
    absl::Status s = SetOption(options, k, v);
    if (absl::IsNotFound(s)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown configuration key '", k, "'"));
    }
    KVCOMP_RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

absl::Status ApplyYamlFile(Options& options, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read configuration file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return Annotate(ApplyYaml(options, ss.str()), path);
}

absl::Status ApplyEnvironment(Options& options) {
  for (const auto& f : ConfigFields()) {
    const char* v = std::getenv(f.env_var().c_str());
    if (v != nullptr) KVCOMP_RETURN_IF_ERROR(Annotate(f.set(options, v), f.env_var()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> EngineCudaDevices(const EngineOptions& engine) {
  KVCOMP_ASSIGN_OR_RETURN(std::vector<int> devices,
                          ParseDeviceList("engine.cuda_devices", engine.cuda_devices));
  if (devices.empty()) devices.push_back(engine.cuda_device);
  return devices;
}

absl::Status ValidateOptions(const Options& o) {
  KVCOMP_RETURN_IF_ERROR(EngineCudaDevices(o.engine).status());
  if (o.engine.backend == "cpu" && !o.engine.cuda_devices.empty()) {
    return absl::InvalidArgumentError(
        "engine.cuda_devices lists GPUs but engine.backend is cpu (use cuda or auto)");
  }
  const auto& s = o.storage;
  if (!(s.low_watermark < s.high_watermark)) {
    return absl::InvalidArgumentError("storage.low_watermark must be below storage.high_watermark");
  }
  if (s.data_dir.empty()) return absl::InvalidArgumentError("storage.data_dir is empty");
  if (s.put_tier == "device" && s.device_capacity_bytes == 0) {
    return absl::InvalidArgumentError(
        "storage.put_tier is device but storage.device_capacity_bytes is 0");
  }
  if (s.put_tier == "host" && s.host_capacity_bytes == 0) {
    return absl::InvalidArgumentError(
        "storage.put_tier is host but storage.host_capacity_bytes is 0");
  }
  if ((s.put_tier == "rocksdb" || s.durability != "memory") && !s.rocksdb_enabled) {
    return absl::InvalidArgumentError(
        "storage.put_tier rocksdb or storage.durability disk or behind need "
        "storage.rocksdb_enabled");
  }
  if (o.control_plane.tls &&
      (o.control_plane.tls_cert_file.empty() || o.control_plane.tls_key_file.empty())) {
    return absl::InvalidArgumentError(
        "control_plane.tls needs control_plane.tls_cert_file and control_plane.tls_key_file");
  }
  if (o.control_plane.max_frame_bytes < 1024 ||
      o.control_plane.max_frame_bytes > (uint64_t{256} << 20)) {
    return absl::InvalidArgumentError("control_plane.max_frame_bytes must be in [1Ki, 256Mi]");
  }
  // A reply is one Thrift frame, whose size is a signed 32-bit count.
  if (o.control_plane.max_reply_bytes < (uint64_t{64} << 10) ||
      o.control_plane.max_reply_bytes > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError("control_plane.max_reply_bytes must be in [64Ki, 1Gi]");
  }
  // A cache is held read and copied into its reply at once: one full reply needs twice.
  if (o.control_plane.tenant_reply_bytes < 2 * o.control_plane.max_reply_bytes) {
    return absl::InvalidArgumentError(
        "control_plane.tenant_reply_bytes must be at least twice control_plane.max_reply_bytes");
  }
  if (o.data_plane.max_block_bytes == 0 || o.data_plane.max_put_bytes == 0) {
    return absl::InvalidArgumentError("data_plane.max_block_bytes and max_put_bytes must be > 0");
  }
  auto ports_clash = [](uint16_t a, uint16_t b) { return a != 0 && a == b; };
  if (ports_clash(o.data_plane.port, o.control_plane.port) ||
      (o.metrics.enabled && (ports_clash(o.metrics.port, o.control_plane.port) ||
                             ports_clash(o.metrics.port, o.data_plane.port)))) {
    return absl::InvalidArgumentError("data_plane.port, control_plane.port and metrics.port clash");
  }
  return Annotate(o.default_policy.Validate(), "default_policy");
}

std::string OptionsToYaml(const Options& options) {
  YAML::Node root;
  for (const auto& f : ConfigFields()) {
    std::vector<std::string> parts = absl::StrSplit(f.key, '.');
    YAML::Node section = root[parts[0]];
    section[parts[1]] = f.get(options);
  }
  YAML::Emitter out;
  out << root;
  return std::string(out.c_str()) + "\n";
}

// Declared in kvcomp/service/daemon.h; defined here, beside --version, so that every program
// built from the configuration parser (kvcompd, the parser fuzzers) has it.
const char* Version() { return "0.1.0"; }

CommandLine ParseCommandLine(int argc, char** argv, std::string* out) {
  CommandLine cl;
  CLI::App app{
      "kvcompd: the kvcomp KV-cache compression daemon. Every option is also a YAML key (the "
      "flag without --) and an environment variable; precedence: defaults < --config file < "
      "environment < flags. See docs/configuration.md."};
  app.get_formatter()->column_width(52);
  app.add_option("--config", cl.config_file, "YAML configuration file [env KVCOMP_CONFIG]");
  app.add_flag("--print-config", cl.print_config,
               "Print the effective configuration as YAML and exit");
  app.set_version_flag("--version", absl::StrCat("kvcompd ", Version()),
                       "Print the version and exit");
  Options defaults;
  std::map<std::string, std::string> given;
  std::vector<std::pair<const ConfigField*, CLI::Option*>> opts;
  for (const auto& f : ConfigFields()) {
    std::string help = absl::StrCat(f.help, " [env ", f.env_var(), "]");
    CLI::Option* opt = app.add_option(f.flag(), given[f.key], help);
    opt->type_name(absl::AsciiStrToUpper(f.type));
    opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a later flag wins
    opts.emplace_back(&f, opt);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::ostringstream os, es;
    cl.exit_code = app.exit(e, os, es);
    *out = os.str() + es.str();
    cl.exit_now = true;
    return cl;
  }
  auto fail = [&](const absl::Status& s) {
    *out = "kvcompd: " + std::string(s.message()) + "\n";
    cl.exit_code = 2;
    cl.exit_now = true;
    return cl;
  };
  if (cl.config_file.empty()) {
    if (const char* c = std::getenv("KVCOMP_CONFIG"); c != nullptr) cl.config_file = c;
  }
  if (!cl.config_file.empty()) {
    if (absl::Status s = ApplyYamlFile(cl.options, cl.config_file); !s.ok()) return fail(s);
  }
  if (absl::Status s = ApplyEnvironment(cl.options); !s.ok()) return fail(s);
  for (const auto& [f, opt] : opts) {
    if (opt->count() == 0) continue;
    if (absl::Status s = f->set(cl.options, given[f->key]); !s.ok()) return fail(s);
  }
  if (absl::Status s = ValidateOptions(cl.options); !s.ok()) return fail(s);
  return cl;
}

}  // namespace service
}  // namespace kvcomp
