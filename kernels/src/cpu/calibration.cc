#include "kvcomp/kernels/calibration.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "codec_cpu_internal.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"

namespace kvcomp {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

absl::Status CheckView(const HeadsView& v, uint32_t heads, uint32_t head_dim,
                       absl::string_view what) {
  if (v.num_heads != heads || v.head_dim != head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "calibration: %s view has %u heads of dim %u, expected %u of dim %u", what, v.num_heads,
        v.head_dim, heads, head_dim));
  }
  if (!IsInputDType(v.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("calibration: %s dtype %s is not f32, f16 or bf16", what,
                        DTypeName(v.dtype)));
  }
  if (v.num_tokens > 0 && v.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("calibration: null ", what));
  }
  if (v.num_tokens > 1 && v.token_stride < v.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("calibration: ", what, " rows overlap"));
  }
  return absl::OkStatus();
}

void CopyRow(const HeadsView& v, uint32_t head, uint64_t token, float* out) {
  const uint64_t at = v.offset(head, token);
  for (uint32_t k = 0; k < v.head_dim; ++k) out[k] = LoadAsFloat(v.data, v.dtype, at + k);
}

// Reservoir slot for the `seen`-th item (0-based) of a stream with `cap` slots, or -1.
int64_t ReservoirSlot(uint64_t seen, uint32_t cap, std::mt19937_64& rng) {
  if (cap == 0) return -1;
  if (seen < cap) return static_cast<int64_t>(seen);
  const uint64_t j = rng() % (seen + 1);
  return j < cap ? static_cast<int64_t>(j) : -1;
}

struct ErrorSums {
  double num = 0, den = 0;
};

// Encodes and decodes the samples of one layer and adds the error terms of `metric`.
absl::Status LayerErrorSums(const Projection& projection, const ValueCodecParams& params,
                            ErrorMetric metric, uint32_t layer, const LayerSamples& s,
                            ErrorSums* sums) {
  const uint32_t d = projection.head_dim;
  std::vector<float> enc, dec, z, latent_f, out;
  std::vector<uint8_t> latent;
  std::vector<uint16_t> scales;
  for (uint32_t i = 0; i < projection.num_kv_heads; ++i) {
    const uint64_t head = uint64_t{layer} * projection.num_kv_heads + i;
    const uint64_t n = s.count[i];
    if (n == 0) continue;
    const float* v = s.values.data() + uint64_t{i} * s.capacity * d;
    codec_internal::HeadMatrices(projection, head, params, &enc, &dec);
    z.resize(n * params.rank);
    latent.resize(n * params.LatentBytes());
    scales.resize(n * params.Groups());
    out.resize(n * d);
    codec_internal::EncodeRowsF32(v, n, d, enc.data(),
                                  params.UsesGamma() ? projection.head_gamma(head) : nullptr,
                                  params, z.data(), latent.data(), scales.data());
    codec_internal::DecodeRowsF32(latent.data(), scales.data(), n, d, dec.data(), params,
                                  z.data(), out.data());
    Eigen::Map<const RowMat> vm(v, n, d);
    Eigen::Map<const RowMat> om(out.data(), n, d);
    if (metric == ErrorMetric::kValueReconstruction) {
      sums->num += (vm - om).cast<double>().squaredNorm();
      sums->den += vm.cast<double>().squaredNorm();
      continue;
    }
    if (s.keys.empty()) {
      return absl::FailedPreconditionError(
          "calibration: the attention-output measure needs keys (AddLayer with keys)");
    }
    Eigen::Map<const RowMat> km(s.keys.data() + uint64_t{i} * s.capacity * d, n, d);
    const uint64_t nq_given = s.query_count.empty() ? 0 : s.query_count[i];
    const float* qp = nq_given > 0 ? s.queries.data() + uint64_t{i} * s.query_capacity * d
                                   : km.data();
    const uint64_t nq = nq_given > 0 ? nq_given : std::min<uint64_t>(n, 512);
    Eigen::Map<const RowMat> qm(qp, nq, d);
    RowMat logits = (qm * km.transpose()) / std::sqrt(static_cast<float>(d));
    for (Eigen::Index r = 0; r < logits.rows(); ++r) {
      const float mx = logits.row(r).maxCoeff();
      logits.row(r) = (logits.row(r).array() - mx).exp();
      logits.row(r) /= logits.row(r).sum();
    }
    const RowMat o = logits * vm;
    const RowMat diff = logits * (vm - om);
    sums->num += diff.cast<double>().squaredNorm();
    sums->den += o.cast<double>().squaredNorm();
  }
  return absl::OkStatus();
}

double Relative(const ErrorSums& s) { return s.den > 0 ? std::sqrt(s.num / s.den) : 0.0; }

