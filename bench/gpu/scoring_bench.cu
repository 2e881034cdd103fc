// CUDA score + select + compact of one layer (8 kv heads, head_dim 128, bf16, ratio 0.5) for the
// bandwidth-bound scorers, in GB/s over the minimal bytes (read K and V once, write the kept K
// and V), next to a device-to-device copy of K and V measured in the same run.
//   device: the kernels alone (cuda::EnqueueScoreSelectCompact captured as a CUDA graph, replays
//           timed with events)
//   op:     ScoringOps::ScoreSelectCompact, which also reads the data-error slots back (one
//           host round trip per call)
// Inputs are fresh random bf16 (never zeros); input sets rotate so L2 never holds the next input.
// Lengths 2K to 128K, and a batch of 64 requests of 2K tokens given as one view of 64 x 8 heads
// (requests of one length batch as heads: one launch of each kernel for all of them).
// The mean-based scorers run twice: summing the keys themselves, and given the keys' sums as the
// device staging accumulates them while a put's blocks arrive (sums=1: K is read once; sums_us
// is the summing kernel's own device time, spent during the upload instead).
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "cuda/cuda_ops.h"
#include "cuda/scoring_cuda.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/scoring_ops.h"

namespace kvcomp {
namespace {

__global__ void FillRandomBf16(__nv_bfloat16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint64_t x = SplitMix64(seed ^ i);
    // Roughly normal-ish: sum of two uniforms in [-1, 1), scaled; a few large outliers.
    const float u1 = static_cast<float>(x >> 40) / 16777216.0f;
    const float u2 = static_cast<float>((x >> 16) & 0xFFFFFF) / 16777216.0f;
    float v = (u1 + u2 - 1.0f) * 2.0f;
    if ((x & 0xFF) == 0) v *= 8.0f;
    p[i] = __float2bfloat16(v);
  }
}

class BenchAllocator final : public Allocator {
 public:
  explicit BenchAllocator(cudaStream_t s) : stream_(s) {}
  MemorySpace space() const override { return MemorySpace::kDevice; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = nullptr;
    if (bytes == 0) return p;
    if (cudaMallocAsync(&p, bytes, stream_) != cudaSuccess) {
      return absl::ResourceExhaustedError("cudaMallocAsync");
    }
    return p;
  }
  void Deallocate(void* p, size_t) override {
    if (p != nullptr) cudaFreeAsync(p, stream_);
  }

