// KVSplice calibration: per (layer, kv head) of one model, accumulate the second
// moment of the observed values over many caches, eigendecompose it into an orthonormal basis
// (PCA without centring: the codec reconstructs v, not v - mean), and derive the gamma-aware
// per-direction scales. The auto-tuner picks, per layer, the smallest rank whose error on the
// calibration samples meets a budget.
//
// Error measures (both relative, Frobenius, pooled over the heads of a layer):
//   value reconstruction: sqrt(sum ||v - v'||^2 / sum ||v||^2) over the sampled values;
//   attention output: sqrt(sum ||o - o'||^2 / sum ||o||^2), o = softmax(q K^T / sqrt(d)) V over
//     the sampled tokens of the head, o' the same with V' (keys are left as they are, as the
//     value codecs leave them), for sample queries: those added with AddQueries, or else the
//     sampled keys themselves as stand-ins.
//
// A Calibrator is not thread-safe. The numeric steps run on the given Backend's CodecOps
// (Eigen on CPU, cuBLAS/cuSOLVER on CUDA); inputs must be in that backend's memory space.
#ifndef KVCOMP_KERNELS_CALIBRATION_H_
#define KVCOMP_KERNELS_CALIBRATION_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

class Backend;

struct CalibrationOptions {
  std::string model_id;       // recorded in the projection
  uint32_t num_layers = 0;    // 1..KvLayout::kMaxLayers
  uint32_t num_kv_heads = 0;  // 1..KvLayout::kMaxKvHeads
  uint32_t head_dim = 0;      // 64, 128 or 256
  // Value/key vectors per head kept (reservoir sample) for the auto-tuner and error reports.
  // Default 1024. 0 disables sampling (Finish still works; AutoTune does not).
  uint32_t max_samples_per_head = 1024;
  // Query vectors per head kept for the attention-output measure. Default 256.
  uint32_t max_queries_per_head = 256;
  uint64_t seed = 0;  // reservoir sampling seed. Default 0.
};

enum class ErrorMetric : uint8_t {
  kValueReconstruction = 0,
  kAttentionOutput = 1,
};
absl::string_view ErrorMetricName(ErrorMetric m);  // "value", "attention"
absl::StatusOr<ErrorMetric> ParseErrorMetric(absl::string_view name);

// Sample vectors of one layer, f32 host, [num_kv_heads][n][head_dim] with n per head in `count`.
struct LayerSamples {
  std::vector<float> values;
  std::vector<float> keys;
  std::vector<float> queries;
  std::vector<uint32_t> count;          // samples per head (values and keys)
  std::vector<uint32_t> query_count;    // queries per head
  uint32_t capacity = 0;                // samples slots per head
  uint32_t query_capacity = 0;
};

class Calibrator {
 public:
  // `backend` must outlive the calibrator. InvalidArgument for bad options.
  static absl::StatusOr<Calibrator> Create(const CalibrationOptions& options, Backend* backend);

  // Adds one layer's values [num_kv_heads][tokens][head_dim] (any input dtype, strided views
  // allowed) and, optionally, the keys of the same tokens (same shape; needed for the attention
  // measure). May be called any number of times per layer (one call per cache).
  absl::Status AddLayer(uint32_t layer, const HeadsView& values, const HeadsView* keys = nullptr);
  // Adds sample queries of one layer: [num_kv_heads or num_q_heads][n][head_dim]; with q heads,
  // query head i belongs to kv head i / (num_q_heads / num_kv_heads).
  absl::Status AddQueries(uint32_t layer, const HeadsView& queries);

  // Value vectors seen per head of `layer` (all heads of a layer see the same count).
  uint64_t observed(uint32_t layer) const { return observed_[layer]; }
  const CalibrationOptions& options() const { return options_; }
  const LayerSamples& samples(uint32_t layer) const { return samples_[layer]; }

  // The projection keeping `rows` basis rows per head (1..head_dim), sealed. FailedPrecondition
  // when some layer has no data.
  absl::StatusOr<Projection> Finish(uint32_t rows) const;

 private:
  Calibrator() = default;
  CalibrationOptions options_;
  Backend* backend_ = nullptr;
  std::vector<double> gram_;        // [heads][d][d]
  std::vector<uint64_t> observed_;  // per layer
  std::vector<uint64_t> seen_queries_;
  std::vector<LayerSamples> samples_;
  std::mt19937_64 rng_;
};

struct TuneOptions {
  ErrorMetric metric = ErrorMetric::kValueReconstruction;
  double budget = 0.05;  // relative error a layer may not exceed, > 0. Default 0.05.
  ValueCodec codec = ValueCodec::kOrthogonalInt8;  // not kRaw
  uint32_t group_size = 32;
  bool gamma_aware = true;
  // Ranks are multiples of this; 0 = 4 (int4: 8), the column groups the CUDA expand takes whole,
  // so tuned caches decode on its fast path. Even for int4.
  uint32_t rank_step = 0;
};

struct TuneResult {
  // Full-basis projection (rows = the largest chosen rank) with tuned_rank/tuned_error filled.
  Projection projection;
  std::vector<uint32_t> rank;   // per layer
  std::vector<double> error;    // per layer, at that rank, on the calibration samples
  std::vector<bool> met;        // per layer: false when even head_dim misses the budget
  uint32_t max_rank = 0;        // what a single-rank cache must use to meet every layer
};

// Picks, per layer, the smallest rank (a multiple of TuneOptions::rank_step) whose error meets
// the budget on the calibration samples; head_dim when none does. FailedPrecondition without
// samples (max_samples_per_head 0); InvalidArgument for an odd int4 step.
absl::StatusOr<TuneResult> AutoTune(const Calibrator& calibrator, const TuneOptions& options);

// The error (ErrorMetric) per layer of encoding `samples` (one entry per layer) with `params`
// through `projection`, computed on the host by the CPU reference codec.
absl::StatusOr<std::vector<double>> MeasureError(const Projection& projection,
                                                 const ValueCodecParams& params,
                                                 ErrorMetric metric,
                                                 const std::vector<LayerSamples>& samples);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_CALIBRATION_H_
