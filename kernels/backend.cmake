# Sources of this concern: list(APPEND KERNELS_SRCS ...), list(APPEND KERNELS_CUDA_SRCS ...).
# Backend factories, the host allocator and the CPU worker pool.
list(APPEND KERNELS_SRCS
  src/backend.cc
  src/cpu/thread_pool.cc
)
list(APPEND KERNELS_HDRS kvcomp/kernels/allocator.h)

# The CUDA backend (engine-CUDA). Every op group has its own CUDA factory now.
list(APPEND KERNELS_CUDA_SRCS src/cuda/cuda_backend.cc)
