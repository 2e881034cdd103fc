// The AVX2+FMA build of the dense products (called only on CPUs that have them, see WideGemm).
#define KVCOMP_ROW_NS avx2
#include "gemm_kernels.inc"
