// What the benchmarks of the SDK's device calls against a kvcompd share (bench/cuda_ucx,
// bench/gpu_channel): the per-layer views of a cache held as K of every layer then V of every
// layer, the lossless put, a transfer timed on a CUDA stream, and a line of the daemon's log.
#ifndef KVCOMP_BENCH_COMMON_SDK_DEVICE_BENCH_H_
#define KVCOMP_BENCH_COMMON_SDK_DEVICE_BENCH_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/bench_util.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/transport/gpu_link.h"

namespace kvcomp {
namespace bench {

// Views of a cache in device memory laid out [K: layer][V: layer], each layer [head][token][dim]:
// `in` over the source to put, `out` over the buffer a dense get writes.
struct DeviceLayers {
  std::vector<client::DeviceLayerData> in;
  std::vector<client::DeviceLayerOut> out;
};

inline DeviceLayers SplitLayers(void* src, void* back, const KvLayout& layout, uint64_t tokens) {
  const size_t layer = layout.LayerBytes(tokens);
  DeviceLayers d;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    d.in.push_back({static_cast<char*>(src) + l * layer,
                    static_cast<char*>(src) + (layout.num_layers + l) * layer});
    d.out.push_back({static_cast<char*>(back) + l * layer,
                     static_cast<char*>(back) + (layout.num_layers + l) * layer});
  }
  return d;
}

// A put that keeps every token and stores the raw K and V (ratio 0, no moments, raw codecs): a
// dense get returns the bytes put.
inline client::PutOptions LosslessPut() {
  client::PutOptions o;
  o.policy = CompressionPolicy();
  o.policy->ratio = 0;
  o.policy->moments = false;
  return o;
}

// Seconds on `stream` (a GpuRuntime timer around it) of each of `reps` + 1 calls of `enqueue`,
// the first left out (it warms up); exits when a call fails.
inline std::vector<double> StreamSeconds(transport::GpuRuntime& rt, void* stream, int reps,
                                         const std::function<absl::Status()>& enqueue,
                                         const char* what) {
  auto timer = ValueOrExit(rt.NewTimer(), "timer");
  std::vector<double> secs;
  for (int r = 0; r < reps + 1; ++r) {
    KVCOMP_BENCH_CHECK_OK(timer->Start(stream));
    KVCOMP_BENCH_CHECK_OK(enqueue());
    KVCOMP_BENCH_CHECK_OK(timer->Stop(stream));
    const double s = ValueOrExit(timer->Seconds(absl::Now() + absl::Seconds(60)), what);
    if (r > 0) secs.push_back(s);
  }
  return secs;
}

// The line of `log` from the first `what` to its end, or `absent` when `what` is not there.
inline std::string LogLine(const std::string& log, const std::string& what,
                           const std::string& absent) {
  const size_t at = log.find(what);
  return at == std::string::npos ? absent : log.substr(at, log.find('\n', at) - at);
}

}  // namespace bench
}  // namespace kvcomp

#endif  // KVCOMP_BENCH_COMMON_SDK_DEVICE_BENCH_H_
