#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvcomp/core/byte_coder.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/projection.h"

namespace kvcomp {
namespace {

constexpr uint32_t kProjMagic = 0x4A50564B;  // "KVPJ" in file order
constexpr uint32_t kProjFormat = 1;
constexpr uint32_t kMaxModelId = 4096;

using byte_coder::ByteReader;
using byte_coder::ByteWriter;

// The serialized body without the checksum, with `version` as given.
std::string Body(const Projection& p, uint64_t version) {
  ByteWriter w;
  w.Put<uint32_t>(kProjMagic);
  w.Put<uint32_t>(kProjFormat);
  w.Put<uint64_t>(version);
  w.Put<uint32_t>(p.num_layers);
  w.Put<uint32_t>(p.num_kv_heads);
  w.Put<uint32_t>(p.head_dim);
  w.Put<uint32_t>(p.rows);
  w.Put<uint64_t>(p.samples);
  w.Put<uint32_t>(static_cast<uint32_t>(p.model_id.size()));
  w.Raw(p.model_id);
  w.Array(p.basis);
  w.Array(p.eigenvalues);
  w.Array(p.gamma);
  w.Put<uint32_t>(static_cast<uint32_t>(p.tuned_rank.size()));
  w.Array(p.tuned_rank);
  w.Array(p.tuned_error);
  return w.Take();
}

uint64_t Fingerprint(absl::string_view bytes) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h == 0 ? 1 : h;
}

bool AllFinite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

uint32_t Projection::MaxTunedRank() const {
  uint32_t m = 0;
  for (uint32_t r : tuned_rank) m = std::max(m, r);
  return m;
}

absl::Status Projection::Validate() const {
  KvLayout l;
  l.num_layers = num_layers;
  l.num_kv_heads = num_kv_heads;
  l.num_q_heads = num_kv_heads;
  l.head_dim = head_dim;
  l.dtype = DType::kF32;
  KVCOMP_RETURN_IF_ERROR(Annotate(l.Validate(), "projection"));
  if (rows == 0 || rows > head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("projection: rows %u outside [1, head_dim %u]", rows, head_dim));
  }
  if (model_id.size() > kMaxModelId) {
    return absl::InvalidArgumentError("projection: model id longer than 4096 bytes");
  }
  const uint64_t h = num_heads();
  if (basis.size() != h * rows * head_dim || eigenvalues.size() != h * head_dim ||
      gamma.size() != h * rows) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "projection: array sizes (basis %u, eigenvalues %u, gamma %u) do not match %u heads x "
        "%u rows x dim %u",
        basis.size(), eigenvalues.size(), gamma.size(), h, rows, head_dim));
  }
  if (!tuned_rank.empty() || !tuned_error.empty()) {
    if (tuned_rank.size() != num_layers || tuned_error.size() != num_layers) {
      return absl::InvalidArgumentError("projection: tuned ranks/errors need one per layer");
    }
    for (uint32_t r : tuned_rank) {
      if (r > head_dim) return absl::InvalidArgumentError("projection: tuned rank > head_dim");
    }
  }
  if (!AllFinite(basis) || !AllFinite(eigenvalues) || !AllFinite(gamma)) {
    return absl::InvalidArgumentError("projection: non-finite numbers");
  }
  for (float g : gamma) {
    if (!(g > 0.0f)) return absl::InvalidArgumentError("projection: gamma must be positive");
  }
  return absl::OkStatus();
}

absl::Status Projection::Seal() {
  KVCOMP_RETURN_IF_ERROR(Validate());
  version = Fingerprint(Body(*this, 0));
  return absl::OkStatus();
}

absl::StatusOr<Projection> Projection::Truncated(uint32_t rank) const {
  KVCOMP_RETURN_IF_ERROR(Validate());
  if (rank == 0 || rank > rows) {
    return absl::InvalidArgumentError(
        absl::StrFormat("projection: cannot keep %u of %u rows", rank, rows));
  }
  Projection t = *this;
  t.rows = rank;
  t.basis.clear();
  t.gamma.clear();
  for (uint64_t h = 0; h < num_heads(); ++h) {
    t.basis.insert(t.basis.end(), head_basis(h), head_basis(h) + uint64_t{rank} * head_dim);
    t.gamma.insert(t.gamma.end(), head_gamma(h), head_gamma(h) + rank);
  }
  KVCOMP_RETURN_IF_ERROR(t.Seal());
  return t;
}

std::string Projection::Serialize() const {
  std::string out = Body(*this, version);
  const uint32_t crc = Crc32c(reinterpret_cast<const uint8_t*>(out.data()), out.size());
  byte_coder::PutLe(&out, crc, sizeof(crc));
  return out;
}

