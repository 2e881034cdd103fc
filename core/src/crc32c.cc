#include "kvcomp/core/crc32c.h"

#include "kvcomp/core/crc32c_gf2.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <nmmintrin.h>
#endif

namespace kvcomp {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t;
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};

uint32_t ExtendPortable(uint32_t crc, const uint8_t* p, size_t n) {
  static const Tables tables;
  const auto& t = tables.t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^
          t[4][(w >> 24) & 0xff] ^ t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^
          t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return crc;
}

#if defined(__x86_64__)
// Long inputs run three independent crc32 streams of kStride bytes at once (the instruction has
// a latency of three cycles and a throughput of one), then join them: the register after a
// stream is linear in its start value, so crc(A|B) = Shift(crc(A)) ^ crc(0, B), where Shift
// feeds kStride zero bytes, applied through four byte-indexed tables.
constexpr size_t kStride = 8192;

struct StrideShift {
  uint32_t t[4][256];
};

__attribute__((target("sse4.2"))) uint32_t RawZeros(uint32_t c, size_t n) {
  uint64_t r = c;
  for (size_t i = 0; i < n / 8; ++i) r = _mm_crc32_u64(r, 0);
  return static_cast<uint32_t>(r);
}

const StrideShift& GetStrideShift() {
  static const StrideShift* shift = [] {
    auto* s = new StrideShift;
    uint32_t column[32];
    for (int i = 0; i < 32; ++i) column[i] = RawZeros(uint32_t{1} << i, kStride);
    for (int k = 0; k < 4; ++k) {
      for (int b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int j = 0; j < 8; ++j) {
          if (b & (1 << j)) v ^= column[8 * k + j];
        }
        s->t[k][b] = v;
      }
    }
    return s;
  }();
  return *shift;
}

inline uint32_t Shift(const StrideShift& s, uint32_t c) {
  return s.t[0][c & 0xff] ^ s.t[1][(c >> 8) & 0xff] ^ s.t[2][(c >> 16) & 0xff] ^ s.t[3][c >> 24];
}

__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  if (n >= 3 * kStride) {
    const StrideShift& s = GetStrideShift();
    while (n >= 3 * kStride) {
      uint64_t a = c, b = 0, d = 0;
      for (size_t i = 0; i < kStride; i += 8) {
        uint64_t wa, wb, wd;
        std::memcpy(&wa, p + i, 8);
        std::memcpy(&wb, p + kStride + i, 8);
        std::memcpy(&wd, p + 2 * kStride + i, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        d = _mm_crc32_u64(d, wd);
      }
      const uint32_t ab = Shift(s, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b);
      c = Shift(s, ab) ^ static_cast<uint32_t>(d);
      p += 3 * kStride;
      n -= 3 * kStride;
    }
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool HaveSse42() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & bit_SSE4_2) != 0;
}
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool have_sse42 = HaveSse42();
  crc = have_sse42 ? ExtendSse42(crc, p, n) : ExtendPortable(crc, p, n);
#else
  crc = ExtendPortable(crc, p, n);
#endif
  return ~crc;
}

namespace {

const uint32_t* PowersOfX() {
  static const uint32_t* const table = [] {
    auto* t = new uint32_t[crc32c_gf2::kPowers];
    crc32c_gf2::PowersOfX(t);
    return t;
  }();
  return table;
}

}  // namespace

uint32_t Crc32cShift(uint32_t reg, uint64_t n) {
  return crc32c_gf2::MulMod(crc32c_gf2::XPow8(n, PowersOfX()), reg);
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return Crc32cShift(crc_a, len_b) ^ crc_b;
}

uint32_t Crc32cOfZeros(uint64_t n) { return ~Crc32cShift(~uint32_t{0}, n); }

}  // namespace kvcomp
