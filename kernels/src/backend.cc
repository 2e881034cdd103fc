#include "kvcomp/kernels/backend.h"

#include "absl/strings/str_cat.h"

namespace kvcomp {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view name) {
  if (name == "cpu") return MakeCpuBackend();
  if (name == "cuda") return MakeCudaBackend();
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", name, "' (cpu or cuda)"));
}

}  // namespace kvcomp
