// The codec stage of a device compression (pipeline_stages.cc: DeviceCodecStage), the parts
// that are not CodecOps: KVSplice's outlier rows picked on the device. Built only with CUDA.
#ifndef KVCOMP_KERNELS_SRC_CUDA_CODEC_DEVICE_H_
#define KVCOMP_KERNELS_SRC_CUDA_CODEC_DEVICE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvcomp/kernels/allocator.h"

namespace kvcomp {
namespace codec_device {

// KVSplice's outlier rule (kvsplice_internal: per head at most OutlierCap(kept, fraction) rows
// whose `lost` exceeds max(kOutlierFloor x median energy, factor x median lost), the worst
// first, ties by lower row) over device arrays: `energy` and `lost` (f32, one per row, device)
// of the heads whose rows are [offsets[h], offsets[h + 1]) (host, prefix sums). Writes the
// chosen rows, ascending (u64), and their `row_bytes` bytes from `values` (device) into fresh
// buffers of `allocator`, in `stream`'s order; *count receives their number, the one value read
// back (the host waits for the stream there).
absl::Status PickRawValueRows(void* stream, Allocator& allocator, const float* energy,
                              const float* lost, const std::vector<uint64_t>& offsets,
                              double fraction, double factor, const void* values,
                              uint64_t row_bytes, Buffer* rows, Buffer* raw_values,
                              uint64_t* count);

}  // namespace codec_device
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_CODEC_DEVICE_H_
