#include "kvcomp/storage/types.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>

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
