// MomentKV on the GPU:
//  1. moments + compaction (MomentOps::CompactAndAccumulate, one pass, v k^T on the tensor
//     cores) in GB/s over the minimal bytes (read K and V once, write the kept rows), next to the
//     device-to-device copy, at 2K-128K tokens per head; also CompactAndAccumulateDeferred (what
//     a device compression runs: no host wait, the values checked in the pass) and the
//     gather-only Accumulate of the evicted list.
//  2. corrected decode attention vs the same attention without the virtual token.
// Each figure twice: "op" = the MomentOps call as users see it (host checks, offset copies, the
// final synchronization), "kernel" = the kernels alone on the stream.
// Usage: kvcomp_bench_gpu_moments [attention | TOKENS...] (default 2048 to 131072 per head)
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "cuda/attention_kernels.cuh"
#include "cuda/moments_kernels.cuh"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/moment_ops.h"

namespace {

using kvcomp::bench::CopyGBps;
using kvcomp::bench::MedianMicros;

template <typename T>
T* DeviceCopy(const std::vector<T>& v) {
  T* p = nullptr;
  BENCH_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))));
  BENCH_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

void BenchMoments(kvcomp::Backend& gpu, cudaStream_t stream, const cudaDeviceProp& prop,
                  uint64_t tokens, double keep) {
  const uint32_t heads = 8, d = 128;
  const size_t elems = size_t{heads} * tokens * d;
  std::vector<__nv_bfloat16> host(elems);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto& x : host) x = __float2bfloat16(g(rng));
  __nv_bfloat16* k = DeviceCopy(host);
  __nv_bfloat16* v = DeviceCopy(host);
  std::vector<uint32_t> kept, ev;
  std::vector<uint64_t> ko{0}, eo{0};
  std::bernoulli_distribution b(keep);
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint32_t t = 0; t < tokens; ++t) (b(rng) ? kept : ev).push_back(t);
    ko.push_back(kept.size());
    eo.push_back(ev.size());
  }
  uint32_t* dki = DeviceCopy(kept);
  uint64_t* dko = DeviceCopy(ko);
  uint32_t* dei = DeviceCopy(ev);
  uint64_t* deo = DeviceCopy(eo);
  void *out_k, *out_v;
  BENCH_CUDA_CHECK(cudaMalloc(&out_k, kept.size() * d * 2 + 16));
  BENCH_CUDA_CHECK(cudaMalloc(&out_v, kept.size() * d * 2 + 16));
  std::vector<uint64_t> zc(heads, 0);
  std::vector<float> zv(size_t{heads} * d, 0.0f), zs(size_t{heads} * d * d, 0.0f);
  uint64_t* cnt = DeviceCopy(zc);
  float* ks = DeviceCopy(zv);
  float* vs = DeviceCopy(zv);
  float* s = DeviceCopy(zs);
  const kvcomp::MomentsView mv{cnt, ks, vs, s, heads, d, kvcomp::MemorySpace::kDevice};
  const auto kv = kvcomp::HeadsView::Dense(k, kvcomp::DType::kBF16, heads, tokens, d,
                                           kvcomp::MemorySpace::kDevice);
  const auto vv = kvcomp::HeadsView::Dense(v, kvcomp::DType::kBF16, heads, tokens, d,
                                           kvcomp::MemorySpace::kDevice);
  const kvcomp::TokenLists kl{dki, dko, heads, kvcomp::MemorySpace::kDevice};
  const kvcomp::TokenLists el{dei, deo, heads, kvcomp::MemorySpace::kDevice};

  const double min_bytes = 2.0 * elems * 2 + 2.0 * kept.size() * d * 2;  // read K,V; write kept
  const double gather_bytes = 2.0 * ev.size() * d * 2;                   // read evicted K,V
  double copy_us = 0;
  const double copy = CopyGBps(static_cast<size_t>(min_bytes / 2), stream, 2, &copy_us);

  const double op_us = MedianMicros(
      [&](int) { Check(gpu.moments().CompactAndAccumulate(kv, vv, kl, out_k, out_v, mv), "op"); },
      stream, 3, 20);
  // The form a device compression runs: the lists' offsets stay on the device, the values are
  // checked in the same pass, no host wait inside.
  uint32_t* err = nullptr;
  uint64_t* bad = nullptr;
  BENCH_CUDA_CHECK(cudaMalloc(&err, sizeof(uint32_t)));
  BENCH_CUDA_CHECK(cudaMalloc(&bad, sizeof(uint64_t)));
  BENCH_CUDA_CHECK(cudaMemset(err, 0, sizeof(uint32_t)));
  BENCH_CUDA_CHECK(cudaMemset(bad, 0xFF, sizeof(uint64_t)));
  // Timed on the backend's own stream (it enqueues there and does not wait).
  const double deferred_us = MedianMicros(
      [&](int) {
        Check(gpu.moments().CompactAndAccumulateDeferred(kv, vv, kl, out_k, out_v, err, bad, mv),
              "deferred");
      },
      static_cast<cudaStream_t>(gpu.native_stream()), 3, 20);
  const double gather_us = MedianMicros(
      [&](int) { Check(gpu.moments().Accumulate(kv, vv, el, mv), "gather"); }, stream, 3, 20);

  kvcomp::moments_cuda::MomentKernelParams p;
  p.k = k;
  p.v = v;
  p.k_token_stride = p.v_token_stride = d;
  p.k_head_stride = p.v_head_stride = tokens * d;
  p.num_tokens = tokens;
  p.heads = heads;
  p.list = dki;
  p.list_off = dko;
  p.kept_k = out_k;
  p.kept_v = out_v;
  p.count = reinterpret_cast<unsigned long long*>(cnt);
  p.key_sum = ks;
  p.value_sum = vs;
  p.vk_sum = s;
  p.bad_value = reinterpret_cast<unsigned long long*>(bad);
  p.chunk = kvcomp::moments_cuda::MomentChunk(tokens, heads, 1, prop.multiProcessorCount);
  const uint64_t chunks = (tokens + p.chunk - 1) / p.chunk;
  const double kern_us = MedianMicros(
      [&](int) {
        BENCH_CUDA_CHECK((
            kvcomp::moments_cuda::LaunchMomentKernel<__nv_bfloat16, 128, true>(p, chunks, stream)));
      },
      stream, 3, 20);
  auto gbps = [](double bytes, double us) { return bytes / (us * 1e3); };
  std::printf(
      "RESULT bench=moments_compact heads=%u tokens=%llu d=%u keep=%.2f copy_GBps=%.0f "
      "op_us=%.1f op_GBps=%.0f op_pct_copy=%.0f deferred_us=%.1f deferred_pct_copy=%.0f "
      "kernel_us=%.1f kernel_GBps=%.0f kernel_pct_copy=%.0f\n",
      heads, static_cast<unsigned long long>(tokens), d, keep, copy, op_us, gbps(min_bytes, op_us),
      100.0 * gbps(min_bytes, op_us) / copy, deferred_us,
      100.0 * gbps(min_bytes, deferred_us) / copy, kern_us, gbps(min_bytes, kern_us),
      100.0 * gbps(min_bytes, kern_us) / copy);
  std::printf(
      "RESULT bench=moments_gather heads=%u tokens=%llu evicted=%zu op_us=%.1f "
      "op_GBps=%.0f op_pct_copy=%.0f\n",
      heads, static_cast<unsigned long long>(tokens), ev.size(), gather_us,
      gbps(gather_bytes, gather_us), 100.0 * gbps(gather_bytes, gather_us) / copy);
  for (void* x : {static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(dki),
                  static_cast<void*>(dko), static_cast<void*>(dei), static_cast<void*>(deo), out_k,
                  out_v, static_cast<void*>(err), static_cast<void*>(bad), static_cast<void*>(cnt), static_cast<void*>(ks), static_cast<void*>(vs),
                  static_cast<void*>(s)}) {
    BENCH_CUDA_CHECK(cudaFree(x));
  }
}

