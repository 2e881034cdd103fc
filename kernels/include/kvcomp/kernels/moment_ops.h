// MomentOps: the operations of Engine II (issue 4) behind kvcomp::Backend.
#ifndef KVCOMP_KERNELS_MOMENT_OPS_H_
#define KVCOMP_KERNELS_MOMENT_OPS_H_

#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

class MomentOps {
 public:
  virtual ~MomentOps() = default;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_MOMENT_OPS_H_
