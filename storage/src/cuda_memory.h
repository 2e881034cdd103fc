// The few CUDA runtime calls the store makes, behind functions that exist in every build: with
// CUDA they call the runtime (cuda_memory_cuda.cc), without it they report "no CUDA".
#ifndef KVCOMP_STORAGE_SRC_CUDA_MEMORY_H_
#define KVCOMP_STORAGE_SRC_CUDA_MEMORY_H_

#include <cstddef>

namespace kvcomp {
namespace storage {

// Page-locked host memory of `bytes`, or null (no CUDA, no GPU, or the allocation failed).
void* PinnedAlloc(size_t bytes);
void PinnedFree(void* p);

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_SRC_CUDA_MEMORY_H_
