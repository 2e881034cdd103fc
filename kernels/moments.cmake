# Sources of this concern: list(APPEND KERNELS_SRCS ...), list(APPEND KERNELS_CUDA_SRCS ...).
# MomentKV summaries, compaction with summary, corrected decode attention.
list(APPEND KERNELS_SRCS
  src/cpu/moments_cpu.cc
  src/cpu/attention_cpu.cc
)
if(TARGET Eigen3::Eigen)
  # The CPU tiles' dense products go through Eigen's GEMM (gemm_kernels_*.cc); a plain loop
  # otherwise. On x86-64 they are also built for AVX2+FMA and AVX-512 (Eigen's namespace renamed
  # in each), chosen at run time with the row kernels.
  list(APPEND KERNELS_SRCS src/cpu/gemm_kernels_generic.cc)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    list(APPEND KERNELS_SRCS src/cpu/gemm_kernels_avx2.cc src/cpu/gemm_kernels_avx512.cc)
    set_source_files_properties(src/cpu/gemm_kernels_avx2.cc PROPERTIES
      COMPILE_DEFINITIONS "KVCOMP_EIGEN_NS=kvcomp_eigen_avx2"
      COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-O3")
    set_source_files_properties(src/cpu/gemm_kernels_avx512.cc PROPERTIES
      COMPILE_DEFINITIONS "KVCOMP_EIGEN_NS=kvcomp_eigen_avx512"
      COMPILE_OPTIONS "-mavx512f;-mavx512dq;-mavx2;-mfma;-mf16c;-O3;-Wno-uninitialized;-Wno-maybe-uninitialized")
    set_source_files_properties(src/cpu/moments_cpu.cc PROPERTIES COMPILE_DEFINITIONS
                                "KVCOMP_HAVE_EIGEN=1;KVCOMP_HAVE_WIDE_GEMM=1")
  else()
    set_source_files_properties(src/cpu/moments_cpu.cc PROPERTIES COMPILE_DEFINITIONS
                                KVCOMP_HAVE_EIGEN=1)
  endif()
endif()
list(APPEND KERNELS_CUDA_SRCS src/cuda/moments_cuda.cu)
list(APPEND KERNELS_SRCS src/cpu/moments_aware.cc)
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  # The rescoring's f64 sums one IEEE operation a step, as the device computes them (no fma).
  set_source_files_properties(src/cpu/moments_aware.cc PROPERTIES COMPILE_OPTIONS
                              "-ffp-contract=off")
endif()
list(APPEND KERNELS_CUDA_SRCS src/cuda/moments_aware.cu)  # the rescoring on the device