void BenchAttention(kvcomp::Backend& gpu, cudaStream_t stream, const cudaDeviceProp& prop,
                    uint64_t kept_per_head, uint32_t nq) {
  const uint32_t hk = 8, hq = 32, d = 128;
  const size_t rows = size_t{hk} * kept_per_head;
  std::vector<__nv_bfloat16> kvh(rows * d);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto& x : kvh) x = __float2bfloat16(g(rng));
  std::vector<__nv_bfloat16> qh(size_t{hq} * nq * d);
  for (auto& x : qh) x = __float2bfloat16(g(rng));
  std::vector<uint64_t> off(hk + 1);
  for (uint32_t h = 0; h <= hk; ++h) off[h] = h * kept_per_head;
  std::vector<uint64_t> cnt(hk, 1000);
  std::vector<float> vec(size_t{hk} * d), mat(size_t{hk} * d * d);
  for (auto& x : vec) x = 1000.0f * g(rng);
  for (auto& x : mat) x = 1000.0f * g(rng);
  auto* dk = DeviceCopy(kvh);
  auto* dv = DeviceCopy(kvh);
  auto* dq = DeviceCopy(qh);
  auto* doff = DeviceCopy(off);
  auto* dc = DeviceCopy(cnt);
  auto* dks = DeviceCopy(vec);
  auto* dvs = DeviceCopy(vec);
  auto* ds = DeviceCopy(mat);
  float* out;
  BENCH_CUDA_CHECK(cudaMalloc(&out, size_t{hq} * nq * d * 4));
  kvcomp::AttentionParams p;
  p.queries =
      kvcomp::HeadsView::Dense(dq, kvcomp::DType::kBF16, hq, nq, d, kvcomp::MemorySpace::kDevice);
  p.kv = kvcomp::RaggedKv{dk, dv, kvcomp::DType::kBF16, doff, hk, d, kvcomp::MemorySpace::kDevice};
  p.moments = kvcomp::ConstMomentsView(
      kvcomp::MomentsView{dc, dks, dvs, ds, hk, d, kvcomp::MemorySpace::kDevice});
  p.out = out;
  double op_us[2], kern_us[2];
  for (int corr = 0; corr < 2; ++corr) {
    p.correct = corr == 1;
    op_us[corr] =
        MedianMicros([&](int) { Check(gpu.moments().Attention(p), "attention"); }, stream, 3, 30);
    // Kernel-only: the same launch configuration the op computes.
    kvcomp::attention_cuda::AttentionKernelParams k;
    k.q = dq;
    k.q_token_stride = d;
    k.q_head_stride = size_t{nq} * d;
    k.nq = nq;
    k.group = hq / hk;
    k.keys = dk;
    k.values = dv;
    k.offsets = doff;
    k.scale = 1.0f / std::sqrt(static_cast<float>(d));
    const uint64_t r = uint64_t{k.group} * nq;
    const kvcomp::attention_cuda::Chunking ch = kvcomp::attention_cuda::PartialChunking(
        static_cast<uint32_t>(r), true, d, static_cast<uint32_t>(prop.multiProcessorCount), hk,
        kept_per_head, p.correct);
    k.chunk = ch.chunk;
    k.chunks = ch.chunks;
    k.slots = k.chunks + (p.correct ? 1 : 0);
    float* ws;
    const size_t slots = size_t{hk} * r * k.slots;
    BENCH_CUDA_CHECK(cudaMalloc(&ws, slots * (2 + d) * 4));
    k.part_max = ws;
    k.part_sum = ws + slots;
    k.part_acc = ws + 2 * slots;
    if (p.correct) {
      k.count = reinterpret_cast<const unsigned long long*>(dc);
      k.key_sum = dks;
      k.value_sum = dvs;
      k.vk_sum = ds;
    }
    k.out = out;
    kern_us[corr] = MedianMicros(
        [&](int) {
          BENCH_CUDA_CHECK(
              (kvcomp::attention_cuda::LaunchAttention<__nv_bfloat16, __nv_bfloat16, 128>(k, hk,
                                                                                          stream)));
        },
        stream, 3, 30);
    BENCH_CUDA_CHECK(cudaFree(ws));
  }
  const double bytes = 2.0 * rows * d * 2;  // kept K and V, bf16, read once
  // A device-to-device copy of as many bytes, same run: GB/s over the minimal bytes against it.
  const double copy = CopyGBps(static_cast<size_t>(bytes), stream, 3);
  const double gbps = bytes / (kern_us[0] * 1e3);
  std::printf(
      "RESULT bench=attention hk=%u hq=%u d=%u kept_per_head=%llu nq=%u plain_op_us=%.1f "
      "corrected_op_us=%.1f op_overhead_pct=%.1f plain_kernel_us=%.1f corrected_kernel_us=%.1f "
      "kernel_overhead_pct=%.1f kernel_GBps=%.0f copy_GBps=%.0f plain_kernel_pct_copy=%.0f "
      "plain_op_pct_copy=%.0f\n",
      hk, hq, d, static_cast<unsigned long long>(kept_per_head), nq, op_us[0], op_us[1],
      100.0 * (op_us[1] / op_us[0] - 1.0), kern_us[0], kern_us[1],
      100.0 * (kern_us[1] / kern_us[0] - 1.0), gbps, copy, 100.0 * gbps / copy,
      100.0 * bytes / (op_us[0] * 1e3) / copy);
  for (void* x : {static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(dq),
                  static_cast<void*>(doff), static_cast<void*>(dc), static_cast<void*>(dks),
                  static_cast<void*>(dvs), static_cast<void*>(ds), static_cast<void*>(out)}) {
    BENCH_CUDA_CHECK(cudaFree(x));
  }
}

}  // namespace

