// GoogleTest main shared by kvcomp's tests. A test binary run with --gpu_required... is not
// needed: GPU tests call kvcomp::testing::RequireGpuOrSkip() which exits 77 (ctest: skipped).
#include "gtest/gtest.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
