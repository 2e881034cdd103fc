// The CRC32C kernels behind DeviceCrc32c (kvcomp/kernels/device_crc32c.h).
//
// A range is cut into 512-byte chunks at absolute 512-byte boundaries (so every full chunk is
// read with aligned 16-byte loads; the first chunk may start inside its 512 bytes, which is the
// same as zeros before it: zeros at the front of a register started at 0 change nothing). A
// block's threads take consecutive chunks, counted back from the last chunk that ends on a
// boundary, so every block's chunks are whole and in the same place relative to its end; threads
// of the first block past the front of the range contribute 0. A chunk's register (started at 0)
// is shifted by the bytes after it inside its block (one multiplication per thread, by a constant
// of its lane, then one per warp), the block's sum by the bytes after the block, and a chunk cut
// by the end of the range is added by the last block unshifted. Every part lands with an atomic
// XOR on the word an initial kernel set to the start value's contribution.
//
// Two kernels do this:
//  - Crc32cWide (the default): blocks of 1024 threads, one per multiprocessor, each going through
//    the blocks of 1024 chunks in turn (the tables are built once per block). Its tables are
//    slicing-by-4 tables with a private copy per lane, the copy of lane L in shared-memory bank L
//    ([table][byte][lane]: 128 KiB), so the 32 lookups of a warp never meet on a bank: one byte
//    costs one conflict-free lookup. A warp reads its 32 chunks 64 bytes of each at a time with
//    coalesced 16-byte loads (eight chunks a load instruction, four lanes on each 64-byte piece)
//    into shared memory, swizzled so that each lane then reads its own chunk's pieces without bank
//    conflicts, the next 64 bytes in flight while these are summed; a copy destination is written
//    from the same loads. Warp 0 computes the block's shift (x to the 8 times the bytes after the
//    block) as a product of precomputed powers over its lanes while the others read. On an H200
//    it reads 2.0 TB/s (1 and 2 GiB), against 1.7 TB/s for the slicing-by-16 kernel: not yet
//    bound by the memory (4.2 TB/s). A call whose ranges make fewer blocks than the device has
//    multiprocessors (under 66 MiB on an H200) takes Crc32cChunks, whose many small blocks keep
//    every multiprocessor busy (16 MiB: 0.53 TB/s, 0.35 in Crc32cWide).
//  - Crc32cChunks (small calls; every call with KVCOMP_CRC_WIDE=0): blocks of 256 threads,
//    slicing-by-16 tables shared by the lanes (lookups collide on banks), each thread reading its
//    chunk 16 bytes at a time; a copy staged in shared memory so the stores fill whole sectors.
// The partial first chunk of a range and its tail are read by one thread, byte by byte up to
// 16-byte alignment.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvcomp/core/crc32c_gf2.h"
#include "cuda_status.h"
#include "kvcomp/kernels/device_crc32c.h"

