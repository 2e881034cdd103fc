// Comparison switches of the kernels and the decode library: on unless the environment variable
// is "0", read once by each caller (a function-local static).
#ifndef KVCOMP_KERNELS_SRC_ENV_SWITCH_H_
#define KVCOMP_KERNELS_SRC_ENV_SWITCH_H_

#include <cstdlib>
#include <cstring>

namespace kvcomp {
namespace internal {

inline bool SwitchOn(const char* env_name) {
  const char* env = std::getenv(env_name);
  return env == nullptr || std::strcmp(env, "0") != 0;
}

}  // namespace internal
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_ENV_SWITCH_H_