 private:
  cudaStream_t stream_;
};

struct Set {
  void* k = nullptr;
  void* v = nullptr;
  float* sums = nullptr;  // KeySums of k (sums, then unit sums), with_sums only
};

// Input sets of K and V, `elems` fresh random bf16 each (seeds seed + 2s and seed + 2s + 1 for
// set s), enough of them (at least two) that the L2 cache never holds the next one.
std::vector<Set> RandomSets(CudaContext& ctx, size_t elems, uint64_t seed) {
  const size_t bytes = elems * 2;
  cudaDeviceProp prop;
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sets = std::max<int>(2, static_cast<int>(3ull * prop.l2CacheSize / (2 * bytes)) + 1);
  std::vector<Set> in(sets);
  for (int s = 0; s < sets; ++s) {
    BENCH_CUDA_CHECK(cudaMalloc(&in[s].k, bytes));
    BENCH_CUDA_CHECK(cudaMalloc(&in[s].v, bytes));
    FillRandomBf16<<<1024, 256, 0, ctx.stream>>>(static_cast<__nv_bfloat16*>(in[s].k), elems,
                                                 seed + 2 * s);
    FillRandomBf16<<<1024, 256, 0, ctx.stream>>>(static_cast<__nv_bfloat16*>(in[s].v), elems,
                                                 seed + 1 + 2 * s);
  }
  return in;
}

void FreeSets(const std::vector<Set>& in) {
  for (const Set& s : in) {
    BENCH_CUDA_CHECK(cudaFree(s.k));
    BENCH_CUDA_CHECK(cudaFree(s.v));
    if (s.sums != nullptr) BENCH_CUDA_CHECK(cudaFree(s.sums));
  }
}

// What a score + select + compact writes: the kept K and V rows, per head the kept count and
// the kept rows' positions.
struct KeptOut {
  void* keys = nullptr;
  void* values = nullptr;
  void* counts = nullptr;
  void* positions = nullptr;
};

KeptOut AllocKept(uint64_t rows, uint64_t heads, uint32_t dim) {
  KeptOut o;
  BENCH_CUDA_CHECK(cudaMalloc(&o.keys, rows * dim * 2));
  BENCH_CUDA_CHECK(cudaMalloc(&o.values, rows * dim * 2));
  BENCH_CUDA_CHECK(cudaMalloc(&o.counts, heads * 4));
  BENCH_CUDA_CHECK(cudaMalloc(&o.positions, rows * 4));
  return o;
}

void FreeKept(const KeptOut& o) {
  BENCH_CUDA_CHECK(cudaFree(o.keys));
  BENCH_CUDA_CHECK(cudaFree(o.values));
  BENCH_CUDA_CHECK(cudaFree(o.counts));
  BENCH_CUDA_CHECK(cudaFree(o.positions));
}

// Median host wall-clock microseconds of the synchronous `op(i)` over 11 calls, after 2 untimed
// ones; exits when a call fails.
double OpMicros(const std::function<absl::Status(int)>& op) {
  std::vector<double> us(11);
  for (int i = 0; i < 13; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = op(i);
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) std::exit(1);
    if (i >= 2) us[i - 2] = std::chrono::duration<double, std::micro>(t1 - t0).count();
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

bool Centred(Scorer s) {
  return s == Scorer::kManifold || s == Scorer::kWindowedManifold || s == Scorer::kKeyDiff;
}

void Run(Backend& backend, CudaContext& ctx, Scorer scorer, uint64_t n, uint32_t batch,
         bool with_sums = false) {
  constexpr uint32_t kDim = 128;
  const uint32_t kHeads = 8 * batch;
  const size_t elems = size_t{kHeads} * n * kDim;
  const size_t bytes = elems * 2;
  std::vector<Set> in = RandomSets(ctx, elems, 1000);
  const int sets = static_cast<int>(in.size());
  const uint64_t chunks = (n + kKeySumChunkTokens - 1) / kKeySumChunkTokens;
  const size_t sum_floats = size_t{kHeads} * chunks * kDim;
  unsigned long long* bad = nullptr;
  double sums_us = 0;
  if (with_sums) {
    BENCH_CUDA_CHECK(cudaMalloc(&bad, 8));
    BENCH_CUDA_CHECK(cudaMemset(bad, 0xFF, 8));
    auto sum_of = [&](int i) {
      const Set& s = in[i % sets];
      const HeadsView k =
          HeadsView::Dense(s.k, DType::kBF16, kHeads, n, kDim, MemorySpace::kDevice);
      absl::Status st =
          cuda::EnqueueKeySums(ctx.stream, k, 0, chunks, s.sums, s.sums + sum_floats, bad);
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        std::exit(1);
      }
    };
    for (auto& s : in) BENCH_CUDA_CHECK(cudaMalloc(&s.sums, 2 * sum_floats * sizeof(float)));
    sums_us = bench::MedianMicros(sum_of, ctx.stream, sets, 21);  // also leaves every set's sums
  }
  const uint64_t kept = static_cast<uint64_t>(static_cast<double>(n) * (1.0 - 0.5));
  const uint64_t cap = KeptCapacity(kHeads, n, kept);
  const KeptOut out = AllocKept(cap, kHeads, kDim);
  auto args = [&](int i) {
    ScoreSelectCompactArgs a;
    const Set& s = in[i % sets];
    a.keys = HeadsView::Dense(s.k, DType::kBF16, kHeads, n, kDim, MemorySpace::kDevice);
    a.values = HeadsView::Dense(s.v, DType::kBF16, kHeads, n, kDim, MemorySpace::kDevice);
    a.score.scorer = scorer;
    a.score.window = 4096;
    if (with_sums) a.score.key_sums = KeySums{s.sums, s.sums + sum_floats, n};
    a.select.kept_per_head = kept;
    a.select.n_sink = 4;
    a.kept = {static_cast<uint32_t*>(out.counts), static_cast<uint32_t*>(out.positions)};
    a.keys_out = out.keys;
    a.values_out = out.values;
    return a;
  };
  // The op once, for its status (and to check the data path end to end).
  absl::Status st = backend.scoring().ScoreSelectCompact(args(0));
  if (!st.ok()) {
    std::printf("ERROR %s n=%llu: %s\n", std::string(ScorerName(scorer)).c_str(),
                static_cast<unsigned long long>(n), st.ToString().c_str());
    return;
  }
  std::vector<uint32_t> hc(kHeads);
  BENCH_CUDA_CHECK(cudaMemcpy(hc.data(), out.counts, kHeads * 4, cudaMemcpyDeviceToHost));
  for (uint32_t c : hc) {
    if (c != kept) std::printf("ERROR kept %u != %llu\n", c, static_cast<unsigned long long>(kept));
  }
  // Device time: the enqueued work captured once per input set as a CUDA graph and replayed,
  // so host launch gaps stay out of the figure.
  std::vector<cudaGraphExec_t> graphs(sets);
  for (int i = 0; i < sets; ++i) {
    cudaGraph_t g;
    BENCH_CUDA_CHECK(cudaStreamBeginCapture(ctx.stream, cudaStreamCaptureModeThreadLocal));
    absl::Status s = cuda::EnqueueScoreSelectCompact(&ctx, args(i));
    BENCH_CUDA_CHECK(cudaStreamEndCapture(ctx.stream, &g));
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      std::exit(1);
    }
    BENCH_CUDA_CHECK(cudaGraphInstantiate(&graphs[i], g, 0));
    BENCH_CUDA_CHECK(cudaGraphDestroy(g));
  }
  const double dev_us = bench::MedianMicros(
      [&](int i) { BENCH_CUDA_CHECK(cudaGraphLaunch(graphs[i % sets], ctx.stream)); }, ctx.stream,
      3, 21);
  for (auto& g : graphs) BENCH_CUDA_CHECK(cudaGraphExecDestroy(g));
  // The enqueued form as a caller on a stream runs it (no host wait), timed as the PyTorch
  // presses are: events around the call, host launch gaps included.
  const double enq_us = bench::MedianMicros(
      [&](int i) {
        absl::Status s = cuda::EnqueueScoreSelectCompact(&ctx, args(i));
        if (!s.ok()) {
          std::fprintf(stderr, "%s\n", s.ToString().c_str());
          std::exit(1);
        }
      },
      ctx.stream, 3, 21);
  // The op (synchronous): host wall clock per call.
  const double op_us =
      OpMicros([&](int i) { return backend.scoring().ScoreSelectCompact(args(i)); });
  double copy_us = 0;
  const double copy_gbps = bench::CopyGBps(2 * bytes, ctx.stream, sets, &copy_us);
  const double minimal = 2.0 * bytes + 2.0 * cap * kDim * 2;  // read K, V; write kept K, V
  const double dev_gbps = minimal / (dev_us * 1e3);
  const double op_gbps = minimal / (op_us * 1e3);
  std::printf(
      "RESULT bench=ssc scorer=%s batch=%u tokens=%llu sums=%d dev_us=%.1f dev_GBps=%.0f "
      "enq_us=%.1f op_us=%.1f op_GBps=%.0f copy_GBps=%.0f dev/copy=%.0f%% enq/copy=%.0f%% "
      "op/copy=%.0f%% sums_us=%.1f\n",
      std::string(ScorerName(scorer)).c_str(), batch, static_cast<unsigned long long>(n),
      with_sums ? 1 : 0, dev_us, dev_gbps, enq_us, op_us, op_gbps, copy_gbps,
      100.0 * dev_gbps / copy_gbps, 100.0 * minimal / (enq_us * 1e3) / copy_gbps,
      100.0 * op_gbps / copy_gbps, sums_us);
  FreeSets(in);
  if (bad != nullptr) BENCH_CUDA_CHECK(cudaFree(bad));
  FreeKept(out);
}

