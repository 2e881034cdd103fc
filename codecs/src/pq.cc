// The calibrated basis codec's CPU reference (kvcomp/codecs/pq.h): every step of a row's
// encoding and decoding one IEEE f32 operation in the order the header gives (built with
// -ffp-contract=off, so no product is fused into a later sum), so the Python mirror
// (bench/quality/codecs_ref.py pq_engine_*) and a future device twin give the same bytes.
#include "kvcomp/codecs/pq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcomp {
namespace pq {
namespace {

#include "pq_codebooks.inc"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "pq: little-endian hosts only");

const float* const kCentroidTables[kMaxWidth + 1] = {
    nullptr,     kCentroids1, kCentroids2, kCentroids3, kCentroids4,
    kCentroids5, kCentroids6, kCentroids7, kCentroids8};

struct BoundaryTables {
  std::vector<float> b[kMaxWidth + 1];
  BoundaryTables() {
    for (uint32_t w = 1; w <= kMaxWidth; ++w) {
      const float* c = kCentroidTables[w];
      const uint32_t n = 1u << w;
      for (uint32_t k = 0; k + 1 < n; ++k) b[w].push_back((c[k] + c[k + 1]) * 0.5f);
    }
  }
};

const BoundaryTables& Bounds() {
  static const BoundaryTables* t = new BoundaryTables();
  return *t;
}

constexpr char kMagic[4] = {'K', 'V', 'P', 'Q'};
constexpr uint64_t kHeaderBytes = 32;

uint64_t PayloadBytes(uint64_t heads, uint64_t d) { return heads * (4 * d * (3 + d) + d); }

void PutU32(std::string* s, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);
  s->append(b, 4);
}
void PutU64(std::string* s, uint64_t v) {
  char b[8];
  std::memcpy(b, &v, 8);
  s->append(b, 8);
}
void PutFloats(std::string* s, const float* p, uint64_t n) {
  s->append(reinterpret_cast<const char*>(p), n * sizeof(float));
}
uint32_t GetU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

uint64_t Fnv1a(const char* p, uint64_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint64_t i = 0; i < n; ++i) {
    h ^= static_cast<uint8_t>(p[i]);
    h *= 0x100000001b3ull;
  }
  return h == 0 ? 1 : h;
}

std::string Payload(const Basis& b) {
  std::string s;
  const uint64_t d = b.head_dim;
  s.reserve(PayloadBytes(b.num_heads(), d));
  for (uint64_t h = 0; h < b.num_heads(); ++h) {
    PutFloats(&s, b.mean.data() + h * d, d);
    PutFloats(&s, b.scale.data() + h * d, d);
    PutFloats(&s, b.inv_scale.data() + h * d, d);
    PutFloats(&s, b.basis.data() + h * d * d, d * d);
    s.append(reinterpret_cast<const char*>(b.widths.data() + h * d), d);
  }
  return s;
}

absl::Status CheckHead(const Basis& b, uint64_t head) {
  if (head >= b.num_heads()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pq codec: head %u out of range (%u heads)", head, b.num_heads()));
  }
  return absl::OkStatus();
}

