# Tests (included from tests/kernels/CMakeLists.txt).
kvcomp_cc_test(NAME kernels_moments_test SRCS moments_test.cc DEPS kvcomp::kernels)
kvcomp_cc_test(NAME kernels_moments_cuda_test SRCS moments_cuda_test.cc DEPS kvcomp::kernels
               LABELS gpu)
target_include_directories(kernels_moments_cuda_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/src)
kvcomp_cc_test(NAME kernels_moments_aware_test SRCS moments_aware_test.cc DEPS kvcomp::kernels)
target_include_directories(kernels_moments_aware_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/src)
# How the CUDA attention and moment kernels split heads into chunks (host code, no GPU needed).
kvcomp_cc_test(NAME kernels_chunk_plan_test SRCS chunk_plan_test.cc DEPS kvcomp::kernels)
target_include_directories(kernels_chunk_plan_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/src)
# The moment-aware rescoring with heads of more than one 8192-token tile ranked by the device
# sort instead of the tiles and their merge (KVCOMP_RESCORE_TILED_RANKS=0), and with the
# provisional eviction's select matching every lane's digit (KVCOMP_RESCORE_SELECT_MATCH=1): the
# comparison paths.
add_test(NAME kernels_moments_cuda_device_sort_test
         COMMAND kernels_moments_cuda_test --gtest_filter=*MomentAwareRescore*)
set_tests_properties(kernels_moments_cuda_device_sort_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 ENVIRONMENT KVCOMP_RESCORE_TILED_RANKS=0)
add_test(NAME kernels_moments_cuda_select_match_test
         COMMAND kernels_moments_cuda_test --gtest_filter=*MomentAwareRescore*)
set_tests_properties(kernels_moments_cuda_select_match_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 ENVIRONMENT KVCOMP_RESCORE_SELECT_MATCH=1)
