// The cache format (docs/format.md, kvcomp/core/format.h) written on the device: the exact bytes
// format::EncodeCache gives for the same cache, in one device buffer, from sections that are
// already in device memory. Nothing of the sections crosses to the host:
//   - the plan (every section's offset and size) comes from the host fields and counts
//     (format::PlanEncoding, the layout the host encoder uses too);
//   - the sections held in device memory are written into their offsets by the CRC32C kernel as
//     it reads them (kvcomp/kernels/device_crc32c.h: one pass over each section; one whose place
//     is not aligned as its source is copied first and the copy read) and the padding between
//     them zeroed there;
//   - the host-side parts (header, section table, the kept counts, the policy records and the
//     per-layer ranks, all a few KB) are written on the host with the section CRCs read back
//     (4 bytes a section) and uploaded; the CRC32C of the whole encoding is combined on the host
//     from the sections' CRCs (Crc32cCombine), not read again.
// These control bytes are counted in TransferBytes like any other (docs/engine.md).
// A device compression that already wrote its sections at their offsets in the format's buffer
// (DeviceCompressedCache::encoding: eviction with raw codecs) is not copied at all: the header,
// the host sections and the padding are written around the sections in place, and the sections'
// CRCs are read from them or combined from the parts computed while they were written
// (DeviceCompressedCache::crc_parts); the encoding then shares that buffer.
//
// Thread-safety: as the Backend (one caller at a time per backend).
#ifndef KVCOMP_KERNELS_DEVICE_FORMAT_H_
#define KVCOMP_KERNELS_DEVICE_FORMAT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"

namespace kvcomp {

// An encoded cache in device memory.
struct DeviceEncodedCache {
  Buffer bytes;       // the backend's device memory; the first `size` bytes are the encoding
  uint64_t size = 0;  // bytes of the encoding (format::CacheInfo::total_bytes)
  uint32_t crc32c = 0;  // Crc32c of those bytes, as the host would compute it
  std::string header;   // a host copy of the header and section table (bytes [0, table end))
  int device = 0;       // the CUDA device holding `bytes`
};

// One section's bytes in device memory (of the backend's device): at least `size` bytes at
// `data`, where `size` is at least what the plan gives the section (the rest is ignored).
struct DeviceSection {
  uint32_t id = 0;  // format::SectionId
  const void* data = nullptr;
  uint64_t size = 0;
};

// Encodes a cache whose header fields, policy, kept counts and layer ranks are `shape`'s and
// whose other sections are `sections` (one per section the plan has besides the kept counts,
// the policy and the layer ranks; `raw_value_rows` KVSplice outlier rows). Runs on the
// backend's stream and returns when the bytes are complete. Adds the bytes it copies between
// host and device to `transfers` (the header region and layer ranks up, the section CRCs down).
// FailedPrecondition on a host backend; InvalidArgument when `shape` fails format::PlanEncoding
// or a section is missing, repeated or short; ResourceExhausted without device memory for it.
absl::StatusOr<DeviceEncodedCache> EncodeOnDevice(Backend& backend, const CompressedCache& shape,
                                                  uint64_t raw_value_rows,
                                                  absl::Span<const DeviceSection> sections,
                                                  TransferBytes* transfers = nullptr);

// The same for a device compression's result (CompressToDevice, kvcomp/kernels/pipeline.h):
// `cache.host` is the shape, its buffers the device sections. Run it on the backend whose
// allocator holds the buffers (its stream orders this after the compression's work). When
// `cache.encoding` holds the sections in place, the result's bytes are a part of that buffer
// (Buffer::Part): it stays allocated while either holds it.
absl::StatusOr<DeviceEncodedCache> EncodeOnDevice(Backend& backend,
                                                  const DeviceCompressedCache& cache,
                                                  TransferBytes* transfers = nullptr);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_DEVICE_FORMAT_H_
