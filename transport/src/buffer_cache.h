// The process's cache of released large host buffers (kvcomp/transport/buffer.h's
// Buffer::Allocate): buffers of 64 KiB and more are mapped from the system, unmapped when
// released beyond the cache, and the cache keeps at most a bounded number of bytes for reuse.
#ifndef KVCOMP_TRANSPORT_SRC_BUFFER_CACHE_H_
#define KVCOMP_TRANSPORT_SRC_BUFFER_CACHE_H_

#include <cstddef>

namespace kvcomp {
namespace transport {

// Keeps at most `bytes` of released buffers for reuse (default 256 MiB), unmapping what is
// cached beyond it now. Process-wide; thread-safe.
void LimitBufferCache(size_t bytes);

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_SRC_BUFFER_CACHE_H_