// Eigen-decomposition of the symmetric d x d matrix a (row-major, destroyed) by cyclic Jacobi:
// eigenvalues into w, eigenvectors into the columns of v.
void Jacobi(std::vector<double>& a, uint32_t d, std::vector<double>& w, std::vector<double>& v) {
  v.assign(uint64_t{d} * d, 0.0);
  for (uint32_t i = 0; i < d; ++i) v[uint64_t{i} * d + i] = 1.0;
  double total = 0;
  for (double x : a) total += x * x;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (uint32_t p = 0; p < d; ++p)
      for (uint32_t q = p + 1; q < d; ++q) off += a[uint64_t{p} * d + q] * a[uint64_t{p} * d + q];
    if (off <= 1e-26 * total || off == 0) break;
    for (uint32_t p = 0; p < d; ++p) {
      for (uint32_t q = p + 1; q < d; ++q) {
        const double apq = a[uint64_t{p} * d + q];
        if (std::fabs(apq) < 1e-300) continue;
        const double app = a[uint64_t{p} * d + p], aqq = a[uint64_t{q} * d + q];
        const double theta = (aqq - app) / (2 * apq);
        const double t =
            (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (uint32_t k = 0; k < d; ++k) {  // columns p, q
          const double akp = a[uint64_t{k} * d + p], akq = a[uint64_t{k} * d + q];
          a[uint64_t{k} * d + p] = c * akp - s * akq;
          a[uint64_t{k} * d + q] = s * akp + c * akq;
        }
        for (uint32_t k = 0; k < d; ++k) {  // rows p, q
          const double apk = a[uint64_t{p} * d + k], aqk = a[uint64_t{q} * d + k];
          a[uint64_t{p} * d + k] = c * apk - s * aqk;
          a[uint64_t{q} * d + k] = s * apk + c * aqk;
        }
        for (uint32_t k = 0; k < d; ++k) {
          const double vkp = v[uint64_t{k} * d + p], vkq = v[uint64_t{k} * d + q];
          v[uint64_t{k} * d + p] = c * vkp - s * vkq;
          v[uint64_t{k} * d + q] = s * vkp + c * vkq;
        }
      }
    }
  }
  w.resize(d);
  for (uint32_t i = 0; i < d; ++i) w[i] = a[uint64_t{i} * d + i];
}

}  // namespace

absl::Span<const float> Centroids(uint32_t width) {
  if (width < 1 || width > kMaxWidth) return {};
  return absl::MakeConstSpan(kCentroidTables[width], size_t{1} << width);
}

absl::Span<const float> Boundaries(uint32_t width) {
  if (width < 1 || width > kMaxWidth) return {};
  return absl::MakeConstSpan(Bounds().b[width]);
}

double GaussianDistortion(uint32_t width) {
  return width <= kMaxWidth ? kGaussianDistortion[width] : 0.0;
}

absl::Status Basis::Validate() const {
  if (num_layers == 0 || num_kv_heads == 0 || head_dim == 0 || head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pq basis: shape %u layers x %u kv heads x head_dim %u (each >= 1, head_dim <= %u)",
        num_layers, num_kv_heads, head_dim, kMaxHeadDim));
  }
  const uint64_t d = head_dim, heads = num_heads();
  if (bits_total == 0 || bits_total > kMaxWidth * d) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pq basis: bits_total %u not in [1, %u]", bits_total, kMaxWidth * d));
  }
  if (mean.size() != heads * d || scale.size() != heads * d || inv_scale.size() != heads * d ||
      widths.size() != heads * d || basis.size() != heads * d * d) {
    return absl::InvalidArgumentError("pq basis: array sizes do not match the shape");
  }
  for (uint64_t h = 0; h < heads; ++h) {
    uint64_t sum = 0;
    for (uint64_t c = 0; c < d; ++c) {
      const uint64_t i = h * d + c;
      if (widths[i] > kMaxWidth) {
        return absl::InvalidArgumentError(
            absl::StrFormat("pq basis: head %u component %u width %u > %u", h, c, widths[i],
                            kMaxWidth));
      }
      sum += widths[i];
      if (!std::isfinite(mean[i]) || !std::isfinite(scale[i]) ||
          (widths[i] > 0 && (!(scale[i] > 0) || !std::isfinite(inv_scale[i])))) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "pq basis: head %u component %u: mean, scale or inverse scale not finite (or scale "
            "<= 0 with a width)",
            h, c));
      }
    }
    if (sum != bits_total) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "pq basis: head %u widths sum to %u, not bits_total %u", h, sum, bits_total));
    }
  }
  for (float x : basis) {
    if (!std::isfinite(x)) return absl::InvalidArgumentError("pq basis: basis not finite");
  }
  return absl::OkStatus();
}

