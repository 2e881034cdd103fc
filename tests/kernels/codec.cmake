# Tests (included from tests/kernels/CMakeLists.txt): KVSplice codec and calibration.
kvcomp_cc_test(NAME kernels_codec_test SRCS codec_test.cc DEPS kvcomp::kernels kvcomp::core)
kvcomp_cc_test(NAME kernels_calibration_test SRCS calibration_test.cc DEPS kvcomp::kernels)
# The CUDA codec kernels' work lists (host code, so it runs without a GPU).
kvcomp_cc_test(NAME kernels_codec_tiles_test SRCS codec_tiles_test.cc DEPS kvcomp::kernels)
target_include_directories(kernels_codec_tiles_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/src)
if(KVCOMP_CUDA)
  kvcomp_cc_test(NAME kernels_codec_cuda_test SRCS codec_cuda_test.cc DEPS kvcomp::kernels
                 LABELS gpu)
  # The same with the WMMA expand in place of the pipelined one (KVCOMP_CUDA_EXPAND=0).
  add_test(NAME kernels_codec_cuda_wmma_test COMMAND kernels_codec_cuda_test)
  set_tests_properties(kernels_codec_cuda_wmma_test PROPERTIES
    LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 ENVIRONMENT KVCOMP_CUDA_EXPAND=0)
  # The Hadamard codec's CUDA encoder and decoder against the CPU reference, bit for bit.
  kvcomp_cc_test(NAME kernels_hq_cuda_test SRCS hq_cuda_test.cc DEPS kvcomp::kernels
                 LABELS gpu)
endif()
# CompressToDevice (codecs, moments, moment-aware rescoring on the device) against the CPU.
kvcomp_cc_test(NAME kernels_pipeline_device_test SRCS pipeline_device_test.cc DEPS kvcomp::kernels
               LABELS gpu)
# The same with the two-pass moment stage (the scoring op's compaction, then a gather of the
# evicted rows), which KVCOMP_FUSED_MOMENTS=0 selects.
add_test(NAME kernels_pipeline_device_two_pass_test COMMAND kernels_pipeline_device_test)
set_tests_properties(kernels_pipeline_device_two_pass_test PROPERTIES
  LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 ENVIRONMENT KVCOMP_FUSED_MOMENTS=0)
if(KVCOMP_CUDA)
  # The calibrated basis codec's CUDA encoder and decoder against the CPU, byte and bit for bit.
  kvcomp_cc_test(NAME kernels_pq_cuda_test SRCS pq_cuda_test.cc DEPS kvcomp::kernels
                 LABELS gpu)
endif()
