# Cache bytes on the device: CRC32C of device memory and the format written there.
list(APPEND KERNELS_HDRS
  kvcomp/kernels/device_crc32c.h
  kvcomp/kernels/device_format.h
)
list(APPEND KERNELS_SRCS
  src/device_crc32c.cc
  src/device_format.cc
)
list(APPEND KERNELS_CUDA_SRCS src/cuda/crc32c_cuda.cu)
