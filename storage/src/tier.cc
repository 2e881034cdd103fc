#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cuda_memory.h"
#include "kvcomp/core/status.h"
#include "kvcomp/storage/tier.h"

namespace kvcomp {
namespace storage {

absl::StatusOr<uint64_t> Tier::ReadInto(absl::string_view key, const DeviceTarget& target) {
  KVCOMP_ASSIGN_OR_RETURN(Payload p, Get(key));
  if (p.size() > target.capacity) {
    return absl::OutOfRangeError(absl::StrCat("read into device memory: the cache has ", p.size(),
                                              " bytes, the target ", target.capacity));
  }
  KVCOMP_RETURN_IF_ERROR(CopyToDeviceTarget(target, p.data(), p.size()));
  return p.size();
}

}  // namespace storage
}  // namespace kvcomp
