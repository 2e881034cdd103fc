#include "kvcomp/kernels/device_crc32c.h"

namespace kvcomp {

#if !defined(KVCOMP_HAVE_CUDA)
absl::Status DeviceCrc32c(absl::Span<const DeviceCrcRange>, void*) {
  return absl::FailedPreconditionError("DeviceCrc32c: this build has no CUDA");
}
#endif

}  // namespace kvcomp
