// The one coder of the project's private byte encodings: the cache format (docs/format.md), the
// data-plane protocol (docs/protocol.md), the KVSplice projection file, the RocksDB tier's records
// and the projection store's keys. Integers are little-endian (this host's order: checked at compile time) except the
// big-endian forms, which keep keys that hold numbers sorted by number.
//
//   StoreLe / LoadLe    a fixed-width value at an offset of a buffer the caller sized
//   PutLe / GetLe       the low `width` bytes of a value appended to / read from a string
//   PutBe / GetBe       the same, most significant byte first
//   ByteWriter          a body appended field by field
//   ByteReader          a body read field by field, bounds-checked; the first failure sticks
//                       and names the field (DataLoss when truncated, InvalidArgument for bad
//                       content or trailing bytes), after a context ("protocol: hello")
//
// Plain functions and value types: thread-compatible.
#ifndef KVCOMP_CORE_BYTE_CODER_H_
#define KVCOMP_CORE_BYTE_CODER_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcomp {
namespace byte_coder {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the private encodings are little-endian and copied as this host's integers");

template <typename T>
void StoreLe(void* base, uint64_t offset, T v) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::memcpy(static_cast<char*>(base) + offset, &v, sizeof(T));
}
template <typename T>
T LoadLe(const void* base, uint64_t offset) {
  static_assert(std::is_trivially_copyable_v<T>);
  T v;
  std::memcpy(&v, static_cast<const char*>(base) + offset, sizeof(T));
  return v;
}

// `width` in [1, 8].
inline void PutLe(std::string* out, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline uint64_t GetLe(const char* p, int width) {
  uint64_t v = 0;
  for (int i = 0; i < width; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}
inline void PutBe(std::string* out, uint64_t v, int width) {
  for (int i = width - 1; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline uint64_t GetBe(const char* p, int width) {
  uint64_t v = 0;
  for (int i = 0; i < width; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

class ByteWriter {
 public:
  template <typename T>
  void Put(T v) {
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    StoreLe<T>(out_.data(), at, v);
  }
  void Zeros(size_t n) { out_.append(n, '\0'); }
  // u16 length + bytes; the caller bounds the length.
  void Str(absl::string_view s) {
    Put<uint16_t>(static_cast<uint16_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  void Raw(absl::string_view s) { out_.append(s.data(), s.size()); }
  // The elements' bytes, without a count.
  template <typename T>
  void Array(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  size_t size() const { return out_.size(); }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class ByteReader {
 public:
  // Errors read "<context>: <subject>: ..." (": <subject>" left out when empty); both strings
  // outlive the reader (names in static storage).
  ByteReader(absl::string_view body, absl::string_view context, absl::string_view subject = {})
      : p_(body), context_(context), subject_(subject) {}

  template <typename T>
  T Get(absl::string_view field) {
    T v{};
    if (!Need(sizeof(T), field)) return v;
    v = LoadLe<T>(p_.data(), at_);
    at_ += sizeof(T);
    return v;
  }
  // Skips `n` bytes that must be zero (reserved).
  void Skip(size_t n, absl::string_view field) {
    if (!Need(n, field)) return;
    for (size_t i = 0; i < n; ++i) {
      if (p_[at_ + i] != 0) {
        Fail(absl::InvalidArgumentError(Prefix(absl::StrCat(field, " must be zero"))));
        return;
      }
    }
    at_ += n;
  }
  // u16 length + bytes, at most `max` of them.
  std::string Str(absl::string_view field, size_t max) {
    const uint16_t n = Get<uint16_t>(field);
    if (!status_.ok()) return {};
    if (n > max) {
      Fail(absl::InvalidArgumentError(
          Prefix(absl::StrCat(field, " has ", n, " bytes, at most ", max, " allowed"))));
      return {};
    }
    return Bytes(n, field);
  }
  std::string Bytes(size_t n, absl::string_view field) {
    if (!Need(n, field)) return {};
    std::string s(p_.substr(at_, n));
    at_ += n;
    return s;
  }
  // `n` elements (no count read); empty when they do not fit in what is left.
  template <typename T>
  std::vector<T> Array(uint64_t n, absl::string_view field) {
    static_assert(std::is_trivially_copyable_v<T>);
    std::vector<T> v;
    if (!status_.ok()) return v;
    if (n > (p_.size() - at_) / sizeof(T)) {
      Need(p_.size() - at_ + 1, field);  // reports the truncation
      return v;
    }
    v.resize(n);
    if (n > 0) std::memcpy(v.data(), p_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return v;
  }
  void Fail(absl::Status s) {
    if (status_.ok()) status_ = std::move(s);
  }
  // "<context>: <subject>: <what>".
  std::string Prefix(absl::string_view what) const {
    return absl::StrCat(context_, subject_.empty() ? "" : ": ", subject_, ": ", what);
  }
  // OK when everything was read and nothing is left over.
  absl::Status Finish() {
    if (status_.ok() && at_ != p_.size()) {
      status_ = absl::InvalidArgumentError(
          Prefix(absl::StrCat(p_.size() - at_, " trailing bytes in the body")));
    }
    return status_;
  }
  bool ok() const { return status_.ok(); }
  size_t left() const { return p_.size() - at_; }

 private:
  bool Need(size_t n, absl::string_view field) {
    if (!status_.ok()) return false;
    if (p_.size() - at_ < n) {
      status_ = absl::DataLossError(Prefix(absl::StrCat("truncated body: ", field, " needs ", n,
                                                        " bytes, ", p_.size() - at_, " left")));
      return false;
    }
    return true;
  }

  absl::string_view p_;
  size_t at_ = 0;
  absl::string_view context_;
  absl::string_view subject_;
  absl::Status status_;
};

}  // namespace byte_coder
}  // namespace kvcomp

#endif  // KVCOMP_CORE_BYTE_CODER_H_
