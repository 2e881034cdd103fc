// The Hadamard codec's CPU reference (kvcomp/codecs/hq.h): row by row, every step a single
// IEEE f32 operation in a fixed order (built with -ffp-contract=off, so no compiler fuses a
// product into a later sum), so the CUDA twin (kernels/src/cuda/hq_cuda.cu), written from the
// same steps with the round-to-nearest intrinsics, produces the same codes and decoded values.
#include "kvcomp/codecs/hq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"

namespace kvcomp {
namespace hq {
namespace {

constexpr float kHalfMax = 65504.0f;

// The neighbours of a finite half in value order (sign-magnitude bits).
uint16_t NextUp(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001;  // +0 or -0
  return (h & 0x8000u) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}
uint16_t NextDown(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x8001;
  return (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}
// The largest half <= v and the smallest half >= v, for |v| <= kHalfMax.
uint16_t HalfAtMost(float v) {
  uint16_t h = FloatToHalf(v);
  if (HalfToFloat(h) > v) h = NextDown(h);
  return h;
}
uint16_t HalfAtLeast(float v) {
  uint16_t h = FloatToHalf(v);
  if (HalfToFloat(h) < v) h = NextUp(h);
  return h;
}

// The minimum and maximum with -0 below +0, so a row's extremes (and lo's sign bit when the
// minimum is a zero) do not depend on the order the elements are visited in (a device reduction
// visits them in a tree). NaN is handled by the caller.
float MinOf(float a, float b) { return (b < a || (b == a && std::signbit(b))) ? b : a; }
float MaxOf(float a, float b) { return (b > a || (b == a && !std::signbit(b))) ? b : a; }

bool IsPow2(uint32_t d) { return d != 0 && (d & (d - 1)) == 0; }

}  // namespace

absl::Status CheckHeadDim(uint32_t d) {
  if (!IsPow2(d) || d < kMinHeadDim || d > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "hq codec: head_dim %u is not a power of two in [%u, %u]", d, kMinHeadDim, kMaxHeadDim));
  }
  return absl::OkStatus();
}

absl::Status CheckBits(uint32_t bits) {
  if (bits < 2 || bits > 4) {
    return absl::InvalidArgumentError(absl::StrFormat("hq codec: %u bits, not 2, 3 or 4", bits));
  }
  return absl::OkStatus();
}

float Normalizer(uint32_t d) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))); }

void Hadamard(float* u, uint32_t d) {
  for (uint32_t h = 1; h < d; h <<= 1) {
    for (uint32_t i = 0; i < d; i += 2 * h) {
      for (uint32_t j = i; j < i + h; ++j) {
        const float a = u[j], b = u[j + h];
        u[j] = a + b;
        u[j + h] = a - b;
      }
    }
  }
}

absl::Status EncodeRow(const float* x, uint32_t d, uint32_t bits, uint8_t* out) {
  float y[kMaxHeadDim];
  for (uint32_t i = 0; i < d; ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("hq codec: element %u of the row is not finite", i));
    }
    y[i] = Sign(i) * x[i];
  }
  Hadamard(y, d);
  const float c = Normalizer(d);
  float mn = INFINITY, mx = -INFINITY;
  bool nan = false;  // only where the transform overflowed (inf - inf)
  for (uint32_t i = 0; i < d; ++i) {
    y[i] = y[i] * c;
    nan = nan || std::isnan(y[i]);
    mn = MinOf(mn, y[i]);
    mx = MaxOf(mx, y[i]);
  }
  if (nan || !(mn >= -kHalfMax) || !(mx <= kHalfMax)) {
    return absl::InvalidArgumentError(
        "hq codec: the rotated row leaves the f16 range (|value| > 65504)");
  }
  const uint16_t lo_h = HalfAtMost(mn);
  const float lo = HalfToFloat(lo_h);
  const float qmax = static_cast<float>((1u << bits) - 1);
  const float s = (mx - lo) / qmax;
  if (!(s <= kHalfMax)) {
    return absl::InvalidArgumentError("hq codec: the row's range leaves the f16 range");
  }
  const uint16_t step_h = s > 0.0f ? HalfAtLeast(s) : uint16_t{0};
  const float step = HalfToFloat(step_h);
  out[0] = static_cast<uint8_t>(lo_h & 0xffu);
  out[1] = static_cast<uint8_t>(lo_h >> 8);
  out[2] = static_cast<uint8_t>(step_h & 0xffu);
  out[3] = static_cast<uint8_t>(step_h >> 8);
  uint8_t* codes = out + 4;
  std::memset(codes, 0, uint64_t{d} * bits / 8);
  for (uint32_t i = 0; i < d; ++i) {
    uint32_t q = 0;
    if (step > 0.0f) {
      const float t = std::nearbyint((y[i] - lo) / step);
      q = t <= 0.0f ? 0u : t >= qmax ? static_cast<uint32_t>(qmax) : static_cast<uint32_t>(t);
    }
    const uint32_t bit = i * bits;
    const uint32_t word = q << (bit & 7);  // at most 4 + 7 bits: two bytes
    codes[bit >> 3] |= static_cast<uint8_t>(word & 0xffu);
    if ((bit & 7) + bits > 8) codes[(bit >> 3) + 1] |= static_cast<uint8_t>(word >> 8);
  }
  return absl::OkStatus();
}

