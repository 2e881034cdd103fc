// An entropy-coded stream of the Hadamard codec's row records (kvcomp/codecs/hq.h): the same rows,
// byte for byte, in fewer bytes. Each record's f16 minimum and step are kept as they are; the
// codes are taken one per byte (row after row) and compressed with zstd, or left packed as in the
// records when zstd does not make them smaller. Unpacking gives back the records bit-identically.
//
// Stream, format version 1 (all integers little-endian):
//   offset  bytes      field
//   0       4          magic "KVHZ"
//   4       1          version (1)
//   5       1          bits of the codes (2, 3 or 4)
//   6       2          head_dim d (a power of two in [8, 256])
//   8       8          rows
//   16      1          mode: 0 = the codes packed as in the records (rows x d * bits / 8 bytes,
//                      each row's bit stream as in its record), 1 = one zstd frame whose content
//                      is rows x d bytes, one code per byte (each < 2^bits), with its content
//                      size in the frame header
//   17      3          zero
//   20      4 x rows   per row: u16 f16 minimum, u16 f16 step (the record's first 4 bytes)
//   20+4r   8          payload bytes P
//   28+4r   P          payload
// The stream ends with its payload (no trailing bytes). A reader refuses another magic or version,
// a mode other than 0 or 1, nonzero reserved bytes, sizes that do not add up, a frame whose
// content size is not rows x d, a code >= 2^bits, and a record pair that hq::CheckRecord refuses.
//
// What it reaches on real caches: docs/research.md ("Entropy coding of the codes").
#ifndef KVCOMP_CODECS_HQ_STREAM_H_
#define KVCOMP_CODECS_HQ_STREAM_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcomp {
namespace hq {

inline constexpr uint8_t kStreamVersion = 1;
inline constexpr char kStreamMagic[4] = {'K', 'V', 'H', 'Z'};
inline constexpr uint64_t kStreamHeaderBytes = 20;

enum class StreamMode : uint8_t { kPacked = 0, kZstd = 1 };

struct StreamInfo {
  uint32_t bits = 0;
  uint32_t head_dim = 0;
  uint64_t rows = 0;
  StreamMode mode = StreamMode::kPacked;
  uint64_t payload_bytes = 0;
};

// `rows` records of RowBytes(bits, d) bytes at `records` into a stream. zstd_level: 1..19. The
// smaller of the two modes is chosen (packed on a tie). Low levels (1, 3) do not reach the codes'
// order-0 entropy on keys (their short matches cost more than they save): at 3 bits zstd -3
// stores more than the packed codes, zstd -19 2.50-2.57 bits per code against an entropy of
// 2.57-2.58 (bench/results/frontier-cpu-*-zstd-levels.md), at about 2 MB/s per core.
// InvalidArgument for a bad d or width, a record hq::CheckRecord refuses, or a level out of range.
absl::StatusOr<std::vector<uint8_t>> PackStream(const uint8_t* records, uint64_t rows, uint32_t d,
                                                uint32_t bits, int zstd_level = 19);

// The header of a stream (checks the header and that the sizes add up to `size`, not the payload).
absl::StatusOr<StreamInfo> ReadStreamHeader(const uint8_t* stream, size_t size);

// The stream back into its records (rows x RowBytes(bits, d) bytes, resized), bit-identical to
// what PackStream was given. InvalidArgument for a damaged or malformed stream.
absl::StatusOr<StreamInfo> UnpackStream(const uint8_t* stream, size_t size,
                                        std::vector<uint8_t>* records);

}  // namespace hq
}  // namespace kvcomp

#endif  // KVCOMP_CODECS_HQ_STREAM_H_
