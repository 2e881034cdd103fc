#include "kvcomp/kernels/device_format.h"

#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/device_crc32c.h"
#include "env_switch.h"

#if defined(KVCOMP_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvcomp {
#if defined(KVCOMP_HAVE_CUDA)
namespace {

// Sections written from host fields (a few KB at most); the others come from device memory.
bool FromHost(uint32_t id) {
  return id == format::kHeads || id == format::kPolicy || id == format::kLayerRanks;
}

// The bytes of a section written from the host (FromHost).
absl::string_view HostSectionBytes(const CompressedCache& shape, const format::EncodingPlan& plan,
                                   uint32_t id) {
  auto bytes = [](const auto& v) {
    return absl::string_view(reinterpret_cast<const char*>(v.data()),
                             v.size() * sizeof(v[0]));
  };
  switch (id) {
    case format::kHeads:
      return bytes(shape.kept);
    case format::kPolicy:
      return plan.policy;
    case format::kLayerRanks:
      return bytes(shape.layer_rank);
    default:
      return {};
  }
}

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrFormat("EncodeOnDevice: %s: %s: %s", what, cudaGetErrorName(e),
                                          cudaGetErrorString(e));
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace
#endif

namespace {

// EncodeOnDevice; `in_place`, when set, is a buffer the sections may already sit in at their
// offsets (DeviceCompressedCache::encoding): used as the encoding when every device section is
// there, else the sections are copied into a fresh buffer as without it.
absl::StatusOr<DeviceEncodedCache> Encode(Backend& backend, const CompressedCache& shape,
                                          uint64_t raw_value_rows,
                                          absl::Span<const DeviceSection> sections,
                                          TransferBytes* transfers,
                                          const std::shared_ptr<const Buffer>& in_place,
                                          absl::Span<const DeviceCompressedCache::CrcPart> parts,
                                          const void* part_words) {
  if (backend.kind() != BackendKind::kCuda) {
    return absl::FailedPreconditionError("EncodeOnDevice needs a CUDA backend");
  }
#if !defined(KVCOMP_HAVE_CUDA)
  return absl::FailedPreconditionError("EncodeOnDevice: this build has no CUDA");
#else
  KVCOMP_ASSIGN_OR_RETURN(format::EncodingPlan plan, format::PlanEncoding(shape, raw_value_rows));
  const size_t n = plan.sections.size();
  std::vector<const DeviceSection*> source(n, nullptr);
  for (const DeviceSection& ds : sections) {
    size_t i = 0;
    while (i < n && plan.sections[i].id != ds.id) ++i;
    if (i == n || FromHost(ds.id)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "EncodeOnDevice: section %u is not one of this cache's device sections", ds.id));
    }
    if (source[i] != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("EncodeOnDevice: section %u given twice", ds.id));
    }
    if (ds.size < plan.sections[i].size || (ds.data == nullptr && plan.sections[i].size > 0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "EncodeOnDevice: section %u has %u bytes, the counts need %u", ds.id, ds.size,
          plan.sections[i].size));
    }
    source[i] = &ds;
  }
  for (size_t i = 0; i < n; ++i) {
    if (!FromHost(plan.sections[i].id) && source[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("EncodeOnDevice: section %u missing", plan.sections[i].id));
    }
  }

  // The sections already in place: each device section at its offset in `in_place`.
  bool placed = in_place != nullptr && in_place->size() >= plan.total_bytes;
  for (size_t i = 0; placed && i < n; ++i) {
    placed = source[i] == nullptr ||
             source[i]->data == in_place->as<uint8_t>() + plan.sections[i].offset;
  }
  Buffer out;
  if (placed) {
    out = Buffer::Part(in_place, 0, plan.total_bytes);
  } else {
    KVCOMP_ASSIGN_OR_RETURN(out, Buffer::Allocate(backend.allocator(), plan.total_bytes));
  }
  // Sections in place whose CRC parts were computed as they were written (and add up to them):
  // their CRCs are combined from the parts, not read again.
  std::vector<std::vector<size_t>> parts_of(n);  // indices into `parts`, in order
  if (placed && part_words != nullptr) {
    for (size_t i = 0; i < n; ++i) {
      if (source[i] == nullptr) continue;
      uint64_t covered = 0;
      for (size_t j = 0; j < parts.size(); ++j) {
        if (parts[j].section != plan.sections[i].id) continue;
        parts_of[i].push_back(j);
        covered += parts[j].size;
      }
      if (covered != plan.sections[i].size) parts_of[i].clear();
    }
  } else {
    parts = {};
  }
  KVCOMP_ASSIGN_OR_RETURN(
      Buffer words,
      Buffer::Allocate(backend.allocator(), (n + 1 + parts.size()) * sizeof(uint32_t)));
  auto stream = static_cast<cudaStream_t>(backend.native_stream());
  uint8_t* dev = out.as<uint8_t>();
  auto end_of = [&](size_t i) {
    return i + 1 < n ? plan.sections[i + 1].offset : plan.total_bytes;
  };
  // Device sections into place, their padding zeroed, their CRCs on the device. A section
  // already in its place is only read for its CRC; one whose place is aligned as its source
  // (the same address modulo 16, as the allocator's buffers and the plan's offsets make it) is
  // written by the CRC kernel as it reads it (one pass); any other is copied first and its copy
  // read for the CRC.
  std::vector<DeviceCrcRange> ranges;
  std::vector<size_t> ranged;  // plan index of each range
  for (size_t i = 0; i < n; ++i) {
    if (source[i] == nullptr) continue;
    const format::SectionSpan& s = plan.sections[i];
    uint8_t* place = dev + s.offset;
    // KVCOMP_FORMAT_ONE_PASS=0 copies every section first (for comparison).
    static const bool one_pass = internal::SwitchOn("KVCOMP_FORMAT_ONE_PASS");
    const bool there = source[i]->data == place;
    const bool fused = !there && one_pass && s.size > 0 &&
                       ((reinterpret_cast<uintptr_t>(place) -
                         reinterpret_cast<uintptr_t>(source[i]->data)) & 15) == 0;
    if (s.size > 0 && !fused && !there) {
      KVCOMP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(place, source[i]->data, s.size,
                                                  cudaMemcpyDeviceToDevice, stream),
                                  "section copy"));
    }
    const uint64_t pad = end_of(i) - (s.offset + s.size);
    if (pad > 0) {
      KVCOMP_RETURN_IF_ERROR(
          Cuda(cudaMemsetAsync(place + s.size, 0, pad, stream), "padding"));
    }
    if (!parts_of[i].empty()) continue;  // its CRC from its parts
    uint32_t* word = words.as<uint32_t>() + ranges.size();
    if (fused) {
      ranges.push_back({source[i]->data, s.size, word, place});
    } else {
      ranges.push_back({place, s.size, word});
    }
    ranged.push_back(i);
  }
  KVCOMP_RETURN_IF_ERROR(DeviceCrc32c(ranges, stream));
  // The parts' words after the ranges' (one read back for all).
  if (!parts.empty()) {
    KVCOMP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(words.as<uint32_t>() + ranges.size(), part_words,
                                                parts.size() * sizeof(uint32_t),
                                                cudaMemcpyDeviceToDevice, stream),
                                "CRC parts"));
  }
  const size_t read = ranges.size() + parts.size();
  std::vector<uint32_t> device_crcs(read);
  if (read > 0) {
    // Waits for the copies and the CRCs.
    KVCOMP_RETURN_IF_ERROR(
        backend.CopyToHost(device_crcs.data(), words.data(), read * sizeof(uint32_t)));
    if (transfers != nullptr) transfers->to_host += read * sizeof(uint32_t);
  }
  std::vector<uint32_t> crcs(n, 0);
  for (size_t r = 0; r < ranges.size(); ++r) crcs[ranged[r]] = device_crcs[r];
  for (size_t i = 0; i < n; ++i) {
    if (parts_of[i].empty()) continue;
    uint32_t c = 0;
    for (size_t j : parts_of[i]) {
      c = Crc32cCombine(c, device_crcs[ranges.size() + j], parts[j].size);
    }
    crcs[i] = c;
  }

  // The host region: header, table and the host sections before the first device section
  // (the kept counts and the policy), with their padding; host sections after it (the layer
  // ranks) go up on their own.
  size_t first_device = 0;
  while (first_device < n && source[first_device] == nullptr) ++first_device;
  const uint64_t region_end =
      first_device < n ? plan.sections[first_device].offset : plan.total_bytes;
  std::vector<uint8_t> region(region_end, 0);
  std::vector<std::pair<size_t, std::vector<uint8_t>>> later;  // plan index, padded bytes
  for (size_t i = 0; i < n; ++i) {
    if (source[i] != nullptr) continue;
    const format::SectionSpan& s = plan.sections[i];
    const absl::string_view b = HostSectionBytes(shape, plan, s.id);
    if (b.size() != s.size) {
      return absl::InternalError(absl::StrFormat(
          "EncodeOnDevice: host section %u has %u bytes, the plan %u", s.id, b.size(), s.size));
    }
    crcs[i] = Crc32c(b.data(), b.size());
    if (i < first_device) {
      if (!b.empty()) std::memcpy(region.data() + s.offset, b.data(), b.size());
    } else {
      std::vector<uint8_t> padded(end_of(i) - s.offset, 0);
      if (!b.empty()) std::memcpy(padded.data(), b.data(), b.size());
      later.emplace_back(i, std::move(padded));
    }
  }
  KVCOMP_RETURN_IF_ERROR(format::WriteHeaderAndTable(shape, plan, crcs, absl::MakeSpan(region)));
  KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(dev, region.data(), region.size()));
  uint64_t up = region.size();
  for (const auto& [i, padded] : later) {
    KVCOMP_RETURN_IF_ERROR(
        backend.CopyFromHost(dev + plan.sections[i].offset, padded.data(), padded.size()));
    up += padded.size();
  }
  if (transfers != nullptr) transfers->to_device += up;

  // The whole encoding's CRC from its parts: the host region, then each later section and the
  // zeros between them.
  uint32_t whole = Crc32c(region.data(), region.size());
  uint64_t at = region.size();
  for (size_t i = first_device; i < n; ++i) {
    const format::SectionSpan& s = plan.sections[i];
    if (s.offset > at) whole = Crc32cCombine(whole, Crc32cOfZeros(s.offset - at), s.offset - at);
    whole = Crc32cCombine(whole, crcs[i], s.size);
    at = s.offset + s.size;
  }
  if (plan.total_bytes > at) {
    whole = Crc32cCombine(whole, Crc32cOfZeros(plan.total_bytes - at), plan.total_bytes - at);
  }
  DeviceEncodedCache result;
  result.bytes = std::move(out);
  result.size = plan.total_bytes;
  result.crc32c = whole;
  result.header.assign(reinterpret_cast<const char*>(region.data()), plan.table_end());
  cudaPointerAttributes attr;
  KVCOMP_RETURN_IF_ERROR(
      Cuda(cudaPointerGetAttributes(&attr, result.bytes.data()), "the encoding's device"));
  result.device = attr.device;
  return result;