uint64_t Basis::Fingerprint() const {
  const std::string p = Payload(*this);
  return Fnv1a(p.data(), p.size());
}

std::string Basis::Serialize() const {
  const std::string p = Payload(*this);
  std::string s(kMagic, 4);
  s.push_back(static_cast<char>(kBasisVersion));
  s.append(3, '\0');
  PutU32(&s, num_layers);
  PutU32(&s, num_kv_heads);
  PutU32(&s, head_dim);
  PutU32(&s, bits_total);
  PutU64(&s, Fnv1a(p.data(), p.size()));
  s += p;
  return s;
}

absl::StatusOr<Basis> Basis::Parse(absl::string_view bytes) {
  if (bytes.size() < kHeaderBytes) {
    return absl::DataLossError(
        absl::StrFormat("pq basis: %u bytes, shorter than its %u-byte header", bytes.size(),
                        kHeaderBytes));
  }
  const char* p = bytes.data();
  if (std::memcmp(p, kMagic, 4) != 0) return absl::InvalidArgumentError("pq basis: not KVPQ");
  if (static_cast<uint8_t>(p[4]) != kBasisVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pq basis: version %u (this reader knows %u)",
                        static_cast<uint8_t>(p[4]), kBasisVersion));
  }
  if (p[5] != 0 || p[6] != 0 || p[7] != 0) {
    return absl::InvalidArgumentError("pq basis: reserved bytes not zero");
  }
  Basis b;
  b.num_layers = GetU32(p + 8);
  b.num_kv_heads = GetU32(p + 12);
  b.head_dim = GetU32(p + 16);
  b.bits_total = GetU32(p + 20);
  if (b.num_layers == 0 || b.num_kv_heads == 0 || b.head_dim == 0 ||
      b.head_dim > kMaxHeadDim || b.num_layers > (1u << 16) || b.num_kv_heads > (1u << 16)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pq basis: shape %u x %u x %u", b.num_layers, b.num_kv_heads,
                        b.head_dim));
  }
  const uint64_t d = b.head_dim, heads = b.num_heads();
  const uint64_t want = kHeaderBytes + PayloadBytes(heads, d);
  if (bytes.size() != want) {
    return absl::DataLossError(absl::StrFormat(
        "pq basis: %u bytes, the header's shape needs %u", bytes.size(), want));
  }
  const char* q = p + kHeaderBytes;
  if (Fnv1a(q, want - kHeaderBytes) != GetU64(p + 24)) {
    return absl::DataLossError("pq basis: fingerprint does not match the content");
  }
  b.mean.resize(heads * d);
  b.scale.resize(heads * d);
  b.inv_scale.resize(heads * d);
  b.widths.resize(heads * d);
  b.basis.resize(heads * d * d);
  for (uint64_t h = 0; h < heads; ++h) {
    std::memcpy(b.mean.data() + h * d, q, 4 * d);
    q += 4 * d;
    std::memcpy(b.scale.data() + h * d, q, 4 * d);
    q += 4 * d;
    std::memcpy(b.inv_scale.data() + h * d, q, 4 * d);
    q += 4 * d;
    std::memcpy(b.basis.data() + h * d * d, q, 4 * d * d);
    q += 4 * d * d;
    std::memcpy(b.widths.data() + h * d, q, d);
    q += d;
  }
  absl::Status st = b.Validate();
  if (!st.ok()) return st;
  return b;
}