namespace kvcomp {
namespace {

using crc32c_gf2::MulMod;
using crc32c_gf2::XPow8;
using crc32c_gf2::kOne;

constexpr int kThreads = 256;
constexpr uint64_t kChunk = 512;
constexpr int kMaxRanges = 16;  // per launch

struct CrcLaunch {
  int n = 0;
  uint64_t begin[kMaxRanges];
  uint64_t end[kMaxRanges];
  uint64_t full_chunks[kMaxRanges];  // chunks ending at or before `end`, from begin's boundary
  uint32_t* out[kMaxRanges];
  int64_t copy_delta[kMaxRanges];  // copy_to - data; 0: no copy
  uint32_t first_block[kMaxRanges + 1];
  uint32_t lane_shift[32];  // x^(8 * kChunk * (31 - lane))
  uint32_t warp_shift[kThreads / 32];
  uint32_t x2n[crc32c_gf2::kPowers];
};

struct CrcInit {
  int n = 0;
  uint32_t* out[kMaxRanges];
  uint32_t value[kMaxRanges];
};

__global__ void InitCrcWords(const CrcInit p) {
  const int i = threadIdx.x;
  if (i < p.n) *p.out[i] = p.value[i];
}

__device__ __forceinline__ uint32_t Step16(const uint32_t (*t)[256], uint32_t c, uint4 w) {
  const uint32_t a = w.x ^ c;
  return t[15][a & 255] ^ t[14][(a >> 8) & 255] ^ t[13][(a >> 16) & 255] ^ t[12][a >> 24] ^
         t[11][w.y & 255] ^ t[10][(w.y >> 8) & 255] ^ t[9][(w.y >> 16) & 255] ^
         t[8][w.y >> 24] ^ t[7][w.z & 255] ^ t[6][(w.z >> 8) & 255] ^
         t[5][(w.z >> 16) & 255] ^ t[4][w.z >> 24] ^ t[3][w.w & 255] ^
         t[2][(w.w >> 8) & 255] ^ t[1][(w.w >> 16) & 255] ^ t[0][w.w >> 24];
}

__device__ __forceinline__ uint32_t StepByte(const uint32_t (*t)[256], uint32_t c, uint8_t b) {
  return t[0][(c ^ b) & 255] ^ (c >> 8);
}

// The register (started at 0) after the bytes [lo, hi); with `delta` != 0 the bytes are also
// written `delta` bytes on (a multiple of 16, so the 16-byte stores are aligned as the loads).
__device__ uint32_t RangeRegister(const uint32_t (*t)[256], uint64_t lo, uint64_t hi,
                                  int64_t delta) {
  uint32_t c = 0;
  const uint8_t* p = reinterpret_cast<const uint8_t*>(lo);
  const uint8_t* const e = reinterpret_cast<const uint8_t*>(hi);
  auto put_byte = [&](const uint8_t* at, uint8_t b) {
    if (delta != 0) *reinterpret_cast<uint8_t*>(const_cast<uint8_t*>(at) + delta) = b;
  };
  while (p < e && (reinterpret_cast<uint64_t>(p) & 15) != 0) {
    put_byte(p, *p);
    c = StepByte(t, c, *p++);
  }
  for (; p + 16 <= e; p += 16) {
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(p));
    if (delta != 0) *reinterpret_cast<uint4*>(const_cast<uint8_t*>(p) + delta) = w;
    c = Step16(t, c, w);
  }
  while (p < e) {
    put_byte(p, *p);
    c = StepByte(t, c, *p++);
  }
  return c;
}

__global__ void __launch_bounds__(kThreads) Crc32cChunks(const CrcLaunch p) {
  __shared__ uint32_t t[16][256];
  __shared__ uint32_t warp_part[kThreads / 32];
  __shared__ uint4 stage[kThreads / 32][32][4];  // a warp's 64-byte pieces on their way out
  const int tid = threadIdx.x;
  {
    uint32_t c = tid;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ crc32c_gf2::kPoly : c >> 1;
    t[0][tid] = c;
  }
  __syncthreads();
  for (int k = 1; k < 16; ++k) t[k][tid] = (t[k - 1][tid] >> 8) ^ t[0][t[k - 1][tid] & 255];
  __syncthreads();

  int r = 0;
  while (r + 1 < p.n && p.first_block[r + 1] <= blockIdx.x) ++r;
  const uint64_t blocks = p.first_block[r + 1] - p.first_block[r];
  const uint64_t b = blockIdx.x - p.first_block[r];
  const uint64_t base = p.begin[r] & ~(kChunk - 1);
  const uint64_t kg = p.full_chunks[r];
  // Chunk of this thread; the block's last chunk is kg - 1 - 256 * (blocks - 1 - b).
  const int64_t k = static_cast<int64_t>(kg) - static_cast<int64_t>((blocks - b) * kThreads) + tid;
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t delta = p.copy_delta[r];
  uint32_t reg = 0;
  uint64_t lo = 0;
  bool whole = false;  // a chunk inside the range: 512-byte aligned, read 16 bytes at a time
  if (k >= 0) {
    lo = base + static_cast<uint64_t>(k) * kChunk;
    whole = lo >= p.begin[r];
    if (!whole) reg = RangeRegister(t, p.begin[r], lo + kChunk, delta);
  }
  if (delta == 0) {
    if (whole) reg = RangeRegister(t, lo, lo + kChunk, 0);
  } else {
    const uint32_t wholes = __ballot_sync(0xffffffffu, whole);
    if (wholes != 0) {
      for (uint64_t g = 0; g < kChunk; g += 64) {
        if (whole) {
          uint4 w[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) w[q] = __ldg(reinterpret_cast<const uint4*>(lo + g + 16 * q));
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            reg = Step16(t, reg, w[q]);
            stage[warp][lane][q ^ (lane & 3)] = w[q];
          }
        }
        __syncwarp();
        // Store i: lanes 4 j .. 4 j + 3 write lane (8 i + j)'s piece, 16 bytes each.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int src = 8 * i + (lane >> 2), q = lane & 3;
          const uint64_t at = __shfl_sync(0xffffffffu, lo, src);
          if ((wholes >> src) & 1u) {
            *reinterpret_cast<uint4*>(at + g + 16 * q + delta) = stage[warp][src][q ^ (src & 3)];
          }
        }
        __syncwarp();
      }
    }
  }
  uint32_t v = reg != 0 ? MulMod(reg, p.lane_shift[lane]) : 0;
  for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) warp_part[warp] = v != 0 ? MulMod(v, p.warp_shift[warp]) : 0;
  __syncthreads();
  if (tid != 0) return;
  uint32_t g = 0;
  for (int w = 0; w < kThreads / 32; ++w) g ^= warp_part[w];
  const uint64_t block_end = base + (kg - (blocks - 1 - b) * kThreads) * kChunk;
  uint32_t part = g != 0 ? MulMod(g, XPow8(p.end[r] - block_end, p.x2n)) : 0;
  if (b == blocks - 1 && p.end[r] > block_end) {
    part ^= RangeRegister(t, block_end > p.begin[r] ? block_end : p.begin[r], p.end[r],
                          p.copy_delta[r]);
  }
  if (part != 0) atomicXor(p.out[r], part);
}

