// The Hadamard codec's entropy-coded stream (kvcomp/codecs/hq_stream.h): zstd over the codes taken
// one per byte, the records' minimum and step kept raw.
#include "kvcomp/codecs/hq_stream.h"

#include <zstd.h>

#include <cstring>

#include "absl/strings/str_format.h"
#include "kvcomp/codecs/hq.h"

namespace kvcomp {
namespace hq {
namespace {

void PutU16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t GetU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

// Code i of a record's LSB-first bit stream.
uint8_t CodeAt(const uint8_t* packed, uint32_t i, uint32_t bits) {
  const uint64_t bit = uint64_t{i} * bits;
  uint32_t word = packed[bit / 8];
  if ((bit % 8) + bits > 8) word |= uint32_t{packed[bit / 8 + 1]} << 8;
  return static_cast<uint8_t>((word >> (bit % 8)) & ((1u << bits) - 1));
}
void PutCode(uint8_t* packed, uint32_t i, uint32_t bits, uint8_t code) {
  const uint64_t bit = uint64_t{i} * bits;
  const uint32_t v = uint32_t{code} << (bit % 8);
  packed[bit / 8] |= static_cast<uint8_t>(v);
  if ((bit % 8) + bits > 8) packed[bit / 8 + 1] |= static_cast<uint8_t>(v >> 8);
}

absl::Status Malformed(const std::string& what) {
  return absl::InvalidArgumentError("hq stream: " + what);
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> PackStream(const uint8_t* records, uint64_t rows, uint32_t d,
                                                uint32_t bits, int zstd_level) {
  if (auto s = CheckHeadDim(d); !s.ok()) return s;
  if (auto s = CheckBits(bits); !s.ok()) return s;
  if (zstd_level < 1 || zstd_level > 19) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hq stream: zstd level %d, not in [1, 19]", zstd_level));
  }
  if (rows > 0 && records == nullptr) return absl::InvalidArgumentError("hq stream: no records");
  const uint64_t rec = RowBytes(bits, d);
  const uint64_t code_bytes = uint64_t{d} * bits / 8;
  if (rows > (uint64_t{1} << 40) / rec)
    return absl::InvalidArgumentError("hq stream: too many rows");

  std::vector<uint8_t> side(4 * rows);
  std::vector<uint8_t> packed(code_bytes * rows);
  std::vector<uint8_t> plane(uint64_t{d} * rows);
  for (uint64_t r = 0; r < rows; ++r) {
    const uint8_t* in = records + r * rec;
    if (auto s = CheckRecord(in); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("hq stream: record %u: %s", r, s.message()));
    }
    std::memcpy(&side[4 * r], in, 4);
    std::memcpy(&packed[code_bytes * r], in + 4, code_bytes);
    for (uint32_t i = 0; i < d; ++i) plane[uint64_t{d} * r + i] = CodeAt(in + 4, i, bits);
  }

  std::vector<uint8_t> z(ZSTD_compressBound(plane.size()));
  const size_t zn = ZSTD_compress(z.data(), z.size(), plane.data(), plane.size(), zstd_level);
  if (ZSTD_isError(zn)) {
    return absl::InternalError(absl::StrFormat("hq stream: zstd: %s", ZSTD_getErrorName(zn)));
  }
  const bool use_zstd = zn < packed.size();
  const std::vector<uint8_t>& payload = use_zstd ? z : packed;
  const uint64_t pbytes = use_zstd ? zn : packed.size();

