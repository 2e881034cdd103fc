// The benchmarks' projection: an orthonormal basis that costs nothing to build (permuted unit
// vectors per head), gamma decaying by 0.97 per direction. Shared by the CPU and GPU codec
// benchmarks so both time the same arithmetic.
#ifndef KVCOMP_BENCH_CODEC_BENCH_PROJECTION_H_
#define KVCOMP_BENCH_CODEC_BENCH_PROJECTION_H_

#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "kvcomp/kernels/projection.h"

namespace kvcomp {
namespace bench {

inline Projection MakeBenchProjection(uint32_t heads, uint32_t d) {
  Projection p;
  p.model_id = "bench";
  p.num_layers = heads;
  p.num_kv_heads = 1;
  p.head_dim = d;
  p.rows = d;
  p.basis.assign(uint64_t{heads} * d * d, 0.0f);
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint32_t j = 0; j < d; ++j) {
      p.basis[(uint64_t{h} * d + j) * d + (j * 7 + h) % d] = 1.0f;  // 7 is coprime with d
      p.gamma.push_back(std::pow(0.97f, static_cast<float>(j)));
    }
    for (uint32_t j = 0; j < d; ++j) p.eigenvalues.push_back(1.0f);
  }
  if (!p.Seal().ok()) std::abort();
  return p;
}

}  // namespace bench
}  // namespace kvcomp

#endif  // KVCOMP_BENCH_CODEC_BENCH_PROJECTION_H_
