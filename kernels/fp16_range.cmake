# The fp16 key codec's range check on host and device keys.
list(APPEND KERNELS_HDRS kvcomp/kernels/fp16_range.h)
list(APPEND KERNELS_SRCS src/fp16_range.cc)
list(APPEND KERNELS_CUDA_SRCS src/cuda/fp16_range_cuda.cu)