#endif
}

}  // namespace

absl::StatusOr<DeviceEncodedCache> EncodeOnDevice(Backend& backend, const CompressedCache& shape,
                                                  uint64_t raw_value_rows,
                                                  absl::Span<const DeviceSection> sections,
                                                  TransferBytes* transfers) {
  return Encode(backend, shape, raw_value_rows, sections, transfers, nullptr, {}, nullptr);
}

absl::StatusOr<DeviceEncodedCache> EncodeOnDevice(Backend& backend,
                                                  const DeviceCompressedCache& cache,
                                                  TransferBytes* transfers) {
  KVCOMP_ASSIGN_OR_RETURN(format::EncodingPlan plan,
                          format::PlanEncoding(cache.host, cache.raw_value_row_count));
  const std::pair<uint32_t, const Buffer*> all[] = {
      {format::kPositions, &cache.positions},
      {format::kKeys, &cache.keys},
      {format::kKeyScales, &cache.key_scales},
      {format::kValues, &cache.values},
      {format::kValueScales, &cache.value_scales},
      {format::kMomentCount, &cache.moment_count},
      {format::kMomentKeySum, &cache.moment_key_sum},
      {format::kMomentValueSum, &cache.moment_value_sum},
      {format::kMomentVkSum, &cache.moment_vk_sum},
      {format::kRawValueRows, &cache.raw_value_rows},
      {format::kRawValues, &cache.raw_values},
  };
  std::vector<DeviceSection> sections;
  for (const auto& [id, buffer] : all) {
    for (const format::SectionSpan& s : plan.sections) {
      if (s.id == id) sections.push_back({id, buffer->data(), buffer->size()});
    }
  }
  return Encode(backend, cache.host, cache.raw_value_row_count, sections, transfers,
                cache.encoding, cache.crc_parts, cache.crc_words.data());
}

}  // namespace kvcomp