absl::StatusOr<Basis> Fit(absl::Span<const float> rows, uint64_t n, uint32_t num_layers,
                          uint32_t num_kv_heads, uint32_t head_dim, uint32_t bits_total) {
  if (num_layers == 0 || num_kv_heads == 0 || head_dim == 0 || head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pq fit: shape %u x %u x %u", num_layers, num_kv_heads, head_dim));
  }
  if (n < 2) return absl::InvalidArgumentError("pq fit: at least 2 rows per head");
  const uint64_t d = head_dim;
  Basis b;
  b.num_layers = num_layers;
  b.num_kv_heads = num_kv_heads;
  b.head_dim = head_dim;
  b.bits_total = bits_total;
  const uint64_t heads = b.num_heads();
  if (bits_total == 0 || bits_total > kMaxWidth * d) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pq fit: bits_total %u not in [1, %u]", bits_total, kMaxWidth * d));
  }
  if (rows.size() != heads * n * d) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pq fit: %u values given, %u heads x %u rows x %u needed", rows.size(), heads, n, d));
  }
  for (float x : rows) {
    if (!std::isfinite(x)) return absl::InvalidArgumentError("pq fit: non-finite row element");
  }
  b.mean.resize(heads * d);
  b.scale.resize(heads * d);
  b.inv_scale.resize(heads * d);
  b.widths.assign(heads * d, 0);
  b.basis.resize(heads * d * d);
  std::vector<double> mu(d), cov(d * d), w, v;
  for (uint64_t h = 0; h < heads; ++h) {
    const float* x = rows.data() + h * n * d;
    std::fill(mu.begin(), mu.end(), 0.0);
    for (uint64_t r = 0; r < n; ++r)
      for (uint64_t j = 0; j < d; ++j) mu[j] += x[r * d + j];
    for (double& m : mu) m /= static_cast<double>(n);
    std::fill(cov.begin(), cov.end(), 0.0);
    std::vector<double> t(d);
    for (uint64_t r = 0; r < n; ++r) {
      for (uint64_t j = 0; j < d; ++j) t[j] = x[r * d + j] - mu[j];
      for (uint64_t i = 0; i < d; ++i)
        for (uint64_t j = i; j < d; ++j) cov[i * d + j] += t[i] * t[j];
    }
    for (uint64_t i = 0; i < d; ++i)
      for (uint64_t j = i; j < d; ++j) cov[j * d + i] = cov[i * d + j] /= static_cast<double>(n);
    Jacobi(cov, head_dim, w, v);
    std::vector<uint32_t> order(d);
    for (uint32_t i = 0; i < d; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t c) { return w[a] > w[c]; });
    const double top = std::max(w[order[0]], 0.0);
    std::vector<double> var(d);
    for (uint64_t c = 0; c < d; ++c) {
      const uint32_t k = order[c];
      // the eigenvector's largest-magnitude entry positive (a deterministic sign)
      uint64_t big = 0;
      for (uint64_t j = 1; j < d; ++j)
        if (std::fabs(v[j * d + k]) > std::fabs(v[big * d + k])) big = j;
      const double sg = v[big * d + k] < 0 ? -1.0 : 1.0;
      for (uint64_t j = 0; j < d; ++j)
        b.basis[h * d * d + c * d + j] = static_cast<float>(sg * v[j * d + k]);
      var[c] = std::max(w[k], 0.0);
      float s = static_cast<float>(std::sqrt(std::max(var[c], 1e-12 * top)));
      s = std::max(s, std::numeric_limits<float>::min());
      b.scale[h * d + c] = s;
      b.inv_scale[h * d + c] = 1.0f / s;
    }
    for (uint64_t j = 0; j < d; ++j) b.mean[h * d + j] = static_cast<float>(mu[j]);
    uint8_t* wd = b.widths.data() + h * d;
    for (uint32_t step = 0; step < bits_total; ++step) {
      uint64_t best = d;
      double gain = -1;
      for (uint64_t c = 0; c < d; ++c) {
        if (wd[c] >= kMaxWidth) continue;
        const double g = var[c] * (GaussianDistortion(wd[c]) - GaussianDistortion(wd[c] + 1));
        if (g > gain) {
          gain = g;
          best = c;
        }
      }
      ++wd[best];
    }
  }
  absl::Status st = b.Validate();
  if (!st.ok()) return st;
  return b;
}

