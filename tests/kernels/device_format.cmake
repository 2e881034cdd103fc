# Tests (included from tests/kernels/CMakeLists.txt): CRC32C of device memory, the format
# written on the device.
kvcomp_cc_test(NAME kernels_crc32c_combine_test SRCS crc32c_combine_test.cc
               DEPS kvcomp::kernels kvcomp::core)
kvcomp_cc_test(NAME kernels_device_crc32c_test SRCS device_crc32c_test.cc
               DEPS kvcomp::kernels kvcomp::core LABELS gpu)
kvcomp_cc_test(NAME kernels_device_format_test SRCS device_format_test.cc
               DEPS kvcomp::kernels kvcomp::core LABELS gpu)