// A varlen batch (cu_seqlens) of `lengths` requests, 8 kv heads each, through
// ScoreSelectCompactVarlen: the one-launch path enqueued (events around the enqueue: its
// kernels and the small upload of the request table; not a graph, whose capture refuses the
// pageable upload) and the op as called.
void RunVarlen(Backend& backend, CudaContext& ctx, Scorer scorer,
               const std::vector<uint64_t>& lengths, const char* label) {
  constexpr uint32_t kDim = 128, kHeads = 8;
  std::vector<uint64_t> cu{0}, kept;
  for (uint64_t n : lengths) {
    cu.push_back(cu.back() + n);
    kept.push_back(n / 2);
  }
  const uint64_t total = cu.back();
  const size_t elems = size_t{kHeads} * total * kDim;
  const size_t bytes = elems * 2;
  const std::vector<Set> in = RandomSets(ctx, elems, 3000);
  const int sets = static_cast<int>(in.size());
  uint64_t rows = 0;
  for (size_t r = 0; r < lengths.size(); ++r) rows += kHeads * std::min(kept[r], lengths[r]);
  const KeptOut out = AllocKept(rows, lengths.size() * kHeads, kDim);
  auto args = [&](int i) {
    ScoreSelectCompactVarlenArgs a;
    const Set& s = in[i % sets];
    a.keys = HeadsView::Dense(s.k, DType::kBF16, kHeads, total, kDim, MemorySpace::kDevice);
    a.values = HeadsView::Dense(s.v, DType::kBF16, kHeads, total, kDim, MemorySpace::kDevice);
    a.cu_seqlens = cu.data();
    a.requests = static_cast<uint32_t>(lengths.size());
    a.kept_per_head = kept.data();
    a.score.scorer = scorer;
    a.score.window = 4096;
    a.select.n_sink = 4;
    a.kept = {static_cast<uint32_t*>(out.counts), static_cast<uint32_t*>(out.positions)};
    a.keys_out = out.keys;
    a.values_out = out.values;
    return a;
  };
  absl::Status st = backend.scoring().ScoreSelectCompactVarlen(args(0));
  if (!st.ok()) {
    std::printf("ERROR varlen %s: %s\n", std::string(ScorerName(scorer)).c_str(),
                st.ToString().c_str());
    return;
  }
  const double enq_us = bench::MedianMicros(
      [&](int i) {
        absl::Status s = cuda::EnqueueScoreSelectCompactVarlen(&ctx, args(i));
        if (!s.ok()) std::exit(1);
      },
      ctx.stream, 3, 21);
  const double op_us =
      OpMicros([&](int i) { return backend.scoring().ScoreSelectCompactVarlen(args(i)); });
  const double copy_gbps = bench::CopyGBps(2 * bytes, ctx.stream, sets);
  const double minimal = 2.0 * bytes + 2.0 * rows * kDim * 2;
  const double enq_gbps = minimal / (enq_us * 1e3);
  const double op_gbps = minimal / (op_us * 1e3);
  std::printf(
      "RESULT bench=ssc_varlen scorer=%s requests=%zu lengths=%s tokens=%llu enq_us=%.1f "
      "enq_GBps=%.0f op_us=%.1f op_GBps=%.0f copy_GBps=%.0f enq/copy=%.0f%% op/copy=%.0f%%\n",
      std::string(ScorerName(scorer)).c_str(), lengths.size(), label,
      static_cast<unsigned long long>(total), enq_us, enq_gbps, op_us, op_gbps,
      copy_gbps, 100.0 * enq_gbps / copy_gbps, 100.0 * op_gbps / copy_gbps);
  FreeSets(in);
  FreeKept(out);
}

}  // namespace
}  // namespace kvcomp

