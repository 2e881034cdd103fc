// KVSplice projections: for every (layer, kv head) of one model, an
// orthonormal basis of the value space from the PCA of calibration values, kept as the `rows`
// leading eigenvectors (descending eigenvalue), their eigenvalues, and the per-direction scales
// of gamma-aware quantization. A cache encoded with rank r uses the first r rows of each head.
//
// Versions: a projection's version is a 64-bit fingerprint of its content (never 0), so a
// recalibration that changes anything makes a new version, and every encoded cache names the
// version it was encoded with (CompressedCache::projection_version). ProjectionStore keeps
// projections by (model, version); decoding a cache whose version the store lacks is NotFound.
//
// Projection is a value type (copyable; const access from many threads is fine).
#ifndef KVCOMP_KERNELS_PROJECTION_H_
#define KVCOMP_KERNELS_PROJECTION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace kvcomp {

struct Projection {
  std::string model_id;      // the model the calibration data came from (may be empty)
  uint64_t version = 0;      // content fingerprint; set by Seal(), 0 until then
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t rows = 0;         // basis rows stored per head, 1..head_dim (the largest usable rank)
  uint64_t samples = 0;      // value vectors per head the calibration saw (informational)

  // [num_layers * num_kv_heads][rows][head_dim], f32, orthonormal rows per head, head index
  // layer * num_kv_heads + kv_head.
  std::vector<float> basis;
  // [heads][head_dim]: all eigenvalues of the value second moment E[v v^T], descending.
  std::vector<float> eigenvalues;
  // [heads][rows]: gamma-aware scale of each direction, sqrt(eigenvalue) floored at
  // kGammaFloor * sqrt(largest eigenvalue) of the head. Quantized codecs with gamma_aware divide
  // the latent by it before quantizing and multiply it back when decoding.
  std::vector<float> gamma;
  // Per layer: the rank the auto-tuner chose (0 = not tuned), and the error it measured on the
  // calibration data for that rank (relative, see calibration.h).
  std::vector<uint32_t> tuned_rank;
  std::vector<double> tuned_error;

  static constexpr float kGammaFloor = 1e-3f;

  uint64_t num_heads() const { return uint64_t{num_layers} * num_kv_heads; }
  const float* head_basis(uint64_t h) const { return basis.data() + h * rows * head_dim; }
  const float* head_gamma(uint64_t h) const { return gamma.data() + h * rows; }
  // Largest tuned rank over the layers (0 if not tuned).
  uint32_t MaxTunedRank() const;

  // Checks sizes against the shape fields and that the numbers are finite. InvalidArgument.
  absl::Status Validate() const;
  // Recomputes `version` from the content (validating first).
  absl::Status Seal();
  // A copy keeping only the first `rank` rows of every head (rank <= rows), resealed.
  absl::StatusOr<Projection> Truncated(uint32_t rank) const;

  // Self-describing little-endian bytes with a checksum ("KVPJ" magic, format 1).
  std::string Serialize() const;
  // Parses Serialize()'s output; DataLoss on checksum or truncation, InvalidArgument otherwise.
  static absl::StatusOr<Projection> Parse(absl::string_view bytes);

  std::string DebugString() const;
};

// Where projections live between calibration and decoding. The storage component provides a
// persistent implementation; InMemoryProjectionStore serves tests, the CLI and embedded use.
// Implementations are thread-safe.
class ProjectionStore {
 public:
  virtual ~ProjectionStore() = default;
  // Stores a sealed projection (InvalidArgument if version is 0). Storing the same version
  // again is a no-op.
  virtual absl::Status Put(const Projection& projection) = 0;
  // NotFound naming the model and version when it is not there.
  virtual absl::StatusOr<std::shared_ptr<const Projection>> Get(absl::string_view model_id,
                                                                uint64_t version) = 0;
  // The most recently stored version of a model, NotFound if none.
  virtual absl::StatusOr<uint64_t> Latest(absl::string_view model_id) = 0;
  // Removes one version (callers keep it while any stored cache names it). NotFound if absent.
  virtual absl::Status Delete(absl::string_view model_id, uint64_t version) = 0;
};

class InMemoryProjectionStore : public ProjectionStore {
 public:
  absl::Status Put(const Projection& projection) override;
  absl::StatusOr<std::shared_ptr<const Projection>> Get(absl::string_view model_id,
                                                        uint64_t version) override;
  absl::StatusOr<uint64_t> Latest(absl::string_view model_id) override;
  absl::Status Delete(absl::string_view model_id, uint64_t version) override;

 private:
  struct Entry {
    std::shared_ptr<const Projection> projection;
    uint64_t sequence = 0;
  };
  absl::Mutex mu_;
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<std::string, absl::flat_hash_map<uint64_t, Entry>> models_
      ABSL_GUARDED_BY(mu_);
};

// NotFound status for a cache naming a projection that is not available.
absl::Status MissingProjectionError(absl::string_view model_id, uint64_t version);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_PROJECTION_H_
