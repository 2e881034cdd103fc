// Small wrappers over PTX instructions shared by the CUDA kernels: asynchronous copies global ->
// shared (cp.async, sm_80 and later), shared-memory matrix loads (ldmatrix) and the 16-bit
// tensor-core products m16n8k16 (f16 and bf16) with f32 accumulators (mma.sync).
#ifndef KVCOMP_KERNELS_SRC_CUDA_PTX_PRIMITIVES_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_PTX_PRIMITIVES_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace kvcomp {
namespace ptx {

// Copies 16 bytes, of which the first src_bytes (0 or 16) are read and the rest zero-filled.
__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
}
// Copies 4 bytes (both addresses 4-byte aligned).
__device__ __forceinline__ void CpAsync4(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem_src));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 matrices of 16-bit elements, transposed: lane l gives the address of row l % 8 of
// matrix l / 8 (16 bytes); r[i] holds matrix i's fragment in the mma B operand's layout.
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem_row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Four 8x8 matrices of 16-bit elements as stored: lane l gives the address of row l % 8 of
// matrix l / 8; r[i] holds matrix i's fragment (lane t: row t / 4, columns 2 (t % 4), + 1),
// the mma A operand's layout for a row-major tile and the B operand's for a column-major one.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem_row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// c += a b over one 16 x 8 x 16 block, f16 operands, f32 accumulators. a: rows g and g + 8
// (g = lane / 4), k pairs 2 (lane % 4) and 2 (lane % 4) + 8, as {row g k, row g+8 k, row g k+8,
// row g+8 k+8}; b: k pairs 2 (lane % 4) and + 8 of column g; c: rows g, g + 8, columns
// 2 (lane % 4), + 1.
__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same product with bf16 operands.
__device__ __forceinline__ void MmaBF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The product of 16-bit T (__half or __nv_bfloat16).
template <typename T>
__device__ __forceinline__ void Mma16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value) {
    MmaF16(c, a, b0, b1);
  } else {
    MmaBF16(c, a, b0, b1);
  }
}

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream
// serialisation may start while the kernel before it finishes; GridDependencyWait blocks until
// that kernel's memory operations are visible (a no-op for a kernel launched the ordinary way
// or below sm_90).
__device__ __forceinline__ void GridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets this kernel's programmatic dependents start being placed (sm_90; a no-op otherwise).
__device__ __forceinline__ void LaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace ptx
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_PTX_PRIMITIVES_CUH_