absl::StatusOr<Projection> Projection::Parse(absl::string_view bytes) {
  if (bytes.size() < 8) return absl::DataLossError("projection: truncated");
  if (byte_coder::LoadLe<uint32_t>(bytes.data(), 0) != kProjMagic) {
    return absl::InvalidArgumentError("projection: bad magic (not a kvcomp projection)");
  }
  const absl::string_view body = bytes.substr(0, bytes.size() - 4);
  if (Crc32c(reinterpret_cast<const uint8_t*>(body.data()), body.size()) !=
      byte_coder::LoadLe<uint32_t>(bytes.data(), body.size())) {
    return absl::DataLossError("projection: checksum mismatch");
  }
  ByteReader r(body, "projection");
  Projection p;
  r.Get<uint32_t>("magic");
  const uint32_t format = r.Get<uint32_t>("format");
  if (r.ok() && format != kProjFormat) {
    return absl::FailedPreconditionError(
        absl::StrFormat("projection: format %u unknown to this reader (%u)", format, kProjFormat));
  }
  p.version = r.Get<uint64_t>("version");
  p.num_layers = r.Get<uint32_t>("num_layers");
  p.num_kv_heads = r.Get<uint32_t>("num_kv_heads");
  p.head_dim = r.Get<uint32_t>("head_dim");
  p.rows = r.Get<uint32_t>("rows");
  p.samples = r.Get<uint64_t>("samples");
  const uint32_t id_len = r.Get<uint32_t>("model id length");
  if (r.ok() && id_len > kMaxModelId) {
    return absl::InvalidArgumentError("projection: model id too long");
  }
  p.model_id = r.Bytes(id_len, "model id");
  if (r.ok() && (p.num_layers > KvLayout::kMaxLayers || p.num_kv_heads > KvLayout::kMaxKvHeads ||
                 p.head_dim > 256 || p.rows > p.head_dim)) {
    return absl::InvalidArgumentError("projection: shape out of range");
  }
  const uint64_t h = p.num_heads();
  p.basis = r.Array<float>(h * p.rows * p.head_dim, "basis");
  p.eigenvalues = r.Array<float>(h * p.head_dim, "eigenvalues");
  p.gamma = r.Array<float>(h * p.rows, "gamma");
  const uint32_t tuned = r.Get<uint32_t>("tuned ranks");
  if (r.ok() && tuned != 0 && tuned != p.num_layers) {
    return absl::InvalidArgumentError("projection: tuned ranks need one per layer");
  }
  p.tuned_rank = r.Array<decltype(p.tuned_rank)::value_type>(tuned, "tuned ranks");
  p.tuned_error = r.Array<decltype(p.tuned_error)::value_type>(tuned, "tuned errors");
  KVCOMP_RETURN_IF_ERROR(r.Finish());
  KVCOMP_RETURN_IF_ERROR(p.Validate());
  if (p.version != Fingerprint(Body(p, 0))) {
    return absl::DataLossError("projection: version does not match the content");
  }
  return p;
}

std::string Projection::DebugString() const {
  return absl::StrFormat(
      "Projection{model=%s version=%016x layers=%u kv_heads=%u head_dim=%u rows=%u samples=%u "
      "tuned_max_rank=%u}",
      model_id, version, num_layers, num_kv_heads, head_dim, rows, samples, MaxTunedRank());
}

absl::Status MissingProjectionError(absl::string_view model_id, uint64_t version) {
  return absl::NotFoundError(absl::StrFormat(
      "projection %016x of model '%s' is not available: the cache was encoded with it and cannot "
      "be decoded without it (was it deleted, or calibrated on another node?)",
      version, model_id));
}

absl::Status InMemoryProjectionStore::Put(const Projection& projection) {
  if (projection.version == 0) {
    return absl::InvalidArgumentError("projection store: projection is not sealed (version 0)");
  }
  KVCOMP_RETURN_IF_ERROR(projection.Validate());
  absl::MutexLock lock(&mu_);
  auto& versions = models_[projection.model_id];
  auto it = versions.find(projection.version);
  if (it != versions.end()) return absl::OkStatus();
  versions[projection.version] =
      Entry{std::make_shared<const Projection>(projection), next_sequence_++};
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Projection>> InMemoryProjectionStore::Get(
    absl::string_view model_id, uint64_t version) {
  absl::MutexLock lock(&mu_);
  auto m = models_.find(model_id);
  if (m != models_.end()) {
    auto v = m->second.find(version);
    if (v != m->second.end()) return v->second.projection;
  }
  return MissingProjectionError(model_id, version);
}

absl::StatusOr<uint64_t> InMemoryProjectionStore::Latest(absl::string_view model_id) {
  absl::MutexLock lock(&mu_);
  auto m = models_.find(model_id);
  uint64_t best = 0, best_seq = 0;
  if (m != models_.end()) {
    for (const auto& [version, entry] : m->second) {
      if (entry.sequence > best_seq) {
        best_seq = entry.sequence;
        best = version;
      }
    }
  }
  if (best == 0) {
    return absl::NotFoundError(absl::StrCat("no projection calibrated for model '", model_id, "'"));
  }
  return best;
}

absl::Status InMemoryProjectionStore::Delete(absl::string_view model_id, uint64_t version) {
  absl::MutexLock lock(&mu_);
  auto m = models_.find(model_id);
  if (m == models_.end() || m->second.erase(version) == 0) {
    return MissingProjectionError(model_id, version);
  }
  return absl::OkStatus();
}

}  // namespace kvcomp
