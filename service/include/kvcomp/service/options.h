// kvcompd's options: one plain struct, every field with its unit and default. The embedded
// defaults start a working daemon on a small machine with no GPU and no configuration: CPU
// backend (GPU when one is present), a host tier plus RocksDB under ./.kvcomp-data, listeners on
// localhost only, no tokens (open single-tenant mode).
//
// YAML keys, command-line flags and KVCOMP_* environment variables map onto these fields in
// exactly one place, the field table of kvcomp/service/config.h; docs/configuration.md lists
// every key. Precedence: defaults < YAML file < environment < flags.
#ifndef KVCOMP_SERVICE_OPTIONS_H_
#define KVCOMP_SERVICE_OPTIONS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvcomp/core/policy.h"

namespace kvcomp {
namespace service {

// UCX data plane (puts, gets, lookups of cache payloads).
struct DataPlaneOptions {
  std::string address = "127.0.0.1";  // listen address; 0.0.0.0 for all interfaces
  uint16_t port = 7470;               // UCX listener port; 0 = pick a free one (logged)
  // Largest cache a put may announce, in uncompressed bytes (K plus V). Default 16 GiB.
  uint64_t max_put_bytes = uint64_t{16} << 30;
  // Largest single block payload (K plus V of one block), bytes. Default 256 MiB.
  uint64_t max_block_bytes = uint64_t{256} << 20;
  // Bytes of blocks a connection may have in flight (received, not yet acknowledged);
  // beyond it a block gets busy (the transport's bound). Default 1 GiB.
  uint64_t max_inflight_bytes_per_connection = uint64_t{1} << 30;
  // A put with no block for this long is aborted and its blocks dropped, seconds. Default 60.
  double put_timeout_seconds = 60;
  // Bytes of received blocks held at once (all puts, until compressed or dropped), admitted
  // before their buffers are allocated; beyond it a block gets busy. Default 4 GiB.
  uint64_t max_buffered_bytes = uint64_t{4} << 30;
  // Puts open at once (all connections); beyond it a put-begin gets busy. 256.
  uint32_t max_open_puts = 256;
  // Share of max_buffered_bytes, max_open_puts, max_connections and engine.queue_capacity one
  // tenant may hold, in (0, 1]; 1 = no per-tenant bound. Default 0.5.
  double tenant_share = 0.5;
  // UCX endpoints at once. Default 1024.
  uint32_t max_connections = 1024;
  // Endpoints still waiting for their hello; a new one beyond it closes the oldest. Default 64.
  uint32_t max_pre_hello_connections = 64;
  // A connection without a hello this long after connecting is closed, seconds. Default 3.
  double hello_timeout_seconds = 3;
  // A connection with no message for this long is closed, seconds. Default 600.
  double idle_timeout_seconds = 600;
  // Free file descriptors below which the listener closes (reopening at twice as many); 0 =
  // never. Default 64.
  uint32_t fd_reserve = 64;
  // UCX transports for this daemon's context (UCX_TLS syntax, e.g. "tcp" or "posix,tcp"; UCX
  // needs tcp for connection set-up). Empty = UCX's own UCX_TLS environment or default. ""
  std::string ucx_tls;
  // UCX network devices (UCX_NET_DEVICES syntax, e.g. "mlx5_0:1"). Empty = UCX's choice. ""
  std::string ucx_net_devices;
  // On a UCX release before 1.14: "auto" makes UCX connections on the device they are made on
  // only (UCX_CM_USE_ALL_DEVICES=n), so that clients on UCX 1.14 or later connect, and clients of
  // earlier kvcomp releases on UCX before 1.14 do not; "defaults" keeps UCX's defaults, the reverse.
  // Clients of this release on UCX before 1.14 connect either way. No effect on UCX 1.14 or
  // later. docs/protocol.md, "UCX releases". "defaults"
  std::string ucx_interop = "defaults";
  // Same-host shared memory (docs/protocol.md, "Shared memory"): clients on this host move
  // put and get payloads through memory regions they map and pass over an abstract Unix
  // socket, instead of UCX. true
  bool shared_memory = true;
  // The largest region of a client the daemon maps, bytes (a get larger than a client's region
  // goes over UCX). Default 1 GiB.
  uint64_t shm_max_region_bytes = uint64_t{1} << 30;
  // Threads copying shared-memory payloads (blocks out of clients' memory, several at once; a
  // direct get split over them); 0 = one per 4 CPUs, 1 to 4. 0
  uint32_t shm_copy_lanes = 0;
  // GPU channel (docs/protocol.md): clients with KV in GPU memory send it over NCCL to the
  // engine's CUDA device when NCCL and a device are present. true
  bool gpu_channel = true;
  // Channels open at once (all tenants; a tenant its tenant_share of them). 64
  uint32_t gpu_max_channels = 64;
  // A channel's communicator forming, or one transfer, longer than this is aborted (the
  // channel closes), seconds. 30
  double gpu_transfer_timeout_seconds = 30;
  // A channel with no transfer for this long is closed, seconds; 0 = never. 600
  double gpu_idle_timeout_seconds = 600;
};

// Thrift control plane (health, stats, lookup, delete, policies, calibration, server info).
struct ControlPlaneOptions {
  std::string address = "127.0.0.1";  // listen address
  uint16_t port = 7471;               // Thrift port (framed binary protocol); 0 = pick a free one
  int io_threads = 1;                 // libevent I/O threads of the nonblocking server. 1
  int worker_threads = 4;             // threads running handlers. 4
  bool tls = false;                   // serve TLS instead of plain TCP. false
  std::string tls_cert_file;          // PEM certificate chain (required when tls)
  std::string tls_key_file;           // PEM private key (required when tls)
  std::string tls_ca_file;            // PEM CAs; when set, clients must present a certificate
  // Largest request frame the server reads, bytes; a larger one closes the connection before
  // anything is buffered or any credential checked. The largest control request is a
  // LookupPrefix or GetChunks of MAX_PREFIX_KEYS (1024) keys of at most 1 KiB: about 1 MiB.
  // Default 1280 KiB.
  uint64_t max_frame_bytes = uint64_t{1280} << 10;
  // Largest reply one call builds, bytes: a GetChunks reply stops before passing it (a first
  // cache larger than it is RESOURCE_EXHAUSTED: get it over the data plane). Default 64 MiB.
  uint64_t max_reply_bytes = uint64_t{64} << 20;
  // Reply bytes one tenant's calls hold at once (gathered and not yet serialized); a call that
  // would pass it is RESOURCE_EXHAUSTED, or truncated after its first cache. Default 128 MiB.
  uint64_t tenant_reply_bytes = uint64_t{128} << 20;
  // Open Thrift connections at once; a connection beyond it is closed on accept. Default 1024.
  uint32_t max_connections = 1024;
  // Connections no call has authenticated yet; a new one beyond it closes the oldest such
  // connection with no call running (those whose calls failed authentication first).
  // Default 256.
  uint32_t max_unauthenticated_connections = 256;
  // A connection on which no call has authenticated this long after it was accepted is closed,
  // whatever it sends, seconds. Default 10.
  double auth_timeout_seconds = 10;
  // Share of max_connections one tenant's authenticated connections may hold, in (0, 1]; 1 = no
  // per-tenant bound (always none in open mode). A call that would bind one more connection to
  // a tenant holding its share is RESOURCE_EXHAUSTED. Default 0.5.
  double tenant_share = 0.5;
  // Policies (models, plus its default) one tenant may hold; SetPolicy of a new one beyond it
  // is RESOURCE_EXHAUSTED. 0 = no bound. Default 1024.
  uint32_t max_policies_per_tenant = 1024;
  // SetPolicy calls per second one tenant may make (bursts of twice as many); beyond it
  // RESOURCE_EXHAUSTED. 0 = no bound. Default 50.
  double policy_updates_per_second = 50;
  // An authenticated connection with no authenticated call in progress and none completed for
  // this long is closed, seconds; 0 = never. Default 60.
  double idle_timeout_seconds = 60;
};

// Prometheus metrics and the Kubernetes probes (/metrics, /healthz, /readyz).
struct MetricsOptions {
  bool enabled = true;                // serve the HTTP endpoint. true
  std::string address = "127.0.0.1";  // listen address
  uint16_t port = 7472;               // HTTP port; 0 = pick a free one
};

// Tenants and their tokens.
struct AuthOptions {
  // File of `tenant: token` lines (YAML map) or a directory of one file per tenant (a mounted
  // Kubernetes secret). Empty path = open single-tenant daemon (every request is tenant
  // "default"). Once set, authentication is required: a source that is missing, unreadable or
  // holds no token stops the start, and keeps the previous tokens at a reload. Default "".
  std::string token_file;
  // How often the file's modification time is checked for a reload, seconds; SIGHUP reloads at
  // once. 0 = only on SIGHUP. Default 5.
  double reload_interval_seconds = 5;
};

// The compression engine and the ingest pipeline.
struct EngineOptions {
  std::string backend = "auto";  // auto (cuda when a GPU is present, else cpu), cpu or cuda
  int cuda_device = 0;           // CUDA device ordinal. 0
  // CUDA devices to run one engine each on, as a comma-separated list of ordinals ("0,1,2,3");
  // puts are spread over them. Empty = one engine on cuda_device. Each engine has its own
  // workers, uploader, gpu_memory_bytes cap and share of the GPU tier. Ignored on the CPU
  // (backend auto without a GPU); backend cpu with a list is an error. Default "".
  std::string cuda_devices;
  int cpu_threads = 0;           // threads of each CPU backend; 0 = hardware threads / workers
  int workers = 2;               // compression workers (each owns a backend). 2
  uint32_t queue_capacity = 16;  // committed puts waiting for a worker; full = busy. 16
  // The daemon's GPU memory budget (DeviceEnv): what puts hold (a put's K and V on the device
  // plus its compressed arrays), the links' receive and send buffers and the GPU tier's pool
  // (drawn whole at start; a larger pool stops the start). A put that would exceed it is refused
  // with RESOURCE_EXHAUSTED before any of its blocks is received. 0 = no cap (the device's own
  // memory is the limit). With several devices (cuda_devices) the budget is per device.
  // Default 0.
  uint64_t gpu_memory_bytes = 0;
};

// The tiered store (kvcomp/storage/options.h). RocksDB lives in <data_dir>/rocksdb, the
// daemon's own state (per-tenant policies) in <data_dir>/policies.yaml.
struct StorageOptions {
  std::string data_dir = "./.kvcomp-data";  // created when missing
  // When a put is acknowledged: "memory" (in its first tier; lost on restart), "disk" (in
  // RocksDB, synced; survives SIGKILL and power loss) or "behind" (in its first tier, then
  // written to RocksDB behind the put: a crash loses at most behind_max_bytes of acknowledged
  // puts, a clean shutdown none). Default disk.
  std::string durability = "disk";
  uint64_t behind_max_bytes = uint64_t{1} << 30;  // loss window of "behind". Default 1 GiB
  std::string put_tier = "host";       // tier a put lands in: device, host or rocksdb. host
  uint64_t device_capacity_bytes = 0;  // GPU tier, per engine device; 0 = no GPU tier. 0
  uint64_t host_capacity_bytes = uint64_t{1} << 30;      // host tier; 0 = none. Default 1 GiB
  bool rocksdb_enabled = true;                           // RocksDB tier on. Default true
  uint64_t rocksdb_capacity_bytes = uint64_t{64} << 30;  // RocksDB payload bytes. 64 GiB
  uint64_t rocksdb_reserve_bytes = uint64_t{64} << 20;   // free disk kept by writes. 64 MiB
  double high_watermark = 0.90;     // a tier above this fraction of capacity demotes. 0.90
  double low_watermark = 0.75;      // ... down to this fraction. 0.75
  bool promote_on_read = true;      // a get from RocksDB copies the cache into the host tier. true
  double ttl_seconds = 0;           // caches expire this long after their put; 0 = never
  uint64_t tenant_quota_bytes = 0;  // stored bytes per tenant; 0 = unlimited
  bool verify_checksums_on_open = true;  // check every RocksDB payload's CRC at start. true
  // How often expired caches are removed and projection versions that no stored cache names
  // (and that are not their model's latest) are deleted, seconds; 0 = never periodically (a
  // Delete or Calibrate still cleans up its own tenant/model at once). Default 60.
  double sweep_interval_seconds = 60;
};

// Process lifecycle and logging.
struct ProcessOptions {
  // On SIGTERM: seconds to finish in-flight puts and gets before flushing and exiting. 30
  double shutdown_grace_seconds = 30;
  std::string log_level = "info";  // debug, info, warning or error
  std::string log_format = "text";  // text (one line per event) or json (one object per line)
  // When set, written once the daemon is ready: a YAML map of the bound ports (data_port,
  // control_port, metrics_port) and the pid, for scripts and tests using port 0. Default "".
  std::string ready_file;
};

struct Options {
  DataPlaneOptions data_plane;
  ControlPlaneOptions control_plane;
  MetricsOptions metrics;
  AuthOptions auth;
  EngineOptions engine;
  StorageOptions storage;
  // The policy for tenants and models without one of their own (SetPolicy overrides it per
  // tenant and model). Defaults are CompressionPolicy's.
  CompressionPolicy default_policy;
  // default_policy.preset: a named preset (kvcomp::PolicyPreset) the policy starts from; the
  // default_policy.<field> keys given anywhere (file, environment, flags) override its fields,
  // whatever their order. Empty: CompressionPolicy's defaults.
  std::string default_policy_preset;
  // The default_policy.<field> keys given so far, by field name: what a preset set later keeps.
  std::vector<std::pair<std::string, std::string>> default_policy_fields;
  ProcessOptions process;
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_OPTIONS_H_
