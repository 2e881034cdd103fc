// Internal factories of the CPU backend's op groups. backend.cc builds one CpuContext per
// Backend and hands it to each factory; the op groups keep the pointer (the context outlives
// them) and use its pool for parallel loops and its allocator for workspace.
//
//   scoring: cpu/scoring_cpu.cc   moments: cpu/moments_cpu.cc
//   codec:   cpu/codec_cpu.cc
#ifndef KVCOMP_KERNELS_SRC_CPU_CPU_OPS_H_
#define KVCOMP_KERNELS_SRC_CPU_CPU_OPS_H_

#include <cstddef>
#include <functional>
#include <memory>

#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "thread_pool.h"

namespace kvcomp {

struct CpuContext {
  ThreadPool* pool = nullptr;      // not owned; never null in a backend
  Allocator* allocator = nullptr;  // host memory; never null in a backend
  int num_threads() const { return pool->num_threads(); }
  // fn(i) for i in [0, n) over the pool; returns when all are done.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn) const {
    pool->ParallelFor(n, fn);
  }
};

std::unique_ptr<ScoringOps> NewCpuScoringOps(CpuContext* context);
std::unique_ptr<MomentOps> NewCpuMomentOps(CpuContext* context);
std::unique_ptr<CodecOps> NewCpuCodecOps(CpuContext* context);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CPU_CPU_OPS_H_
