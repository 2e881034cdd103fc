// ScoringOps: the operations of Engine I (issue 3) behind kvcomp::Backend.
#ifndef KVCOMP_KERNELS_SCORING_OPS_H_
#define KVCOMP_KERNELS_SCORING_OPS_H_

#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

class ScoringOps {
 public:
  virtual ~ScoringOps() = default;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SCORING_OPS_H_
