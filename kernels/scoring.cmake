# Sources of this concern: list(APPEND KERNELS_SRCS ...), list(APPEND KERNELS_CUDA_SRCS ...).
