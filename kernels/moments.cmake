# Sources of this concern: list(APPEND KERNELS_SRCS ...), list(APPEND KERNELS_CUDA_SRCS ...).
# MomentKV summaries, compaction with summary, corrected decode attention.
list(APPEND KERNELS_SRCS
  src/cpu/moments_cpu.cc
  src/cpu/attention_cpu.cc
)
if(TARGET Eigen3::Eigen)
  # The CPU tiles' dense products go through Eigen's GEMM; a plain loop otherwise.
  set_source_files_properties(src/cpu/moments_cpu.cc PROPERTIES COMPILE_DEFINITIONS
                              KVCOMP_HAVE_EIGEN=1)
endif()
list(APPEND KERNELS_CUDA_SRCS src/cuda/moments_cuda.cu)
list(APPEND KERNELS_SRCS src/cpu/moments_aware.cc)
list(APPEND KERNELS_CUDA_SRCS src/cuda/moments_aware.cu)  # the rescoring on the device
