# Issue 4 tests (included from tests/kernels/CMakeLists.txt).
kvcomp_cc_test(NAME kernels_moments_test SRCS moments_test.cc DEPS kvcomp::kernels)
