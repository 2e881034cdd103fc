// CodecOps: the operations of Engine III (issue 5) behind kvcomp::Backend.
#ifndef KVCOMP_KERNELS_CODEC_OPS_H_
#define KVCOMP_KERNELS_CODEC_OPS_H_

#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

class CodecOps {
 public:
  virtual ~CodecOps() = default;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_CODEC_OPS_H_