// ---- Crc32cWide ----

constexpr int kWideThreads = 1024;
constexpr int kWideWarps = kWideThreads / 32;
constexpr uint64_t kWideBlockBytes = kChunk * kWideThreads;
constexpr size_t kWideTableWords = 4 * 256 * 32;  // [table][byte][lane]
constexpr size_t kWideStagePieces = size_t{kWideWarps} * 32 * 4;  // [warp][chunk][16-byte piece]
constexpr size_t kWideSmemBytes = kWideTableWords * 4 + kWideStagePieces * 16;  // 192 KiB

struct WideLaunch {
  int n = 0;
  uint64_t begin[kMaxRanges];
  uint64_t end[kMaxRanges];
  uint64_t full_chunks[kMaxRanges];
  uint32_t* out[kMaxRanges];
  int64_t copy_delta[kMaxRanges];
  uint32_t first_block[kMaxRanges + 1];
  uint32_t tail_shift[kMaxRanges];  // x^(8 (end - the end of the range's last whole chunk))
  uint32_t lane_shift[32];          // x^(8 * kChunk * (31 - lane))
  uint32_t warp_shift[kWideWarps];  // x^(8 * kChunk * 32 * (31 - warp))
  uint32_t block_pow[32];           // x^(8 * kWideBlockBytes * 2^i)
};

// Table k's entry for byte `idx` in the calling lane's copy (`tl` = tables + lane): the register
// after the byte and k zero bytes.
__device__ __forceinline__ uint32_t Look(const uint32_t* tl, int k, uint32_t idx) {
  return tl[(static_cast<uint32_t>(k) * 256u + idx) * 32u];
}

__device__ __forceinline__ uint32_t WideStep4(const uint32_t* tl, uint32_t c, uint32_t w) {
  const uint32_t a = c ^ w;
  return (Look(tl, 3, a & 255u) ^ Look(tl, 2, (a >> 8) & 255u)) ^
         (Look(tl, 1, (a >> 16) & 255u) ^ Look(tl, 0, a >> 24));
}

__device__ __forceinline__ uint32_t WideStep16(const uint32_t* tl, uint32_t c, uint4 w) {
  c = WideStep4(tl, c, w.x);
  c = WideStep4(tl, c, w.y);
  c = WideStep4(tl, c, w.z);
  return WideStep4(tl, c, w.w);
}

// RangeRegister with the lane's tables.
__device__ uint32_t WideRange(const uint32_t* tl, uint64_t lo, uint64_t hi, int64_t delta) {
  uint32_t c = 0;
  const uint8_t* p = reinterpret_cast<const uint8_t*>(lo);
  const uint8_t* const e = reinterpret_cast<const uint8_t*>(hi);
  auto step_byte = [&](const uint8_t* at) {
    const uint8_t b = *at;
    if (delta != 0) *(const_cast<uint8_t*>(at) + delta) = b;
    c = Look(tl, 0, (c ^ b) & 255u) ^ (c >> 8);
  };
  while (p < e && (reinterpret_cast<uint64_t>(p) & 15) != 0) step_byte(p++);
  for (; p + 16 <= e; p += 16) {
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(p));
    if (delta != 0) *reinterpret_cast<uint4*>(const_cast<uint8_t*>(p) + delta) = w;
    c = WideStep16(tl, c, w);
  }
  while (p < e) step_byte(p++);
  return c;
}

