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