int main(int argc, char** argv) {
  using namespace kvcomp;
  auto backend = MakeCudaBackend(bench::BackendOptions());
  if (!backend.ok()) {
    std::printf("no CUDA backend: %s\n", backend.status().ToString().c_str());
    return 77;
  }
  std::printf("backend %s\n", (*backend)->Describe().c_str());
  CudaContext ctx;
  BENCH_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx.stream, cudaStreamNonBlocking));
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&ctx.properties, 0));
  BenchAllocator alloc(ctx.stream);
  ctx.allocator = &alloc;
  {
    // The enqueued form's workspaces come from the device's default pool here: keep what it
    // frees mapped, as the backend's own pool does, so no call maps its workspace afresh.
    cudaMemPool_t pool;
    BENCH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    uint64_t keep = ~uint64_t{0};
    BENCH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  // Optional arguments: a token count, then a scorer name, then a batch, then 1 for the keys'
  // sums given (for profiling one case).
  std::vector<uint64_t> sizes = {2048, 8192, 32768, 65536, 131072};
  if (argc > 1) sizes = {std::stoull(argv[1])};
  const uint32_t batch = argc > 3 ? static_cast<uint32_t>(std::stoul(argv[3])) : 1;
  std::vector<Scorer> scorers = {Scorer::kKnorm,     Scorer::kKeyDiff,
                                 Scorer::kManifold,  Scorer::kWindowedManifold,
                                 Scorer::kStreaming, Scorer::kRandom};
  if (argc > 2) {
    auto s = ParseScorer(argv[2]);
    if (!s.ok()) return 2;
    scorers = {*s};
  }
  const int only_sums = argc > 4 ? std::atoi(argv[4]) : -1;
  for (Scorer s : scorers) {
    for (bool sums : {false, true}) {
      if (sums && !Centred(s)) continue;
      if (only_sums >= 0 && sums != (only_sums == 1)) continue;
      for (uint64_t n : sizes) Run(**backend, ctx, s, n, batch, sums);
      if (argc <= 1) Run(**backend, ctx, s, 2048, 64, sums);  // 64 requests of 2K tokens
    }
  }
  if (argc <= 1) {
    // Varlen batches: 64 x 2K (against the batch-as-heads rows above) and 64 requests of
    // 1K-4K tokens.
    std::vector<uint64_t> mixed;
    for (uint64_t r = 0; r < 64; ++r) mixed.push_back(1024 + SplitMix64(r) % 3072);
    for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold}) {
      RunVarlen(**backend, ctx, s, std::vector<uint64_t>(64, 2048), "64x2048");
      RunVarlen(**backend, ctx, s, mixed, "64x1024-4095");
    }
  }
  BENCH_CUDA_CHECK(cudaStreamDestroy(ctx.stream));
  return 0;
}
