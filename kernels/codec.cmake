# KVSplice encoding of the kept tokens (projections, calibration, codecs).
list(APPEND KERNELS_HDRS
  kvcomp/kernels/projection.h
  kvcomp/kernels/calibration.h
)
list(APPEND KERNELS_SRCS
  src/cpu/codec_common.cc
  src/cpu/codec_cpu.cc
  src/cpu/kvsplice_projection.cc
  src/cpu/calibration.cc
)
list(APPEND KERNELS_HDRS kvcomp/kernels/kvsplice.h)
list(APPEND KERNELS_SRCS src/cpu/kvsplice.cc)
list(APPEND KERNELS_CUDA_SRCS src/cuda/codec_cuda.cu)
list(APPEND KERNELS_CUDA_SRCS src/cuda/codec_device.cu)  # the device codec stage (outliers)
list(APPEND KERNELS_CUDA_SRCS src/cuda/hq_cuda.cu)  # the Hadamard codec
list(APPEND KERNELS_CUDA_SRCS src/cuda/pq_cuda.cu)  # the calibrated basis codec
