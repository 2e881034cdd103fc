#include "kvcomp/storage/types.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcomp {
namespace storage {

const char* TierName(TierKind kind) {
  switch (kind) {
    case TierKind::kDevice:
      return "device";
    case TierKind::kHost:
      return "host";
    case TierKind::kRocksDb:
      return "rocksdb";
  }
  return "unknown";
}

Payload Payload::FromString(std::string bytes) {
  auto holder = std::make_shared<std::string>(std::move(bytes));
  const size_t n = holder->size();
  // Aliasing constructor: the pointer is into the string, ownership is the string's.
  std::shared_ptr<const uint8_t> data(holder, reinterpret_cast<const uint8_t*>(holder->data()));
  return Payload(std::move(data), n);
}

absl::StatusOr<std::shared_ptr<uint8_t>> Payload::NewHostBuffer(size_t size) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = (std::max<size_t>(size, 1) + kHuge - 1) / kHuge * kHuge;
  void* raw = nullptr;
  if (posix_memalign(&raw, kHuge, bytes) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no host memory for ", size, " bytes of a cache"));
  }
#if defined(__linux__)
  madvise(raw, bytes, MADV_HUGEPAGE);
#endif
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(raw), [](uint8_t* p) { std::free(p); });
}

Payload Payload::Copy(absl::string_view bytes) {
  std::shared_ptr<uint8_t> data(new uint8_t[bytes.size() > 0 ? bytes.size() : 1],
                                std::default_delete<uint8_t[]>());
  if (!bytes.empty()) std::memcpy(data.get(), bytes.data(), bytes.size());
  return Payload(std::move(data), bytes.size());
}

Payload Payload::OnDevice(DeviceBytes bytes) {
  Payload p;
  p.size_ = bytes.size;
  p.device_ = std::make_shared<const DeviceBytes>(std::move(bytes));
  return p;
}

}  // namespace storage
}  // namespace kvcomp
