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

// Combining CRCs of pieces without reading them again: a CRC register is linear over GF(2), so
// the CRC of A followed by B is A's register shifted by B's length (a multiplication by x^(8n)
// modulo the polynomial) plus B's CRC (kvcomp/core/crc32c_gf2.h; the device CRC kernel folds its
// chunks the same way).
// The CRC32C of A followed by B, from crc_a = Crc32c(A), crc_b = Crc32c(B) and B's length.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
// The CRC32C of `n` zero bytes (Crc32c of a buffer of n zeros).
uint32_t Crc32cOfZeros(uint64_t n);
// A CRC register after `n` more zero bytes: x^(8n) * reg modulo the polynomial (bit-reflected,
// as the register is kept).
uint32_t Crc32cShift(uint32_t reg, uint64_t n);

}  // namespace kvcomp

#endif  // KVCOMP_CORE_CRC32C_H_