  std::vector<uint8_t> out(kStreamHeaderBytes + side.size() + 8 + pbytes, 0);
  std::memcpy(out.data(), kStreamMagic, 4);
  out[4] = kStreamVersion;
  out[5] = static_cast<uint8_t>(bits);
  PutU16(&out[6], static_cast<uint16_t>(d));
  PutU64(&out[8], rows);
  out[16] = static_cast<uint8_t>(use_zstd ? StreamMode::kZstd : StreamMode::kPacked);
  if (!side.empty()) std::memcpy(&out[kStreamHeaderBytes], side.data(), side.size());
  PutU64(&out[kStreamHeaderBytes + side.size()], pbytes);
  if (pbytes) std::memcpy(&out[kStreamHeaderBytes + side.size() + 8], payload.data(), pbytes);
  return out;
}

absl::StatusOr<StreamInfo> ReadStreamHeader(const uint8_t* stream, size_t size) {
  if (stream == nullptr || size < kStreamHeaderBytes + 8) return Malformed("shorter than a header");
  if (std::memcmp(stream, kStreamMagic, 4) != 0) return Malformed("not a KVHZ stream");
  if (stream[4] != kStreamVersion) {
    return Malformed(
        absl::StrFormat("format version %u, this reader knows %u", stream[4], kStreamVersion));
  }
  StreamInfo info;
  info.bits = stream[5];
  info.head_dim = GetU16(stream + 6);
  info.rows = GetU64(stream + 8);
  if (auto s = CheckBits(info.bits); !s.ok()) return Malformed(std::string(s.message()));
  if (auto s = CheckHeadDim(info.head_dim); !s.ok()) return Malformed(std::string(s.message()));
  if (stream[16] > 1) return Malformed(absl::StrFormat("mode %u", stream[16]));
  info.mode = static_cast<StreamMode>(stream[16]);
  if (stream[17] || stream[18] || stream[19]) return Malformed("reserved bytes are not zero");
  if (info.rows > (size - kStreamHeaderBytes - 8) / 4) return Malformed("rows beyond the stream");
  const uint64_t at = kStreamHeaderBytes + 4 * info.rows;
  info.payload_bytes = GetU64(stream + at);
  if (info.payload_bytes != size - at - 8) {
    return Malformed(absl::StrFormat("payload of %u bytes in a stream with %u after the side data",
                                     info.payload_bytes, size - at - 8));
  }
  const uint64_t code_bytes = uint64_t{info.head_dim} * info.bits / 8;
  if (info.mode == StreamMode::kPacked && info.payload_bytes != code_bytes * info.rows) {
    return Malformed("packed payload size does not match the rows");
  }
  return info;
}

absl::StatusOr<StreamInfo> UnpackStream(const uint8_t* stream, size_t size,
                                        std::vector<uint8_t>* records) {
  auto info = ReadStreamHeader(stream, size);
  if (!info.ok()) return info.status();
  const uint32_t d = info->head_dim, bits = info->bits;
  const uint64_t rows = info->rows, rec = RowBytes(bits, d), code_bytes = uint64_t{d} * bits / 8;
  const uint8_t* side = stream + kStreamHeaderBytes;
  const uint8_t* payload = side + 4 * rows + 8;
  records->assign(rows * rec, 0);
  for (uint64_t r = 0; r < rows; ++r) {
    if (auto s = CheckRecord(side + 4 * r); !s.ok()) {
      return Malformed(absl::StrFormat("row %u: %s", r, s.message()));
    }
    std::memcpy(records->data() + r * rec, side + 4 * r, 4);
  }
  if (info->mode == StreamMode::kPacked) {
    for (uint64_t r = 0; r < rows; ++r) {
      std::memcpy(records->data() + r * rec + 4, payload + r * code_bytes, code_bytes);
    }
    return info;
  }
  const unsigned long long content = ZSTD_getFrameContentSize(payload, info->payload_bytes);
  if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN ||
      content != uint64_t{d} * rows) {
    return Malformed("zstd frame without a content size of rows x head_dim");
  }
  std::vector<uint8_t> plane(content);
  const size_t n = ZSTD_decompress(plane.data(), plane.size(), payload, info->payload_bytes);
  if (ZSTD_isError(n) || n != plane.size()) {
    return Malformed(
        absl::StrFormat("zstd: %s", ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short frame"));
  }
  const uint8_t limit = static_cast<uint8_t>(1u << bits);
  for (uint64_t r = 0; r < rows; ++r) {
    uint8_t* packed = records->data() + r * rec + 4;
    for (uint32_t i = 0; i < d; ++i) {
      const uint8_t c = plane[uint64_t{d} * r + i];
      if (c >= limit) {
        return Malformed(absl::StrFormat("row %u code %u is %u, not below 2^%u", r, i, c, bits));
      }
      PutCode(packed, i, bits, c);
    }
  }
  return info;
}

}  // namespace hq
}  // namespace kvcomp
