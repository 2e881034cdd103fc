# Tests (included from tests/kernels/CMakeLists.txt): the fp16 key codec's range check, on the
# CPU and (gpu label) on device keys against it.
kvcomp_cc_test(NAME kernels_fp16_range_test SRCS fp16_range_test.cc DEPS kvcomp::kernels kvcomp::core)
kvcomp_cc_test(NAME kernels_fp16_range_gpu_test SRCS fp16_range_gpu_test.cc
               DEPS kvcomp::kernels kvcomp::core LABELS gpu)