absl::Status EncodeRows(const Basis& b, uint64_t head, const float* x, uint64_t rows,
                        uint8_t* out) {
  absl::Status st = CheckHead(b, head);
  if (!st.ok()) return st;
  const uint64_t d = b.head_dim;
  const float* B = b.basis.data() + head * d * d;
  const float* mean = b.mean.data() + head * d;
  const float* inv = b.inv_scale.data() + head * d;
  const uint8_t* wd = b.widths.data() + head * d;
  std::vector<uint32_t> idx;
  for (uint32_t c = 0; c < d; ++c)
    if (wd[c] > 0) idx.push_back(c);
  const uint64_t nc = idx.size();
  std::vector<float> bt(d * nc);  // bt[j][k] = B[idx[k]][j]: the sums run over j per component
  for (uint64_t j = 0; j < d; ++j)
    for (uint64_t k = 0; k < nc; ++k) bt[j * nc + k] = B[idx[k] * d + j];
  std::vector<float> t(d), acc(nc);
  const uint64_t rec = b.RecordBytes();
  const BoundaryTables& bounds = Bounds();
  for (uint64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    for (uint64_t j = 0; j < d; ++j) {
      if (!std::isfinite(xr[j])) {
        return absl::InvalidArgumentError(
            absl::StrFormat("pq codec: row %u element %u is not finite", r, j));
      }
      t[j] = xr[j] - mean[j];
    }
    for (uint64_t k = 0; k < nc; ++k) acc[k] = bt[k] * t[0];
    for (uint64_t j = 1; j < d; ++j) {
      const float tj = t[j];
      const float* row = bt.data() + j * nc;
      for (uint64_t k = 0; k < nc; ++k) acc[k] = acc[k] + row[k] * tj;
    }
    uint8_t* o = out + r * rec;
    std::memset(o, 0, rec);
    uint64_t bit = 0;
    for (uint64_t k = 0; k < nc; ++k) {
      const uint32_t c = idx[k], w = wd[c];
      const float u = acc[k] * inv[c];
      if (std::isnan(u)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("pq codec: row %u overflows in the projection", r));
      }
      const std::vector<float>& bd = bounds.b[w];
      const uint32_t code =
          static_cast<uint32_t>(std::lower_bound(bd.begin(), bd.end(), u) - bd.begin());
      for (uint32_t i = 0; i < w; ++i, ++bit) {
        if ((code >> i) & 1u) o[bit >> 3] |= static_cast<uint8_t>(1u << (bit & 7));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeRows(const Basis& b, uint64_t head, const uint8_t* in, uint64_t rows,
                        float* out) {
  absl::Status st = CheckHead(b, head);
  if (!st.ok()) return st;
  const uint64_t d = b.head_dim;
  const float* B = b.basis.data() + head * d * d;
  const float* mean = b.mean.data() + head * d;
  const float* sc = b.scale.data() + head * d;
  const uint8_t* wd = b.widths.data() + head * d;
  const uint64_t rec = b.RecordBytes();
  std::vector<float> a(d);
  for (uint64_t r = 0; r < rows; ++r) {
    const uint8_t* o = in + r * rec;
    for (uint64_t bit = b.bits_total; bit < rec * 8; ++bit) {
      if ((o[bit >> 3] >> (bit & 7)) & 1u) {
        return absl::InvalidArgumentError(
            absl::StrFormat("pq codec: record %u has nonzero padding bits", r));
      }
    }
    uint64_t bit = 0;
    bool first = true;
    for (uint64_t c = 0; c < d; ++c) {
      const uint32_t w = wd[c];
      if (w == 0) continue;
      uint32_t code = 0;
      for (uint32_t i = 0; i < w; ++i, ++bit) code |= ((o[bit >> 3] >> (bit & 7)) & 1u) << i;
      const float v = kCentroidTables[w][code] * sc[c];
      const float* row = B + c * d;
      if (first) {
        for (uint64_t j = 0; j < d; ++j) a[j] = v * row[j];
        first = false;
      } else {
        for (uint64_t j = 0; j < d; ++j) a[j] = a[j] + v * row[j];
      }
    }
    float* y = out + r * d;
    if (first) {
      for (uint64_t j = 0; j < d; ++j) y[j] = mean[j];
    } else {
      for (uint64_t j = 0; j < d; ++j) y[j] = mean[j] + a[j];
    }
  }
  return absl::OkStatus();
}

namespace {

// Runs fn(begin, end) over [0, rows) in contiguous blocks on up to `threads` threads; the first
// non-OK status (in block order) is returned.
absl::Status ForBlocks(uint64_t rows, int threads,
                       const std::function<absl::Status(uint64_t, uint64_t)>& fn) {
  uint64_t t = threads > 0 ? static_cast<uint64_t>(threads)
                           : std::min(32u, std::max(1u, std::thread::hardware_concurrency()));
  t = std::max<uint64_t>(1, std::min<uint64_t>(t, (rows + 255) / 256));
  if (t == 1) return fn(0, rows);
  std::vector<absl::Status> st(t);
  std::vector<std::thread> pool;
  const uint64_t per = (rows + t - 1) / t;
  for (uint64_t i = 0; i < t; ++i) {
    pool.emplace_back([&, i] {
      const uint64_t b = std::min(rows, i * per), e = std::min(rows, b + per);
      st[i] = fn(b, e);
    });
  }
  for (auto& th : pool) th.join();
  for (auto& s : st) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EncodeRows(const Basis& b, uint64_t head, const void* src, DType dtype,
                        uint64_t rows, uint8_t* out, int threads) {
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pq codec: input dtype %s is not f32, f16 or bf16", DTypeName(dtype)));
  }
  absl::Status st = CheckHead(b, head);
  if (!st.ok()) return st;
  const uint64_t d = b.head_dim, rec = b.RecordBytes();
  return ForBlocks(rows, threads, [&](uint64_t begin, uint64_t end) -> absl::Status {
    std::vector<float> x((end - begin) * d);
    for (uint64_t i = 0; i < x.size(); ++i) x[i] = LoadAsFloat(src, dtype, begin * d + i);
    absl::Status s = EncodeRows(b, head, x.data(), end - begin, out + begin * rec);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s (rows from %u)", s.message(), begin));
    }
    return s;
  });
}

absl::Status DecodeRows(const Basis& b, uint64_t head, const uint8_t* in, uint64_t rows,
                        void* dst, DType dtype, int threads) {
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pq codec: output dtype %s is not f32, f16 or bf16", DTypeName(dtype)));
  }
  absl::Status st = CheckHead(b, head);
  if (!st.ok()) return st;
  const uint64_t d = b.head_dim, rec = b.RecordBytes();
  return ForBlocks(rows, threads, [&](uint64_t begin, uint64_t end) -> absl::Status {
    std::vector<float> y((end - begin) * d);
    absl::Status s = DecodeRows(b, head, in + begin * rec, end - begin, y.data());
    if (!s.ok()) return s;
    for (uint64_t i = 0; i < y.size(); ++i) StoreFromFloat(dst, dtype, begin * d + i, y[i]);
    return s;
  });
}

namespace {

constexpr char kCalibrationMagic[4] = {'K', 'V', 'P', 'C'};
constexpr uint8_t kCalibrationFormat = 1;

uint64_t CalibrationVersion(uint64_t key_fingerprint, uint64_t value_fingerprint) {
  char b[16];
  std::memcpy(b, &key_fingerprint, 8);
  std::memcpy(b + 8, &value_fingerprint, 8);
  return Fnv1a(b, 16);
}

}  // namespace

absl::Status Calibration::Validate() const {
  absl::Status st = keys.Validate();
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("pq calibration keys: ", st.message()));
  }
  st = values.Validate();
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("pq calibration values: ", st.message()));
  }
  if (keys.num_layers != values.num_layers || keys.num_kv_heads != values.num_kv_heads ||
      keys.head_dim != values.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pq calibration: the keys' basis is %u x %u x %u, the values' %u x %u x %u",
        keys.num_layers, keys.num_kv_heads, keys.head_dim, values.num_layers,
        values.num_kv_heads, values.head_dim));
  }
  return absl::OkStatus();
}

