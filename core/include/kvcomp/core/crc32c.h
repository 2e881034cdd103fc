// CRC32C (Castagnoli), the checksum of every section of the cache format and of every block on
// the wire. Debian's Abseil predates absl/crc, so kvcomp carries its own: the SSE4.2 instruction
// where the CPU has it, a slicing-by-8 table otherwise. Thread-safe.
#ifndef KVCOMP_CORE_CRC32C_H_
#define KVCOMP_CORE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace kvcomp {

// Extends `crc` (the CRC32C of earlier bytes, 0 for none) with `n` bytes at `data`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

// The CRC32C of `n` bytes at `data`. Crc32c("123456789", 9) == 0xE3069283.
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

}  // namespace kvcomp

#endif  // KVCOMP_CORE_CRC32C_H_