absl::Status CheckRecord(const uint8_t* in) {
  const uint16_t lo_h = static_cast<uint16_t>(in[0] | (in[1] << 8));
  const uint16_t step_h = static_cast<uint16_t>(in[2] | (in[3] << 8));
  const float lo = HalfToFloat(lo_h), step = HalfToFloat(step_h);
  if (!std::isfinite(lo) || !std::isfinite(step) || (step_h & 0x8000u) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "hq codec: row record with minimum 0x%04x and step 0x%04x (need finite halves, step >= "
        "+0)",
        lo_h, step_h));
  }
  return absl::OkStatus();
}

absl::Status DecodeRow(const uint8_t* in, uint32_t d, uint32_t bits, float* out) {
  if (absl::Status s = CheckRecord(in); !s.ok()) return s;
  const float lo = HalfToFloat(static_cast<uint16_t>(in[0] | (in[1] << 8)));
  const float step = HalfToFloat(static_cast<uint16_t>(in[2] | (in[3] << 8)));
  const uint8_t* codes = in + 4;
  const uint32_t mask = (1u << bits) - 1;
  for (uint32_t i = 0; i < d; ++i) {
    const uint32_t bit = i * bits;
    uint32_t word = codes[bit >> 3];
    if ((bit & 7) + bits > 8) word |= uint32_t{codes[(bit >> 3) + 1]} << 8;
    const uint32_t q = (word >> (bit & 7)) & mask;
    out[i] = std::fma(static_cast<float>(q), step, lo);
  }
  Hadamard(out, d);
  const float c = Normalizer(d);
  for (uint32_t i = 0; i < d; ++i) out[i] = Sign(i) * (out[i] * c);
  return absl::OkStatus();
}

namespace {

// Rows are independent: a large batch is split into contiguous ranges, one per thread (up to the
// machine's hardware threads, at least kRowsPerThread rows each), and the codes are the same
// whatever the split. The error reported is the lowest failing row's, as one thread would find.
constexpr uint64_t kRowsPerThread = 8192;
constexpr unsigned kMaxThreads = 32;

absl::Status ForRowRanges(uint64_t rows,
                          const std::function<absl::Status(uint64_t, uint64_t)>& fn) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t n = std::min<uint64_t>(std::min(hw, kMaxThreads),
                                        (rows + kRowsPerThread - 1) / kRowsPerThread);
  if (n <= 1) return fn(0, rows);
  const uint64_t per = (rows + n - 1) / n;
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  threads.reserve(n - 1);
  for (uint64_t t = 1; t < n; ++t) {
    threads.emplace_back(
        [&, t] { status[t] = fn(std::min(rows, t * per), std::min(rows, (t + 1) * per)); });
  }
  status[0] = fn(0, std::min(rows, per));
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EncodeRows(const void* src, DType dtype, uint64_t rows, uint32_t d, uint32_t bits,
                        uint8_t* out) {
  if (absl::Status s = CheckHeadDim(d); !s.ok()) return s;
  if (absl::Status s = CheckBits(bits); !s.ok()) return s;
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hq codec: input dtype %s is not f32, f16 or bf16", DTypeName(dtype)));
  }
  if (rows == 0) return absl::OkStatus();
  if (src == nullptr || out == nullptr) return absl::InvalidArgumentError("hq codec: null buffer");
  const uint64_t rb = RowBytes(bits, d);
  return ForRowRanges(rows, [&](uint64_t begin, uint64_t end) -> absl::Status {
    float x[kMaxHeadDim];
    for (uint64_t r = begin; r < end; ++r) {
      for (uint32_t i = 0; i < d; ++i) x[i] = LoadAsFloat(src, dtype, r * d + i);
      if (absl::Status s = EncodeRow(x, d, bits, out + r * rb); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrFormat("%s (row %u)", s.message(), r));
      }
    }
    return absl::OkStatus();
  });
}

absl::Status DecodeRows(const uint8_t* in, uint64_t rows, uint32_t d, uint32_t bits, void* dst,
                        DType dtype) {
  if (absl::Status s = CheckHeadDim(d); !s.ok()) return s;
  if (absl::Status s = CheckBits(bits); !s.ok()) return s;
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hq codec: output dtype %s is not f32, f16 or bf16", DTypeName(dtype)));
  }
  if (rows == 0) return absl::OkStatus();
  if (in == nullptr || dst == nullptr) return absl::InvalidArgumentError("hq codec: null buffer");
  const uint64_t rb = RowBytes(bits, d);
  return ForRowRanges(rows, [&](uint64_t begin, uint64_t end) -> absl::Status {
    float x[kMaxHeadDim];
    for (uint64_t r = begin; r < end; ++r) {
      if (absl::Status s = DecodeRow(in + r * rb, d, bits, x); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrFormat("%s (row %u)", s.message(), r));
      }
      for (uint32_t i = 0; i < d; ++i) StoreFromFloat(dst, dtype, r * d + i, x[i]);
    }
    return absl::OkStatus();
  });
}

}  // namespace hq
}  // namespace kvcomp