// Optional argument "attention": the attention figures only.
int main(int argc, char** argv) {
  const bool attention_only = argc > 1 && std::string(argv[1]) == "attention";
  auto b = kvcomp::MakeCudaBackend(kvcomp::bench::BackendOptions());
  if (!b.ok()) {
    std::fprintf(stderr, "no CUDA backend: %s\n", b.status().ToString().c_str());
    return 0;
  }
  cudaStream_t stream = nullptr;  // the kernels timed alone run here; the ops on the backend's own
  cudaDeviceProp prop;
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s (%s)\n", prop.name, (*b)->Describe().c_str());
  // Optional token counts per head (e.g. 32768 131072) instead of the default sweep.
  std::vector<uint64_t> lengths{2048, 8192, 32768, 65536, 131072};
  if (argc > 1 && !attention_only) {
    lengths.clear();
    for (int i = 1; i < argc; ++i) lengths.push_back(std::strtoull(argv[i], nullptr, 10));
  }
  for (uint64_t tokens : lengths) {
    if (attention_only) break;
    for (double keep : {0.5, 0.2}) BenchMoments(**b, stream, prop, tokens, keep);
  }
  for (uint64_t kept : {2048ull, 8192ull, 32768ull}) {
    for (uint32_t nq : {1u, 8u}) BenchAttention(**b, stream, prop, kept, nq);
  }
  return 0;
}