absl::Status Calibration::Seal() {
  absl::Status st = Validate();
  if (!st.ok()) return st;
  key_fingerprint = keys.Fingerprint();
  value_fingerprint = values.Fingerprint();
  version = CalibrationVersion(key_fingerprint, value_fingerprint);
  return absl::OkStatus();
}

std::string Calibration::Serialize() const {
  std::string s(kCalibrationMagic, 4);
  s.push_back(static_cast<char>(kCalibrationFormat));
  s.append(3, '\0');
  PutU64(&s, version);
  for (const Basis* b : {&keys, &values}) {
    const std::string bytes = b->Serialize();
    PutU64(&s, bytes.size());
    s += bytes;
  }
  return s;
}

absl::StatusOr<Calibration> Calibration::Parse(absl::string_view bytes) {
  if (bytes.size() < 24) {
    return absl::DataLossError(
        absl::StrFormat("pq calibration: %u bytes, shorter than its header", bytes.size()));
  }
  const char* p = bytes.data();
  if (std::memcmp(p, kCalibrationMagic, 4) != 0) {
    return absl::InvalidArgumentError("pq calibration: not KVPC");
  }
  if (static_cast<uint8_t>(p[4]) != kCalibrationFormat || p[5] != 0 || p[6] != 0 || p[7] != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pq calibration: format %u (this reader knows %u) or reserved bytes set",
        static_cast<uint8_t>(p[4]), kCalibrationFormat));
  }
  const uint64_t want_version = GetU64(p + 8);
  uint64_t at = 16;
  Calibration c;
  for (Basis* b : {&c.keys, &c.values}) {
    if (bytes.size() - at < 8) return absl::DataLossError("pq calibration: truncated");
    const uint64_t n = GetU64(p + at);
    at += 8;
    if (n > bytes.size() - at) return absl::DataLossError("pq calibration: truncated basis");
    absl::StatusOr<Basis> parsed = Basis::Parse(bytes.substr(at, n));
    if (!parsed.ok()) return parsed.status();
    *b = *std::move(parsed);
    at += n;
  }
  if (at != bytes.size()) return absl::DataLossError("pq calibration: bytes after the bases");
  absl::Status st = c.Seal();
  if (!st.ok()) return st;
  if (c.version != want_version) {
    return absl::DataLossError(absl::StrFormat(
        "pq calibration: version %016x recorded, the bases give %016x", want_version, c.version));
  }
  return c;
}

absl::StatusOr<Calibration> FitCalibration(absl::Span<const float> keys,
                                           absl::Span<const float> values, uint64_t n,
                                           uint32_t num_layers, uint32_t num_kv_heads,
                                           uint32_t head_dim, uint32_t key_bits,
                                           uint32_t value_bits) {
  for (uint32_t bits : {key_bits, value_bits}) {
    if (bits == 0 || bits > kMaxWidth) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "pq calibration: %u bits per element, want 1..%u", bits, kMaxWidth));
    }
  }
  Calibration c;
  absl::StatusOr<Basis> k = Fit(keys, n, num_layers, num_kv_heads, head_dim, key_bits * head_dim);
  if (!k.ok()) return k.status();
  absl::StatusOr<Basis> v =
      Fit(values, n, num_layers, num_kv_heads, head_dim, value_bits * head_dim);
  if (!v.ok()) return v.status();
  c.keys = *std::move(k);
  c.values = *std::move(v);
  absl::Status st = c.Seal();
  if (!st.ok()) return st;
  return c;
}

}  // namespace pq
}  // namespace kvcomp