// Runs fn(layer) for every layer on up to hardware_concurrency threads.
template <typename Fn>
void ForEachLayer(uint32_t layers, Fn fn) {
  const uint32_t threads =
      std::max(1u, std::min(layers, std::max(1u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (uint32_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint32_t l = t; l < layers; l += threads) fn(l);
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace

absl::string_view ErrorMetricName(ErrorMetric m) {
  return m == ErrorMetric::kAttentionOutput ? "attention" : "value";
}

absl::StatusOr<ErrorMetric> ParseErrorMetric(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "value" || n == "reconstruction") return ErrorMetric::kValueReconstruction;
  if (n == "attention" || n == "attention_output") return ErrorMetric::kAttentionOutput;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown error metric '", name, "' (value or attention)"));
}

absl::StatusOr<Calibrator> Calibrator::Create(const CalibrationOptions& options,
                                              Backend* backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("calibration: null backend");
  KvLayout l;
  l.num_layers = options.num_layers;
  l.num_kv_heads = options.num_kv_heads;
  l.num_q_heads = options.num_kv_heads;
  l.head_dim = options.head_dim;
  l.dtype = DType::kF32;
  KVCOMP_RETURN_IF_ERROR(Annotate(l.Validate(), "calibration"));
  if (options.max_samples_per_head > (1u << 20) || options.max_queries_per_head > (1u << 16)) {
    return absl::InvalidArgumentError("calibration: sample capacity too large");
  }
  Calibrator c;
  c.options_ = options;
  c.backend_ = backend;
  const uint64_t d = options.head_dim;
  c.gram_.assign(l.num_heads_total() * d * d, 0.0);
  c.observed_.assign(options.num_layers, 0);
  c.seen_queries_.assign(options.num_layers, 0);
  c.samples_.resize(options.num_layers);
  for (LayerSamples& s : c.samples_) {
    s.capacity = options.max_samples_per_head;
    s.query_capacity = options.max_queries_per_head;
    s.values.assign(uint64_t{options.num_kv_heads} * s.capacity * d, 0.0f);
    s.count.assign(options.num_kv_heads, 0);
    s.query_count.assign(options.num_kv_heads, 0);
  }
  c.rng_.seed(options.seed);
  return c;
}

absl::Status Calibrator::AddLayer(uint32_t layer, const HeadsView& values,
                                  const HeadsView* keys) {
  if (layer >= options_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("calibration: layer %u of %u", layer, options_.num_layers));
  }
  KVCOMP_RETURN_IF_ERROR(CheckView(values, options_.num_kv_heads, options_.head_dim, "values"));
  if (keys != nullptr) {
    KVCOMP_RETURN_IF_ERROR(CheckView(*keys, options_.num_kv_heads, options_.head_dim, "keys"));
    if (keys->num_tokens != values.num_tokens || keys->space != values.space) {
      return absl::InvalidArgumentError("calibration: keys and values differ in tokens or space");
    }
  }
  LayerSamples& s = samples_[layer];
  const bool sample = values.space == MemorySpace::kHost && s.capacity > 0;
  if (sample && observed_[layer] > 0 && (keys != nullptr) != !s.keys.empty()) {
    return absl::InvalidArgumentError(
        "calibration: pass keys with every AddLayer of a layer, or with none");
  }
  const uint64_t d = options_.head_dim;
  const uint64_t per_layer = uint64_t{options_.num_kv_heads} * d * d;
  KVCOMP_RETURN_IF_ERROR(backend_->codec().AccumulateSecondMoment(
      values, absl::MakeSpan(gram_.data() + layer * per_layer, per_layer)));
  if (sample) {
    if (keys != nullptr && s.keys.empty()) s.keys.assign(s.values.size(), 0.0f);
    for (uint64_t t = 0; t < values.num_tokens; ++t) {
      const int64_t slot = ReservoirSlot(observed_[layer] + t, s.capacity, rng_);
      if (slot < 0) continue;
      for (uint32_t h = 0; h < options_.num_kv_heads; ++h) {
        const uint64_t at = (uint64_t{h} * s.capacity + slot) * d;
        CopyRow(values, h, t, s.values.data() + at);
        if (keys != nullptr) CopyRow(*keys, h, t, s.keys.data() + at);
        s.count[h] = std::max<uint32_t>(s.count[h], static_cast<uint32_t>(slot) + 1);
      }
    }
  }
  observed_[layer] += values.num_tokens;
  return absl::OkStatus();
}

absl::Status Calibrator::AddQueries(uint32_t layer, const HeadsView& queries) {
  if (layer >= options_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("calibration: layer %u of %u", layer, options_.num_layers));
  }
  const uint32_t kv = options_.num_kv_heads;
  if (queries.num_heads == 0 || queries.num_heads % kv != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "calibration: %u query heads is not a multiple of %u kv heads", queries.num_heads, kv));
  }
  KVCOMP_RETURN_IF_ERROR(CheckView(queries, queries.num_heads, options_.head_dim, "queries"));
  if (queries.space != MemorySpace::kHost) {
    return absl::InvalidArgumentError("calibration: queries must be host memory");
  }
  LayerSamples& s = samples_[layer];
  if (s.query_capacity == 0) return absl::OkStatus();
  if (s.queries.empty()) s.queries.assign(uint64_t{kv} * s.query_capacity * options_.head_dim, 0);
  const uint32_t group = queries.num_heads / kv;
  const uint64_t d = options_.head_dim;
  // Every (query head of the group, token) is one item of the kv head's stream.
  for (uint64_t t = 0; t < queries.num_tokens; ++t) {
    for (uint32_t g = 0; g < group; ++g) {
      const int64_t slot = ReservoirSlot(seen_queries_[layer], s.query_capacity, rng_);
      ++seen_queries_[layer];
      if (slot < 0) continue;
      for (uint32_t h = 0; h < kv; ++h) {
        CopyRow(queries, h * group + g, t, s.queries.data() + (uint64_t{h} * s.query_capacity +
                                                               slot) * d);
        s.query_count[h] = std::max<uint32_t>(s.query_count[h], static_cast<uint32_t>(slot) + 1);
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Projection> Calibrator::Finish(uint32_t rows) const {
  const uint32_t d = options_.head_dim;
  if (rows == 0 || rows > d) {
    return absl::InvalidArgumentError(
        absl::StrFormat("calibration: rows %u outside [1, head_dim %u]", rows, d));
  }
  for (uint32_t l = 0; l < options_.num_layers; ++l) {
    if (observed_[l] == 0) {
      return absl::FailedPreconditionError(
          absl::StrFormat("calibration: layer %u has no values yet", l));
    }
  }
  const uint64_t heads = uint64_t{options_.num_layers} * options_.num_kv_heads;
  const uint64_t dd = uint64_t{d} * d;
  std::vector<double> moment(gram_.size());
  for (uint64_t h = 0; h < heads; ++h) {
    const double n = static_cast<double>(observed_[h / options_.num_kv_heads]);
    for (uint64_t i = 0; i < dd; ++i) moment[h * dd + i] = gram_[h * dd + i] / n;
  }
  std::vector<double> evals(heads * d), evecs(heads * dd);
  KVCOMP_RETURN_IF_ERROR(backend_->codec().EigenDecompose(d, heads, moment, absl::MakeSpan(evals),
                                                          absl::MakeSpan(evecs)));
  Projection p;
  p.model_id = options_.model_id;
  p.num_layers = options_.num_layers;
  p.num_kv_heads = options_.num_kv_heads;
  p.head_dim = d;
  p.rows = rows;
  p.samples = *std::min_element(observed_.begin(), observed_.end());
  p.basis.resize(heads * rows * d);
  p.eigenvalues.resize(heads * d);
  p.gamma.resize(heads * rows);
  for (uint64_t h = 0; h < heads; ++h) {
    const double top = std::max(evals[h * d], 0.0);
    for (uint32_t j = 0; j < d; ++j) {
      p.eigenvalues[h * d + j] = static_cast<float>(std::max(evals[h * d + j], 0.0));
    }
    for (uint32_t j = 0; j < rows; ++j) {
      const double* e = evecs.data() + h * dd + uint64_t{j} * d;
      // Deterministic sign (backends may differ): the largest-magnitude component positive.
      uint32_t arg = 0;
      for (uint32_t k = 1; k < d; ++k) {
        if (std::fabs(e[k]) > std::fabs(e[arg])) arg = k;
      }
      double norm = 0;
      for (uint32_t k = 0; k < d; ++k) norm += e[k] * e[k];
      const double sign = (e[arg] < 0 ? -1.0 : 1.0) / std::sqrt(norm > 0 ? norm : 1.0);
      for (uint32_t k = 0; k < d; ++k) {
        p.basis[(h * rows + j) * d + k] = static_cast<float>(e[k] * sign);
      }
      const double lam = std::max(evals[h * d + j], 0.0);
      double g = std::sqrt(std::max(lam, top * Projection::kGammaFloor * Projection::kGammaFloor));
      if (!(g > 0)) g = 1.0;  // an all-zero head: any positive scale works
      p.gamma[h * rows + j] = static_cast<float>(g);
    }
  }
  KVCOMP_RETURN_IF_ERROR(p.Seal());
  return p;
}

absl::StatusOr<std::vector<double>> MeasureError(const Projection& projection,
                                                 const ValueCodecParams& params,
                                                 ErrorMetric metric,
                                                 const std::vector<LayerSamples>& samples) {
  KVCOMP_RETURN_IF_ERROR(params.ValidateFor(projection));
  if (samples.size() != projection.num_layers) {
    return absl::InvalidArgumentError("calibration: one LayerSamples per layer needed");
  }
  for (const LayerSamples& s : samples) {
    if (s.count.size() != projection.num_kv_heads ||
        s.values.size() < uint64_t{projection.num_kv_heads} * s.capacity * projection.head_dim) {
      return absl::InvalidArgumentError("calibration: samples do not match the projection");
    }
  }
  std::vector<double> err(projection.num_layers, 0.0);
  std::vector<absl::Status> status(projection.num_layers);
  ForEachLayer(projection.num_layers, [&](uint32_t l) {
    ErrorSums sums;
    status[l] = LayerErrorSums(projection, params, metric, l, samples[l], &sums);
    err[l] = Relative(sums);
  });
  for (const absl::Status& s : status) KVCOMP_RETURN_IF_ERROR(s);
  return err;
}

absl::StatusOr<TuneResult> AutoTune(const Calibrator& calibrator, const TuneOptions& options) {
  const CalibrationOptions& co = calibrator.options();
  if (!(options.budget > 0.0) || !std::isfinite(options.budget)) {
    return absl::InvalidArgumentError("auto-tune: the error budget must be a positive number");
  }
  if (co.max_samples_per_head == 0) {
    return absl::FailedPreconditionError("auto-tune: calibration kept no samples");
  }
  KVCOMP_ASSIGN_OR_RETURN(Projection full, calibrator.Finish(co.head_dim));
  ValueCodecParams base;
  base.codec = options.codec;
  base.group_size = options.group_size;
  base.gamma_aware = options.gamma_aware;
  base.rank = options.codec == ValueCodec::kOrthogonalInt4 ? 2 : 1;
  KVCOMP_RETURN_IF_ERROR(base.ValidateFor(full));
  const bool int4 = options.codec == ValueCodec::kOrthogonalInt4;
  const uint32_t step = options.rank_step != 0 ? options.rank_step : int4 ? 8u : 4u;
  const uint32_t d = co.head_dim;
  if (int4 && step % 2 != 0) {
    return absl::InvalidArgumentError("auto-tune: int4 ranks need an even rank_step");
  }
  if (step > d) {
    return absl::InvalidArgumentError(
        absl::StrFormat("auto-tune: rank_step %u above head_dim %u", step, d));
  }
  std::vector<LayerSamples> samples(co.num_layers);
  for (uint32_t l = 0; l < co.num_layers; ++l) samples[l] = calibrator.samples(l);

  TuneResult result;
  result.rank.assign(co.num_layers, d);
  result.error.assign(co.num_layers, 0.0);
  result.met.assign(co.num_layers, false);
  std::vector<absl::Status> status(co.num_layers);
  ForEachLayer(co.num_layers, [&](uint32_t l) {
    auto error_at = [&](uint32_t rank, double* e) {
      ValueCodecParams p = base;
      p.rank = rank;
      ErrorSums sums;
      absl::Status s = LayerErrorSums(full, p, options.metric, l, samples[l], &sums);
      *e = Relative(sums);
      return s;
    };
    // Smallest rank (in steps) meeting the budget; the error falls with rank (binary search).
    uint32_t lo = 1, hi = d / step;  // in units of `step`
    double e_hi;
    status[l] = error_at(hi * step, &e_hi);
    if (!status[l].ok()) return;
    if (e_hi > options.budget) {
      result.rank[l] = d;
      result.error[l] = e_hi;
      return;
    }
    double best_e = e_hi;
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      double e;
      status[l] = error_at(mid * step, &e);
      if (!status[l].ok()) return;
      if (e <= options.budget) {
        hi = mid;
        best_e = e;
      } else {
        lo = mid + 1;
      }
    }
    result.rank[l] = hi * step;
    if (hi * step != d) {
      status[l] = error_at(hi * step, &best_e);  // the error of the chosen rank exactly
    }
    result.error[l] = best_e;
    result.met[l] = best_e <= options.budget;
  });
  for (const absl::Status& s : status) KVCOMP_RETURN_IF_ERROR(s);
  result.max_rank = *std::max_element(result.rank.begin(), result.rank.end());
  KVCOMP_ASSIGN_OR_RETURN(result.projection, full.Truncated(result.max_rank));
  result.projection.tuned_rank = result.rank;
  result.projection.tuned_error = result.error;
  KVCOMP_RETURN_IF_ERROR(result.projection.Seal());
  return result;
}

}  // namespace kvcomp