// Where piece q of chunk `src` sits in its warp's stage: the pieces of chunk src are rotated by
// (src / 2) % 4, so that the 32 lanes reading piece q of their own chunks cover every bank group.
__device__ __forceinline__ int StageSlot(int src, int q) { return src * 4 + (q ^ ((src >> 1) & 3)); }

__global__ void __launch_bounds__(kWideThreads, 1) Crc32cWide(const WideLaunch p,
                                                              uint32_t total_blocks) {
  extern __shared__ uint4 wide_smem[];
  __shared__ uint32_t warp_part[kWideWarps];
  __shared__ uint32_t block_shift;
  uint32_t* tables = reinterpret_cast<uint32_t*>(wide_smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  {
    // Entry tid: table tid / 256 (the byte then that many zero bytes), byte tid % 256; each
    // lane writes the 32 copies starting at a different bank.
    uint32_t c = static_cast<uint32_t>(tid & 255);
    for (int k = 0; k < 8 * ((tid >> 8) + 1); ++k) {
      c = (c >> 1) ^ (crc32c_gf2::kPoly & (0u - (c & 1u)));
    }
    for (int j = 0; j < 32; ++j) tables[tid * 32 + ((j + lane) & 31)] = c;
  }
  __syncthreads();
  const uint32_t* tl = tables + lane;
  uint4* stage = wide_smem + kWideTableWords / 4 + static_cast<size_t>(warp) * 128;

  for (uint32_t vb = blockIdx.x; vb < total_blocks; vb += gridDim.x) {
    int r = 0;
    while (r + 1 < p.n && p.first_block[r + 1] <= vb) ++r;
    const uint64_t blocks = p.first_block[r + 1] - p.first_block[r];
    const uint64_t b = vb - p.first_block[r];
    const uint64_t base = p.begin[r] & ~(kChunk - 1);
    const uint64_t kg = p.full_chunks[r];
    const int64_t delta = p.copy_delta[r];
    if (warp == 0) {
      // The block's shift: x^(8 (bytes after the block)) = tail_shift * block_pow[i] for each
      // bit i of the blocks after it, multiplied over the lanes.
      const uint64_t after = blocks - 1 - b;
      uint32_t f = lane < 31 ? (((after >> lane) & 1u) != 0 ? p.block_pow[lane] : kOne)
                             : p.tail_shift[r];
      for (int o = 16; o > 0; o >>= 1) f = MulMod(f, __shfl_xor_sync(0xffffffffu, f, o));
      if (lane == 0) block_shift = f;
    }
    const int64_t k =
        static_cast<int64_t>(kg) - static_cast<int64_t>((blocks - b) * kWideThreads) + tid;
    uint32_t reg = 0;
    uint64_t lo = 0;
    bool whole = false;
    if (k >= 0) {
      lo = base + static_cast<uint64_t>(k) * kChunk;
      whole = lo >= p.begin[r];
      if (!whole) reg = WideRange(tl, p.begin[r], lo + kChunk, delta);
    }
    const uint32_t wholes = __ballot_sync(0xffffffffu, whole);
    if (wholes != 0) {
      // Load i: lanes 4 j .. 4 j + 3 read chunk (8 i + j)'s 64 bytes at g. The next 64 bytes'
      // reads are issued before this batch is summed, so they fly while it is.
      uint4 w[4];
      auto load = [&](uint64_t g) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int src = 8 * i + (lane >> 2);
          const uint64_t at = __shfl_sync(0xffffffffu, lo, src) + g + 16 * (lane & 3);
          if ((wholes >> src) & 1u) w[i] = __ldg(reinterpret_cast<const uint4*>(at));
        }
      };
      load(0);
      for (uint64_t g = 0; g < kChunk; g += 64) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int src = 8 * i + (lane >> 2);
          if ((wholes >> src) & 1u) stage[StageSlot(src, lane & 3)] = w[i];
        }
        if (delta != 0) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int src = 8 * i + (lane >> 2);
            const uint64_t at = __shfl_sync(0xffffffffu, lo, src) + g + 16 * (lane & 3);
            if ((wholes >> src) & 1u) *reinterpret_cast<uint4*>(at + delta) = w[i];
          }
        }
        __syncwarp();
        if (g + 64 < kChunk) load(g + 64);
        if (whole) {
#pragma unroll
          for (int q = 0; q < 4; ++q) reg = WideStep16(tl, reg, stage[StageSlot(lane, q)]);
        }
        __syncwarp();
      }
    }
    uint32_t v = reg != 0 ? MulMod(reg, p.lane_shift[lane]) : 0;
    for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) warp_part[warp] = v != 0 ? MulMod(v, p.warp_shift[warp]) : 0;
    __syncthreads();
    if (warp == 0) {
      uint32_t g = warp_part[lane];
      for (int o = 16; o > 0; o >>= 1) g ^= __shfl_xor_sync(0xffffffffu, g, o);
      if (lane == 0) {
        uint32_t part = g != 0 ? MulMod(g, block_shift) : 0;
        const uint64_t last_end = base + kg * kChunk;
        if (b == blocks - 1 && p.end[r] > last_end) {
          part ^= WideRange(tl, last_end > p.begin[r] ? last_end : p.begin[r], p.end[r], delta);
        }
        if (part != 0) atomicXor(p.out[r], part);
      }
    }
    __syncthreads();  // warp_part and block_shift read before the next block writes them
  }
}

