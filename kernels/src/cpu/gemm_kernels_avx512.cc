// The AVX-512 build of the dense products (called only on CPUs that have it, see WideGemm).
#define KVCOMP_ROW_NS avx512
#include "gemm_kernels.inc"
