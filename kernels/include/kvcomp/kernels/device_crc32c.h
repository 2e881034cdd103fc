// CRC32C (Castagnoli) of device memory, computed on the device: the same value Crc32c()
// (kvcomp/core/crc32c.h, the CPU twin) gives for the same bytes on the host, without copying them
// there. The cache format's section checksums of a cache encoded on the device and the checksum
// the store keeps for it are computed with it (docs/protocol.md, "Checksums of device data").
//
// How: a CRC register is linear over GF(2) in its start value and its input, so the CRC of a
// buffer is the XOR of each chunk's CRC (register started at 0) shifted by the bytes that follow
// the chunk, where shifting by n bytes is a multiplication by x^(8n) modulo the polynomial. Each
// thread takes one 512-byte chunk (table lookups in shared memory: slicing-by-4 tables with a
// copy per lane in its own bank for calls of a block per multiprocessor or more, slicing-by-16
// tables below), a block folds its chunks with one multiplication per thread and per warp, and
// each block adds its part to the result with an atomic XOR. That arithmetic on the CPU
// (Crc32cCombine, Crc32cOfZeros, Crc32cShift, for combining CRCs of pieces) is in
// kvcomp/core/crc32c.h.
//
// Thread-safety: reentrant; the device calls are ordered on the stream given.
#ifndef KVCOMP_KERNELS_DEVICE_CRC32C_H_
#define KVCOMP_KERNELS_DEVICE_CRC32C_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcomp/core/crc32c.h"

namespace kvcomp {

// One range of device memory and where its CRC32C goes.
struct DeviceCrcRange {
  const void* data = nullptr;  // device memory; any alignment
  uint64_t size = 0;           // bytes; 0 gives CRC 0
  uint32_t* crc = nullptr;     // device memory, 4-byte aligned: receives Crc32c(data, size)
  // Optional: device memory the range's bytes are also written to in the same pass, as a copy
  // would (one read of the bytes for both). Its address must equal `data`'s modulo 16, and it
  // must not overlap any range or crc word of the call.
  void* copy_to = nullptr;
};

// Enqueues on `stream` (a cudaStream_t of the current device, nullptr = the legacy default
// stream) the CRC32C of every range into its `crc` word: a small kernel first sets each word,
// then the CRC kernel adds each block's part with atomic XORs, so a word is final only when the
// stream reaches the end of this call's work (read it after a synchronisation or in stream
// order). `crc` words must not overlap any range nor each other. Returns once enqueued.
// InvalidArgument for a null pointer with a non-zero size, a null or misaligned `crc` or a
// `copy_to` not aligned as its range;
// FailedPrecondition in a build without CUDA; Internal for a failed launch.
absl::Status DeviceCrc32c(absl::Span<const DeviceCrcRange> ranges, void* stream);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_DEVICE_CRC32C_H_
