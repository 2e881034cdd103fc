#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvcomp/core/dtype.h"
#include "latent_attention.h"

namespace kvcomp {
namespace decode {
namespace {

// The latent of one row, dequantized (codec_ops.h: f16 latents, or q * group scale).
void Dequantize(const uint8_t* in, const uint16_t* scales, const ValueCodecParams& p, float* z) {
  const uint32_t r = p.rank;
  if (p.codec == ValueCodec::kOrthogonal) {
    const auto* h = reinterpret_cast<const uint16_t*>(in);
    for (uint32_t j = 0; j < r; ++j) z[j] = HalfToFloat(h[j]);
    return;
  }
  for (uint32_t j = 0; j < r; ++j) {
    const float s = HalfToFloat(scales[j / p.group_size]);
    int q;
    if (p.codec == ValueCodec::kOrthogonalInt8) {
      q = static_cast<int8_t>(in[j]);
    } else {
      const uint32_t nib = j % 2 == 0 ? (in[j / 2] & 15u) : (in[j / 2] >> 4);
      q = static_cast<int>((nib ^ 8u) & 15u) - 8;
    }
    z[j] = static_cast<float>(q) * s;
  }
}

}  // namespace

absl::Status LatentAttentionCpu(const LatentAttentionArgs& a) {
  const HeadsView& q = a.queries;
  const uint32_t hk = a.num_kv_heads, d = a.head_dim, r = a.value.rank;
  if (hk == 0 || q.num_heads % hk != 0 || q.head_dim != d || a.out == nullptr ||
      a.host_offsets.size() != uint64_t{hk} + 1 || a.expand == nullptr) {
    return absl::InvalidArgumentError("latent attention: arguments do not fit the layout");
  }
  const uint32_t group = q.num_heads / hk;
  const float t = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(d));
  const uint64_t lb = a.value.LatentBytes(), groups = a.value.Groups();
  const auto* latent = static_cast<const uint8_t*>(a.latent);
  std::vector<float> qf(d), k(d), z(r), zacc(r), acc(d), logits, sq(d);
  for (uint32_t g = 0; g < q.num_heads; ++g) {
    const uint32_t h = g / group;
    const uint64_t b = a.host_offsets[h], e = a.host_offsets[h + 1];
    const float* expand = a.expand + uint64_t{h} * r * d;
    const uint64_t* raw_lo = a.raw_rows == nullptr ? nullptr
                                                   : std::lower_bound(a.raw_rows,
                                                                      a.raw_rows + a.num_raw_rows, b);
    const uint64_t n_evicted =
        a.correct && a.moments.count != nullptr ? a.moments.count[h] : 0;
    for (uint64_t i = 0; i < q.num_tokens; ++i) {
      for (uint32_t c = 0; c < d; ++c) qf[c] = LoadAsFloat(q.data, q.dtype, q.offset(g, i) + c);
      logits.assign(e - b, 0.0f);
      float m = -std::numeric_limits<float>::infinity();
      for (uint64_t row = b; row < e; ++row) {
        float s = 0.0f;
        for (uint32_t c = 0; c < d; ++c) s += qf[c] * LoadAsFloat(a.keys, a.key_dtype, row * d + c);
        logits[row - b] = t * s;
        m = std::max(m, t * s);
      }
      float lv = 0.0f;
      const float* mk = nullptr;
      if (n_evicted > 0) {
        mk = a.moments.key_sum + uint64_t{h} * d;
        float s = 0.0f;
        for (uint32_t c = 0; c < d; ++c) s += qf[c] * mk[c];
        lv = t * s / static_cast<float>(n_evicted) + std::log(static_cast<float>(n_evicted));
        m = std::max(m, lv);
      }
      std::fill(zacc.begin(), zacc.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float l = 0.0f;
      const uint64_t* raw = raw_lo;
      for (uint64_t row = b; row < e; ++row) {
        const float w = std::exp(logits[row - b] - m);
        l += w;
        if (raw != nullptr && raw < a.raw_rows + a.num_raw_rows && *raw == row) {
          const uint64_t slot = raw - a.raw_rows;
          for (uint32_t c = 0; c < d; ++c) {
            acc[c] += w * LoadAsFloat(a.raw_values, a.key_dtype, slot * d + c);
          }
          ++raw;
          continue;
        }
        Dequantize(latent + row * lb, groups ? a.scales + row * groups : nullptr, a.value,
                   z.data());
        for (uint32_t j = 0; j < r; ++j) zacc[j] += w * z[j];
      }
      for (uint32_t j = 0; j < r; ++j) {
        for (uint32_t c = 0; c < d; ++c) acc[c] += zacc[j] * expand[uint64_t{j} * d + c];
      }
      if (n_evicted > 0) {
        // v_E = mu_v + t C q, C q = S q / n - mu_v (mu_k . q).
        const float inv = 1.0f / static_cast<float>(n_evicted);
        const float* vs = a.moments.value_sum + uint64_t{h} * d;
        const float* vk = a.moments.vk_sum + uint64_t{h} * d * d;
        float kq = 0.0f;
        for (uint32_t c = 0; c < d; ++c) kq += mk[c] * inv * qf[c];
        const float w = std::exp(lv - m);
        l += w;
        for (uint32_t c = 0; c < d; ++c) {
          float sq_c = 0.0f;
          for (uint32_t j = 0; j < d; ++j) sq_c += vk[uint64_t{c} * d + j] * qf[j];
          const float mu = vs[c] * inv;
          acc[c] += w * (mu + t * (sq_c * inv - mu * kq));
        }
      }
      float* o = a.out + (uint64_t{g} * q.num_tokens + i) * d;
      const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
      for (uint32_t c = 0; c < d; ++c) o[c] = acc[c] * inv_l;
    }
  }
  return absl::OkStatus();
}

}  // namespace decode
}  // namespace kvcomp