struct Constants {
  uint32_t lane_shift[32];
  uint32_t warp_shift[kThreads / 32];
  uint32_t x2n[crc32c_gf2::kPowers];
};

const Constants& GetConstants() {
  static const Constants* c = [] {
    auto* k = new Constants;
    crc32c_gf2::PowersOfX(k->x2n);
    for (int l = 0; l < 32; ++l) k->lane_shift[l] = XPow8(kChunk * (31 - l), k->x2n);
    for (int w = 0; w < kThreads / 32; ++w) {
      k->warp_shift[w] = XPow8(kChunk * 32 * (kThreads / 32 - 1 - w), k->x2n);
    }
    return k;
  }();
  return *c;
}

struct WideConstants {
  uint32_t lane_shift[32];
  uint32_t warp_shift[kWideWarps];
  uint32_t block_pow[32];
};

const WideConstants& GetWideConstants() {
  static const WideConstants* c = [] {
    const Constants& base = GetConstants();
    auto* k = new WideConstants;
    std::copy(std::begin(base.lane_shift), std::end(base.lane_shift), k->lane_shift);
    for (int w = 0; w < kWideWarps; ++w) {
      k->warp_shift[w] = XPow8(kChunk * 32 * (kWideWarps - 1 - w), base.x2n);
    }
    for (int i = 0; i < 32; ++i) k->block_pow[i] = XPow8(kWideBlockBytes << i, base.x2n);
    return k;
  }();
  return *c;
}

// Which kernel: KVCOMP_CRC_WIDE=0 takes Crc32cChunks always, =1 Crc32cWide always (for
// comparisons and tests), unset by the call's size (LaunchBatch). A device whose blocks cannot
// have Crc32cWide's shared memory (before Hopper: 163 KiB on an A100) takes Crc32cChunks.
struct WidePlan {
  int sms = 0;  // 0: never Crc32cWide
  bool always = false;
};

absl::StatusOr<WidePlan> GetWidePlan() {
  static const int mode = [] {
    const char* env = std::getenv("KVCOMP_CRC_WIDE");
    if (env != nullptr && std::strcmp(env, "0") == 0) return 0;
    if (env != nullptr && std::strcmp(env, "1") == 0) return 1;
    return 2;
  }();
  if (mode == 0) return WidePlan{};
  int device = 0, optin = 0, sms = 0;
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // The kernel's static shared memory (a word per warp and the shift) on top.
  if (static_cast<size_t>(optin) < kWideSmemBytes + 4 * (kWideWarps + 1)) return WidePlan{};
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      Crc32cWide, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kWideSmemBytes)));
  return WidePlan{sms, mode == 1};
}

