// The AVX-512 (F, with FMA and F16C) build of the row kernels (compiled with those flags;
// called only on CPUs that have them, see RowKernelsFor).
#define KVCOMP_ROW_NS avx512
#define KVCOMP_VEC_BYTES 64
#include "scoring_kernels.inc"
