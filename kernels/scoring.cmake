# Sources of this concern: list(APPEND KERNELS_SRCS ...), list(APPEND KERNELS_CUDA_SRCS ...).
# scoring, budgets, selection and compaction (CPU), and the pipeline.
list(APPEND KERNELS_SRCS
  src/scoring_ops.cc
  src/cpu/scoring_cpu.cc
  src/cpu/scoring_kernels_generic.cc
  src/pipeline.cc
  src/pipeline_block.cc
  src/pipeline_stages.cc
  src/pipeline_device.cc
)
# The AVX2+FMA+F16C build of the row kernels, chosen at run time on CPUs that have them.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  list(APPEND KERNELS_SRCS src/cpu/scoring_kernels_avx2.cc)
  set_source_files_properties(src/cpu/scoring_kernels_avx2.cc PROPERTIES
    COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-O3;-ffp-contract=fast")
  # The AVX-512 build beside it, chosen first on CPUs with AVX-512F (GCC 12 warns about its own
  # _mm512_undefined_* in the intrinsics headers, hence -Wno-maybe-uninitialized).
  list(APPEND KERNELS_SRCS src/cpu/scoring_kernels_avx512.cc)
  set_source_files_properties(src/cpu/scoring_kernels_avx512.cc PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx2;-mfma;-mf16c;-O3;-ffp-contract=fast;-Wno-uninitialized;-Wno-maybe-uninitialized")
  set_source_files_properties(src/cpu/scoring_kernels_generic.cc PROPERTIES
    COMPILE_DEFINITIONS "KVCOMP_HAVE_AVX2_KERNELS=1;KVCOMP_HAVE_AVX512_KERNELS=1"
    COMPILE_OPTIONS "-O3")
endif()
list(APPEND KERNELS_HDRS kvcomp/kernels/pipeline.h)
# CUDA scoring, selection and compaction (engine-CUDA).
list(APPEND KERNELS_CUDA_SRCS src/cuda/scoring_cuda.cu)
# The device side of the whole-sequence pipeline (evicted lists on the device).
list(APPEND KERNELS_CUDA_SRCS src/pipeline_device.cu)
