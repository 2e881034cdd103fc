// libFuzzer target for the cache-format parser. The first input byte picks a mode: as-is, or
// with the header and section-table checksums recomputed first, so the fuzzer also reaches the
// checks behind the checksums. Any cache the parser accepts must re-encode to bytes that parse to the same cache.
#include <cstdint>
#include <cstring>
#include <string>

#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/format.h"

namespace {

void Reseal(std::string* b) {
  if (b->size() < 128) return;
  uint32_t n;
  std::memcpy(&n, b->data() + 52, 4);
  if (n <= 64 && 128 + 32ull * n <= b->size()) {
    const uint32_t table_crc = kvcomp::Crc32c(b->data() + 128, 32ull * n);
    std::memcpy(b->data() + 80, &table_crc, 4);
    // Section checksums too, where the entry is in bounds.
    for (uint32_t i = 0; i < n; ++i) {
      uint64_t off, size;
      std::memcpy(&off, b->data() + 128 + 32 * i + 8, 8);
      std::memcpy(&size, b->data() + 128 + 32 * i + 16, 8);
      if (off <= b->size() && size <= b->size() - off) {
        const uint32_t c = kvcomp::Crc32c(b->data() + off, size);
        std::memcpy(b->data() + 128 + 32 * i + 24, &c, 4);
      }
    }
    const uint32_t t2 = kvcomp::Crc32c(b->data() + 128, 32ull * n);
    std::memcpy(b->data() + 80, &t2, 4);
  }
  const uint32_t h = kvcomp::Crc32c(b->data(), 124);
  std::memcpy(b->data() + 124, &h, 4);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if (mode & 1) Reseal(&bytes);
  auto info = kvcomp::format::PeekCache(bytes);
  auto parsed = kvcomp::format::ParseCache(bytes);
  if (parsed.ok()) {
    if (!info.ok()) __builtin_trap();
    // Accepted input may be non-canonical (policy records in another order, optional flags);
    // what it means must survive a re-encode.
    auto again = kvcomp::format::EncodeCache(*parsed);
    if (!again.ok()) __builtin_trap();
    auto reparsed = kvcomp::format::ParseCache(*again);
    if (!reparsed.ok() || !(*reparsed == *parsed)) __builtin_trap();
  }
  return 0;
}
