# Tests (included from tests/kernels/CMakeLists.txt).
kvcomp_cc_test(NAME kernels_scoring_cpu_test SRCS scoring_cpu_test.cc DEPS kvcomp::kernels)
kvcomp_cc_test(NAME kernels_scoring_errors_test SRCS scoring_errors_test.cc DEPS kvcomp::kernels)
kvcomp_cc_test(NAME kernels_scoring_conformance_test SRCS scoring_conformance_test.cc
               DEPS kvcomp::kernels)
kvcomp_cc_test(NAME kernels_pipeline_test SRCS pipeline_test.cc DEPS kvcomp::kernels)
kvcomp_cc_test(NAME kernels_scoring_conformance_gpu_test SRCS scoring_conformance_gpu_test.cc
               DEPS kvcomp::kernels LABELS gpu)
# The same with the tiled selection in place of the cluster selection
# (KVCOMP_CUDA_CLUSTER_SELECT=0; streaming through its score pass and selection too,
# KVCOMP_CUDA_STREAMING_ENDS=0), and with the cluster selection for short heads too
# (KVCOMP_CUDA_SHORT_SELECT_MAX_TOKENS=0).
add_test(NAME kernels_scoring_conformance_gpu_nocluster_test
         COMMAND kernels_scoring_conformance_gpu_test)
set_tests_properties(kernels_scoring_conformance_gpu_nocluster_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 600
  ENVIRONMENT "KVCOMP_CUDA_CLUSTER_SELECT=0;KVCOMP_CUDA_STREAMING_ENDS=0")
add_test(NAME kernels_scoring_conformance_gpu_cluster_test
         COMMAND kernels_scoring_conformance_gpu_test)
set_tests_properties(kernels_scoring_conformance_gpu_cluster_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 600 ENVIRONMENT KVCOMP_CUDA_SHORT_SELECT_MAX_TOKENS=0)
# engine-CUDA's own tests: the CUDA-runtime parts compile only in CUDA builds; without a device
# (or without CUDA) the binary reports skipped (77).
kvcomp_cc_test(NAME kernels_scoring_cuda_test SRCS scoring_cuda_test.cc DEPS kvcomp::kernels
               LABELS gpu)
# The scorers given the keys' sums, and the run-time builds of the row kernels and of the dense
# products (internal headers).
kvcomp_cc_test(NAME kernels_scoring_key_sums_test SRCS scoring_key_sums_test.cc
               DEPS kvcomp::kernels)
target_include_directories(kernels_scoring_key_sums_test PRIVATE
                           ${PROJECT_SOURCE_DIR}/kernels/src/cpu)
# The wide builds of the dense products exist where kernels/moments.cmake builds them.
if(TARGET Eigen3::Eigen AND CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" AND
   CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_definitions(kernels_scoring_key_sums_test PRIVATE KVCOMP_HAVE_WIDE_GEMM=1)
endif()
# How the CUDA selection in shared memory splits a head (host code, so it runs without a GPU).
kvcomp_cc_test(NAME kernels_select_plan_test SRCS select_plan_test.cc DEPS kvcomp::kernels)
target_include_directories(kernels_select_plan_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/src)