absl::Status LaunchBatch(absl::Span<const DeviceCrcRange> ranges, cudaStream_t stream,
                         const WidePlan& plan) {
  // Crc32cWide when its blocks fill every multiprocessor; fewer (under 512 KiB a
  // multiprocessor) go faster in Crc32cChunks' many small blocks.
  uint64_t wide_blocks = 0;
  for (const DeviceCrcRange& r : ranges) {
    if (r.size == 0) continue;
    const uint64_t begin = reinterpret_cast<uint64_t>(r.data);
    const uint64_t full = (begin + r.size - (begin & ~(kChunk - 1))) / kChunk;
    wide_blocks += std::max<uint64_t>(1, (full + kWideThreads - 1) / kWideThreads);
  }
  const bool wide =
      plan.sms > 0 && (plan.always || wide_blocks >= static_cast<uint64_t>(plan.sms));
  const int threads = wide ? kWideThreads : kThreads;
  CrcInit init;
  CrcLaunch launch;
  WideLaunch wl;
  uint64_t blocks = 0;
  for (const DeviceCrcRange& r : ranges) {
    init.out[init.n] = r.crc;
    // The start value ~0 shifted through the range, complemented: the CRC of zeros of that
    // length; the data's part is XORed on top.
    init.value[init.n] = Crc32cOfZeros(r.size);
    ++init.n;
    if (r.size == 0) continue;
    const uint64_t begin = reinterpret_cast<uint64_t>(r.data);
    const uint64_t base = begin & ~(kChunk - 1);
    const uint64_t full = (begin + r.size - base) / kChunk;
    const int64_t delta = r.copy_to == nullptr
                              ? 0
                              : static_cast<int64_t>(reinterpret_cast<uintptr_t>(r.copy_to) -
                                                     reinterpret_cast<uintptr_t>(r.data));
    const int i = launch.n++;
    launch.begin[i] = wl.begin[i] = begin;
    launch.end[i] = wl.end[i] = begin + r.size;
    launch.full_chunks[i] = wl.full_chunks[i] = full;
    launch.out[i] = wl.out[i] = r.crc;
    launch.copy_delta[i] = wl.copy_delta[i] = delta;
    launch.first_block[i] = wl.first_block[i] = static_cast<uint32_t>(blocks);
    if (wide) wl.tail_shift[i] = XPow8(begin + r.size - (base + full * kChunk), GetConstants().x2n);
    blocks += std::max<uint64_t>(1, (full + threads - 1) / threads);
    if (blocks > 0x7fffffffu) return absl::InvalidArgumentError("DeviceCrc32c: range too large");
  }
  wl.n = launch.n;
  launch.first_block[launch.n] = wl.first_block[launch.n] = static_cast<uint32_t>(blocks);
  InitCrcWords<<<1, kMaxRanges, 0, stream>>>(init);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (blocks == 0) return absl::OkStatus();
  if (wide) {
    const WideConstants& k = GetWideConstants();
    std::copy(std::begin(k.lane_shift), std::end(k.lane_shift), wl.lane_shift);
    std::copy(std::begin(k.warp_shift), std::end(k.warp_shift), wl.warp_shift);
    std::copy(std::begin(k.block_pow), std::end(k.block_pow), wl.block_pow);
    const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(blocks, plan.sms));
    Crc32cWide<<<grid, kWideThreads, kWideSmemBytes, stream>>>(wl,
                                                               static_cast<uint32_t>(blocks));
  } else {
    const Constants& k = GetConstants();
    std::copy(std::begin(k.lane_shift), std::end(k.lane_shift), launch.lane_shift);
    std::copy(std::begin(k.warp_shift), std::end(k.warp_shift), launch.warp_shift);
    std::copy(std::begin(k.x2n), std::end(k.x2n), launch.x2n);
    Crc32cChunks<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(launch);
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

absl::Status DeviceCrc32c(absl::Span<const DeviceCrcRange> ranges, void* stream) {
  for (const DeviceCrcRange& r : ranges) {
    if (r.crc == nullptr || (reinterpret_cast<uintptr_t>(r.crc) & 3) != 0) {
      return absl::InvalidArgumentError("DeviceCrc32c: the crc word is null or not 4-byte aligned");
    }
    if (r.data == nullptr && r.size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("DeviceCrc32c: null data for ", r.size, " bytes"));
    }
    if (r.copy_to != nullptr && r.size != 0 &&
        ((reinterpret_cast<uintptr_t>(r.copy_to) - reinterpret_cast<uintptr_t>(r.data)) & 15) !=
            0) {
      return absl::InvalidArgumentError(
          "DeviceCrc32c: copy_to is not aligned as its range (the same address modulo 16)");
    }
  }
  auto s = static_cast<cudaStream_t>(stream);
  absl::StatusOr<WidePlan> plan = GetWidePlan();
  if (!plan.ok()) return plan.status();
  for (size_t at = 0; at < ranges.size(); at += kMaxRanges) {
    const size_t n = std::min<size_t>(kMaxRanges, ranges.size() - at);
    absl::Status st = LaunchBatch(ranges.subspan(at, n), s, *plan);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace kvcomp
