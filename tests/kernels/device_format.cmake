# Tests (included from tests/kernels/CMakeLists.txt): CRC32C of device memory, the format
# written on the device.
kvcomp_cc_test(NAME kernels_crc32c_combine_test SRCS crc32c_combine_test.cc
               DEPS kvcomp::kernels kvcomp::core)
kvcomp_cc_test(NAME kernels_device_crc32c_test SRCS device_crc32c_test.cc
               DEPS kvcomp::kernels kvcomp::core LABELS gpu)
# The same with each CRC kernel for every call (KVCOMP_CRC_WIDE=1: the wide kernel, which
# the default takes only for calls of a block per multiprocessor or more; =0: slicing-by-16).
add_test(NAME kernels_device_crc32c_wide_test COMMAND kernels_device_crc32c_test)
set_tests_properties(kernels_device_crc32c_wide_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 ENVIRONMENT KVCOMP_CRC_WIDE=1)
add_test(NAME kernels_device_crc32c_narrow_test COMMAND kernels_device_crc32c_test)
set_tests_properties(kernels_device_crc32c_narrow_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 ENVIRONMENT KVCOMP_CRC_WIDE=0)
kvcomp_cc_test(NAME kernels_device_format_test SRCS device_format_test.cc
               DEPS kvcomp::kernels kvcomp::core LABELS gpu)
# The same with an eviction's section CRCs computed beside the compression
# (KVCOMP_FORMAT_CRC_BESIDE=1), and with the sections copied (KVCOMP_FORMAT_IN_PLACE=0).
add_test(NAME kernels_device_format_crc_beside_test COMMAND kernels_device_format_test)
set_tests_properties(kernels_device_format_crc_beside_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 ENVIRONMENT KVCOMP_FORMAT_CRC_BESIDE=1)
add_test(NAME kernels_device_format_copied_test COMMAND kernels_device_format_test)
set_tests_properties(kernels_device_format_copied_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 ENVIRONMENT KVCOMP_FORMAT_IN_PLACE=0)
# The copied sections with the wide CRC kernel for every call (the test's caches are small).
add_test(NAME kernels_device_format_copied_wide_test COMMAND kernels_device_format_test)
set_tests_properties(kernels_device_format_copied_wide_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300
  ENVIRONMENT "KVCOMP_FORMAT_IN_PLACE=0;KVCOMP_CRC_WIDE=1")
