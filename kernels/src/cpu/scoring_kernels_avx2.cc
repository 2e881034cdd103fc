// The AVX2+FMA+F16C build of the row kernels (compiled with those flags; called only on CPUs
// that have them, see RowKernelsFor).
#define KVCOMP_ROW_NS avx2
#define KVCOMP_VEC_BYTES 32
#include "scoring_kernels.inc"
