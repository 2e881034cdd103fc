// The portable build of the dense products (the library's baseline ISA; Eigen's own namespace).
#define KVCOMP_ROW_NS generic
#include "gemm_kernels.inc"
