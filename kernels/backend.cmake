# Sources of this concern: list(APPEND KERNELS_SRCS ...), list(APPEND KERNELS_CUDA_SRCS ...).
# Backend factories, the host allocator and the CPU worker pool.
list(APPEND KERNELS_SRCS
  src/backend.cc
  src/cpu/thread_pool.cc
)
list(APPEND KERNELS_HDRS kvcomp/kernels/allocator.h)

# Temporary factories (src/cpu/pending_ops.cc) for op groups whose owner has not listed theirs
# yet; decided at the end of this directory, once every concern has listed its sources.
function(kvcomp_kernels_pending_ops)
  set(defs)
  if(NOT "src/cpu/moments_cpu.cc" IN_LIST KERNELS_SRCS)
    list(APPEND defs KVCOMP_PENDING_MOMENT_OPS=1)
  endif()
  if(NOT "src/cpu/codec_cpu.cc" IN_LIST KERNELS_SRCS)
    list(APPEND defs KVCOMP_PENDING_CODEC_OPS=1)
  endif()
  if(defs)
    target_sources(kvcomp_kernels PRIVATE src/cpu/pending_ops.cc)
    set_source_files_properties(src/cpu/pending_ops.cc PROPERTIES COMPILE_DEFINITIONS "${defs}")
  endif()
endfunction()
cmake_language(DEFER CALL kvcomp_kernels_pending_ops)
# The CUDA backend (engine-CUDA). Every op group has its own CUDA factory now (issues 3, 4, 5).
list(APPEND KERNELS_CUDA_SRCS src/cuda/cuda_backend.cc)
