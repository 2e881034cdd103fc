// Every metric kvcompd exports, by name. This header is the single list: the metrics code
// registers exactly these names, docs/metrics.md documents them, and the Helm chart's test parses
// this file (each `inline constexpr char kName[] = "kvcomp_...";` line) to check that dashboards
// and alert rules only use names kvcompd really exports. Names follow Prometheus' conventions
// (base units, `_total` for counters, `_bytes`, `_seconds`). Label names are listed with each
// metric and, as constants, at the end.
#ifndef KVCOMP_SERVICE_METRIC_NAMES_H_
#define KVCOMP_SERVICE_METRIC_NAMES_H_

namespace kvcomp {
namespace metric_names {

// --- traffic and memory saved ---
// Counter: payload bytes received on the data plane (K and V block bytes).
inline constexpr char kReceivedBytesTotal[] = "kvcomp_received_bytes_total";
// Counter: uncompressed bytes (K plus V) of every cache stored.
inline constexpr char kOriginalBytesTotal[] = "kvcomp_original_bytes_total";
// Counter: compressed bytes written to the store.
inline constexpr char kStoredBytesTotal[] = "kvcomp_stored_bytes_total";
// Counter: original minus stored bytes of every cache stored.
inline constexpr char kSavedBytesTotal[] = "kvcomp_saved_bytes_total";
// Gauge: original minus stored bytes over the caches currently stored. ("resident": a gauge may
// not share the name of the counter kvcomp_saved_bytes_total under OpenMetrics rules.)
inline constexpr char kResidentSavedBytes[] = "kvcomp_resident_saved_bytes";
// Gauge: uncompressed bytes of the caches currently stored.
inline constexpr char kResidentOriginalBytes[] = "kvcomp_resident_original_bytes";
// Gauge: caches currently stored.
inline constexpr char kCachesStored[] = "kvcomp_caches_stored";
// Histogram: original/stored bytes of each cache stored.
inline constexpr char kCompressionRatio[] = "kvcomp_compression_ratio";
// Counter: bytes served to clients on the data plane (gets).
inline constexpr char kServedBytesTotal[] = "kvcomp_served_bytes_total";

// --- tiers, label {tier} = device | host | rocksdb (storage::TierName) ---
inline constexpr char kTierStoredBytes[] = "kvcomp_tier_stored_bytes";        // gauge
inline constexpr char kTierCapacityBytes[] = "kvcomp_tier_capacity_bytes";    // gauge
inline constexpr char kTierEntries[] = "kvcomp_tier_entries";                 // gauge
inline constexpr char kTierDemotionsTotal[] = "kvcomp_tier_demotions_total";  // counter
inline constexpr char kTierEvictionsTotal[] = "kvcomp_tier_evictions_total";  // counter
// Gauge: 1 while the RocksDB tier is read-only because its disk was full (it reopens read-write
// by itself once there is room), else 0.
inline constexpr char kStoreReadOnly[] = "kvcomp_store_read_only";
// Gauge: free bytes of the RocksDB tier's filesystem.
inline constexpr char kDiskFreeBytes[] = "kvcomp_disk_free_bytes";
// Gauge: storage.rocksdb_reserve_bytes; a put that would leave fewer free bytes is refused
// (RESOURCE_EXHAUSTED, disk full).
inline constexpr char kDiskReserveBytes[] = "kvcomp_disk_reserve_bytes";
// Counter: caches the store found damaged and moved to the quarantine (never served again):
// a checksum that failed, or bytes that could not be read, at start, on a read, in the check of
// recovered caches or in a repair pass.
inline constexpr char kStoreQuarantinedTotal[] = "kvcomp_store_quarantined_total";
// Counter: RocksDB background work (a compaction) that met damaged data, such as a flipped byte
// in a blob file; writes go on and each one starts a repair pass.
inline constexpr char kStoreCorruptionsTotal[] = "kvcomp_store_corruptions_total";
// Counter: repair passes (every payload read, the damaged ones quarantined).
inline constexpr char kStoreRepairsTotal[] = "kvcomp_store_repairs_total";

// --- hits and misses ---
// Counter, labels {op, result, tenant, model_class}: reads of caches by outcome, where
// {op} = get | lookup | prefix_lookup | chunk_get and {result} = hit | partial | miss.
// get: a data-plane get, and each cache a chunk get reads; lookup: a data-plane lookup;
// prefix_lookup: a control-plane LookupPrefix; chunk_get: a control-plane GetChunks. hit: every
// key asked for is held; partial: some leading keys are (prefix lookups and chunk gets only);
// miss: none. Requests that failed are errors (kvcomp_errors_total), not reads.
// {tenant} and {model_class} are bounded: the first kMaxLabelTenants tenants and the first
// kMaxLabelModelClasses model ids the process sees keep their own value, later ones read "other".
inline constexpr char kCacheRequestsTotal[] = "kvcomp_cache_requests_total";
// Counter, labels {op, result, tenant, model_class}: the keys of prefix lookups and chunk gets
// by outcome, {result} = held | missing (every key after the first missing one counts missing).
inline constexpr char kPrefixKeysTotal[] = "kvcomp_prefix_keys_total";
inline constexpr int kMaxLabelTenants = 64;
inline constexpr int kMaxLabelModelClasses = 32;

// --- latency ---
// Histogram, label {op} = put | get | lookup | delete: one request end to end in the daemon.
inline constexpr char kOperationDurationSeconds[] = "kvcomp_operation_duration_seconds";
// Histogram, label {stage} = receive | compress | download | store | serve.
inline constexpr char kStageDurationSeconds[] = "kvcomp_stage_duration_seconds";

// --- pipeline and errors ---
// Gauge: puts waiting in the ingest queue or being compressed.
inline constexpr char kQueueDepth[] = "kvcomp_queue_depth";
// --- engines: one per GPU (engine.cuda_devices), or the CPU engine; label {device} is the CUDA
// device ordinal ("0", "1", ...) or "cpu" ---
// Gauge: committed puts waiting for or in compression on one engine (kvcomp_queue_depth is
// their sum).
inline constexpr char kEngineQueueDepth[] = "kvcomp_engine_queue_depth";
// Gauge, labels {device, drawer}: GPU memory the daemon holds on one GPU engine's device, drawn
// from its budget (the DeviceEnv) by puts (their K and V, compressed arrays: the engines'
// reservations) or links (the data plane's and GPU channels' receive and send buffers); puts go
// to the engine with the most room left.
inline constexpr char kDeviceMemoryBytes[] = "kvcomp_device_memory_bytes";
// Gauge: the budget of one GPU engine's device, engine.gpu_memory_bytes (0 = none).
inline constexpr char kDeviceMemoryBudgetBytes[] = "kvcomp_device_memory_budget_bytes";
// Gauge: 1 once the engine has failed (a sticky device error: the daemon drains and exits),
// else 0.
inline constexpr char kEngineFailed[] = "kvcomp_engine_failed";
// Gauge: puts begun and not yet committed or aborted (receiving blocks).
inline constexpr char kPutsInProgress[] = "kvcomp_puts_in_progress";
// Counter, labels {op, code}: requests that failed, code = the status code in snake case
// (invalid_argument, not_found, unavailable, busy, data_loss, unauthenticated, ...). A get or
// lookup of a cache that is not stored is a miss (kvcomp_cache_requests_total), not an error;
// {op} = put | get | lookup | delete | transport, where transport counts the errors the UCX
// transport answered itself before any handler (malformed frames and bodies, checksum
// mismatches, blocks of wrong or oversized sizes or for puts not open, requests before hello,
// busy for the per-connection in-flight bound).
inline constexpr char kErrorsTotal[] = "kvcomp_errors_total";
// Counter, label {plane} = data | control: requests refused for a missing or wrong token or a
// tenant mismatch.
inline constexpr char kAuthFailuresTotal[] = "kvcomp_auth_failures_total";
// Gauge: 1 when a token source is configured and every request needs a tenant's token, 0 in
// open single-tenant mode (no auth.token_file).
inline constexpr char kAuthRequired[] = "kvcomp_auth_required";
// Counter: token reloads refused (source missing, unreadable, empty, comments only or
// malformed); the previous tokens stayed in force.
inline constexpr char kAuthReloadFailuresTotal[] = "kvcomp_auth_reload_failures_total";
// Gauge: open Thrift control-plane connections.
inline constexpr char kControlConnections[] = "kvcomp_control_connections";
// Counter, label {reason} = limit | idle: control-plane connections the daemon closed, at
// accept for control_plane.max_connections or after control_plane.idle_timeout_seconds idle.
inline constexpr char kControlConnectionsClosedTotal[] = "kvcomp_control_connections_closed_total";
// Gauge: KVSplice projection versions stored (every tenant and model).
inline constexpr char kProjections[] = "kvcomp_projections";
// Counter: projection versions deleted because no stored cache named them any more and a newer
// calibration of their tenant/model exists.
inline constexpr char kProjectionsDeletedTotal[] = "kvcomp_projections_deleted_total";
// Gauge: pq calibrations stored (the calibrated basis codec's bases, every tenant, model and bit
// budget).
inline constexpr char kPqCalibrations[] = "kvcomp_pq_calibrations";
// Counter: seconds of GPU work spent compressing and decoding (0 without a GPU).
inline constexpr char kGpuSecondsTotal[] = "kvcomp_gpu_seconds_total";
// Counter: bytes the data path copied from host memory to the GPU (a put's blocks staged once,
// a cache placed in the GPU tier; 0 without a GPU).
inline constexpr char kH2dBytesTotal[] = "kvcomp_h2d_bytes_total";
// Counter: bytes the data path copied from the GPU to host memory (a compressed cache on its
// way to the store, a get served from the GPU tier; 0 without a GPU).
inline constexpr char kD2hBytesTotal[] = "kvcomp_d2h_bytes_total";
// Gauge: 1 when the data plane's UCX sends and receives CUDA device memory itself (cuda_copy /
// cuda_ipc: clients' device payloads go straight to the GPU), 0 when device memory is staged
// through host memory.
inline constexpr char kDataPlaneCudaMemory[] = "kvcomp_data_plane_cuda_memory";
// Counter: data-plane blocks received straight into GPU memory (device payloads of clients).
inline constexpr char kBlocksIntoDeviceTotal[] = "kvcomp_data_plane_blocks_into_device_total";

// --- process ---
// Gauge: 1 when the daemon takes new work (stores open, listeners up, not draining), else 0.
inline constexpr char kReady[] = "kvcomp_ready";
// Gauge, always 1, label {version, backend}.
inline constexpr char kBuildInfo[] = "kvcomp_build_info";

// --- label names ---
inline constexpr char kLabelTier[] = "tier";
inline constexpr char kLabelOp[] = "op";
inline constexpr char kLabelStage[] = "stage";
inline constexpr char kLabelCode[] = "code";
inline constexpr char kLabelPlane[] = "plane";
inline constexpr char kLabelReason[] = "reason";
inline constexpr char kLabelVersion[] = "version";
inline constexpr char kLabelBackend[] = "backend";
inline constexpr char kLabelDevice[] = "device";
inline constexpr char kLabelDrawer[] = "drawer";
inline constexpr char kLabelResult[] = "result";
inline constexpr char kLabelTenant[] = "tenant";
inline constexpr char kLabelModelClass[] = "model_class";

}  // namespace metric_names
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_METRIC_NAMES_H_
