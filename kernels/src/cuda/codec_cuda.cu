// CUDA CodecOps: launchers of codec_kernels.cuh, cuBLAS for the calibration's second moments and
// cuSOLVER for its eigendecompositions. Pointers may be device memory, or host memory, which is
// staged through device buffers (so the whole-cache helpers in kvsplice.h work unchanged).
// Projections are uploaded once per (version, rank, gamma) and kept in a small cache.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <map>
#include <tuple>
#include <vector>

#include "../cpu/codec_cpu_internal.h"
#include "../cpu/kvsplice_internal.h"
#include "absl/strings/str_format.h"
#include "codec_encode.cuh"
#include "codec_kernels.cuh"
#include "cuda_ops.h"
#include "../env_switch.h"
#include "cuda_status.h"
#include "hq_cuda.h"
#include "pq_cuda.h"
#include "kvcomp/codecs/hq.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace {

using codec_cuda::FusedRPad;
using codec_cuda::KindOf;
using codec_cuda::LatentKind;
using codec_cuda::Tile;

absl::Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s: cuBLAS status %d", what, static_cast<int>(s)));
}
absl::Status CusolverStatus(cusolverStatus_t s, const char* what) {
  if (s == CUSOLVER_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s: cuSOLVER status %d", what, static_cast<int>(s)));
}

std::vector<Tile> MakeTiles(const RowSpan& rows, uint64_t tile_rows) {
  return codec_cuda::UniformTiles(rows.row_offsets.data(), rows.num_heads(), tile_rows);
}

bool IsDevicePointer(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

class CudaCodecOps final : public CodecOps {
 public:
  explicit CudaCodecOps(CudaContext* ctx) : ctx_(ctx) {}
  ~CudaCodecOps() override {
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (cusolver_ != nullptr) cusolverDnDestroy(cusolver_);
  }

  absl::Status EncodeValues(const Projection& projection, const ValueCodecParams& params,
                            const RowSpan& rows, const void* values, DType dtype, void* latent,
                            uint16_t* scales) override {
    KVCOMP_RETURN_IF_ERROR(CheckValueCall(projection, params, rows, dtype));
    const uint64_t n = rows.total_rows();
    if (n == 0) return absl::OkStatus();
    if (values == nullptr || latent == nullptr || (params.Groups() > 0 && scales == nullptr)) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    return EncodeLayers(projection, params, {OneSpan(rows, params)}, values, dtype, latent,
                        scales, nullptr, nullptr);
  }

  absl::Status EncodeValueLayers(const Projection& projection, const ValueCodecParams& params,
                                 absl::Span<const uint32_t> layer_ranks,
                                 absl::Span<const uint64_t> row_offsets, const void* values,
                                 DType dtype, void* latent, uint16_t* scales, float* energy,
                                 float* lost) override {
    KVCOMP_ASSIGN_OR_RETURN(
        std::vector<kvsplice_internal::LayerRows> layers,
        codec_internal::PlanLayers(projection, params, layer_ranks, row_offsets, dtype));
    KVCOMP_RETURN_IF_ERROR(CheckValueCall(projection, params, layers.front().span(), dtype));
    if (row_offsets.back() == 0) return absl::OkStatus();
    if (values == nullptr || latent == nullptr || (params.Groups() > 0 && scales == nullptr)) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    if ((energy == nullptr) != (lost == nullptr)) {
      return absl::InvalidArgumentError("codec: energy and lost come together");
    }
    return EncodeLayers(projection, params, layers, values, dtype, latent, scales, energy, lost);
  }

  absl::Status ValueResiduals(const Projection& projection, uint32_t rank, const RowSpan& rows,
                              const void* values, DType dtype, float* energy,
                              float* lost) override {
    ValueCodecParams params;
    params.codec = ValueCodec::kOrthogonal;
    params.rank = rank;
    KVCOMP_RETURN_IF_ERROR(CheckValueCall(projection, params, rows, dtype));
    const uint64_t n = rows.total_rows();
    if (n == 0) return absl::OkStatus();
    if (values == nullptr || energy == nullptr || lost == nullptr) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    return EncodeLayers(projection, params, {OneSpan(rows, params)}, values, dtype, nullptr,
                        nullptr, energy, lost);
  }

  absl::Status DecodeValues(const Projection& projection, const ValueCodecParams& params,
                            const RowSpan& rows, const void* latent, const uint16_t* scales,
                            void* out, DType out_dtype) override {
    KVCOMP_RETURN_IF_ERROR(CheckValueCall(projection, params, rows, out_dtype));
    const uint64_t n = rows.total_rows(), d = projection.head_dim;
    if (n == 0) return absl::OkStatus();
    if (latent == nullptr || out == nullptr || (params.Groups() > 0 && scales == nullptr)) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    KVCOMP_ASSIGN_OR_RETURN(const DeviceProjection* dp, Upload(projection, params, rows));
    Staging st(this);
    KVCOMP_ASSIGN_OR_RETURN(const void* dl, st.In(latent, n * params.LatentBytes()));
    KVCOMP_ASSIGN_OR_RETURN(const void* ds, st.In(scales, n * params.Groups() * 2));
    KVCOMP_ASSIGN_OR_RETURN(void* dout, st.Out(out, n * d * DTypeBytes(out_dtype, 1)));
    if (reinterpret_cast<uintptr_t>(dout) % 16 != 0) {
      return absl::InvalidArgumentError("codec (CUDA): the output must be 16-byte aligned");
    }
    const uint32_t r_pad = (params.rank + 15) / 16 * 16;
    codec_cuda::DecodeParams p{nullptr,
                               static_cast<const uint8_t*>(dl),
                               static_cast<const uint16_t*>(ds),
                               dp->dec16.as<__half>() +
                                   (rows.first_head - dp->first_head) * r_pad * d,
                               dout,
                               params.rank,
                               r_pad,
                               params.group_size,
                               static_cast<uint32_t>(params.Groups()),
                               static_cast<uint32_t>(params.LatentBytes()),
                               KindOf(params.codec),
                               params.rank % 8 == 0 &&
                                   (params.Groups() == 0 || params.group_size % 8 == 0) &&
                                   reinterpret_cast<uintptr_t>(dl) % 16 == 0};
    switch (d) {
      case 64:
        KVCOMP_RETURN_IF_ERROR(DecodeByDType<64>(p, rows, out_dtype, &st));
        break;
      case 128:
        KVCOMP_RETURN_IF_ERROR(DecodeByDType<128>(p, rows, out_dtype, &st));
        break;
      case 256:
        KVCOMP_RETURN_IF_ERROR(DecodeByDType<256>(p, rows, out_dtype, &st));
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrFormat("codec (CUDA): head_dim %u (64, 128 or 256)", d));
    }
    return st.Finish();
  }

  // The Hadamard codec: one launch over every row (hq_cuda.cu), the lowest failing row's error
  // read back with the outputs.
  absl::Status EncodeHq(uint32_t bits, uint64_t rows, uint32_t head_dim, const void* in,
                        DType dtype, void* out) override {
    KVCOMP_RETURN_IF_ERROR(hq::CheckHeadDim(head_dim));
    KVCOMP_RETURN_IF_ERROR(hq::CheckBits(bits));
    if (!IsInputDType(dtype)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("hq codec: input dtype %s is not f32, f16 or bf16", DTypeName(dtype)));
    }
    if (rows == 0) return absl::OkStatus();
    if (in == nullptr || out == nullptr) return absl::InvalidArgumentError("hq codec: null buffer");
    Staging st(this);
    KVCOMP_ASSIGN_OR_RETURN(const void* din, st.In(in, rows * DTypeBytes(dtype, head_dim)));
    KVCOMP_ASSIGN_OR_RETURN(void* dout, st.Out(out, rows * hq::RowBytes(bits, head_dim)));
    uint64_t error = hq_cuda::kNoError;
    KVCOMP_ASSIGN_OR_RETURN(void* derr, st.Out(&error, sizeof(error)));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(derr, 0xff, sizeof(error), ctx_->stream));
    KVCOMP_RETURN_IF_ERROR(hq_cuda::LaunchEncode(
        ctx_->stream, MaxBlocks(), din, dtype, rows, head_dim, bits, hq::Normalizer(head_dim),
        static_cast<uint8_t*>(dout), static_cast<unsigned long long*>(derr)));
    KVCOMP_RETURN_IF_ERROR(st.Finish());
    return hq_cuda::EncodeError(error);
  }

  absl::Status DecodeHq(uint32_t bits, uint64_t rows, uint32_t head_dim, const void* in,
                        void* out, DType out_dtype) override {
    KVCOMP_RETURN_IF_ERROR(hq::CheckHeadDim(head_dim));
    KVCOMP_RETURN_IF_ERROR(hq::CheckBits(bits));
    if (!IsInputDType(out_dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "hq codec: output dtype %s is not f32, f16 or bf16", DTypeName(out_dtype)));
    }
    if (rows == 0) return absl::OkStatus();
    if (in == nullptr || out == nullptr) return absl::InvalidArgumentError("hq codec: null buffer");
    Staging st(this);
    KVCOMP_ASSIGN_OR_RETURN(const void* din, st.In(in, rows * hq::RowBytes(bits, head_dim)));
    KVCOMP_ASSIGN_OR_RETURN(void* dout, st.Out(out, rows * DTypeBytes(out_dtype, head_dim)));
    uint64_t error = hq_cuda::kNoError;
    KVCOMP_ASSIGN_OR_RETURN(void* derr, st.Out(&error, sizeof(error)));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(derr, 0xff, sizeof(error), ctx_->stream));
    KVCOMP_RETURN_IF_ERROR(hq_cuda::LaunchDecode(
        ctx_->stream, MaxBlocks(), static_cast<const uint8_t*>(din), rows, head_dim, bits,
        hq::Normalizer(head_dim), dout, out_dtype, static_cast<unsigned long long*>(derr)));
    KVCOMP_RETURN_IF_ERROR(st.Finish());
    return hq_cuda::DecodeError(error);
  }

  // The calibrated basis codec: one launch over every head of the call (pq_cuda.cu), the basis
  // uploaded once per fingerprint, the lowest failing row's error read back with the outputs.
  absl::Status EncodePq(const pq::Basis& basis, uint64_t fingerprint,
                        absl::Span<const uint64_t> row_offsets, const void* in, DType dtype,
                        void* out) override {
    KVCOMP_RETURN_IF_ERROR(codec_internal::CheckPqCall(basis, row_offsets, dtype));
    const uint64_t n = row_offsets.back();
    if (n == 0) return absl::OkStatus();
    if (in == nullptr || out == nullptr) return absl::InvalidArgumentError("pq codec: null buffer");
    KVCOMP_ASSIGN_OR_RETURN(const DevicePq* db, UploadPq(basis, fingerprint));
    Staging st(this);
    RowSpan rows;
    rows.row_offsets = row_offsets;
    KVCOMP_ASSIGN_OR_RETURN(const void* din, st.In(in, n * DTypeBytes(dtype, basis.head_dim)));
    KVCOMP_ASSIGN_OR_RETURN(void* dout, st.Out(out, n * basis.RecordBytes()));
    KVCOMP_ASSIGN_OR_RETURN(const uint64_t* doff, st.Offsets(rows));
    uint64_t error = pq_cuda::kNoError;
    KVCOMP_ASSIGN_OR_RETURN(void* derr, st.Out(&error, sizeof(error)));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(derr, 0xff, sizeof(error), ctx_->stream));
    KVCOMP_RETURN_IF_ERROR(pq_cuda::LaunchEncode(
        ctx_->stream, db->view, doff, MaxRows(row_offsets), din, dtype,
        static_cast<uint8_t*>(dout), static_cast<unsigned long long*>(derr)));
    KVCOMP_RETURN_IF_ERROR(st.Finish());
    return pq_cuda::EncodeError(error, row_offsets);
  }

  absl::Status DecodePq(const pq::Basis& basis, uint64_t fingerprint,
                        absl::Span<const uint64_t> row_offsets, const void* in, void* out,
                        DType out_dtype) override {
    KVCOMP_RETURN_IF_ERROR(codec_internal::CheckPqCall(basis, row_offsets, out_dtype));
    const uint64_t n = row_offsets.back();
    if (n == 0) return absl::OkStatus();
    if (in == nullptr || out == nullptr) return absl::InvalidArgumentError("pq codec: null buffer");
    KVCOMP_ASSIGN_OR_RETURN(const DevicePq* db, UploadPq(basis, fingerprint));
    Staging st(this);
    RowSpan rows;
    rows.row_offsets = row_offsets;
    KVCOMP_ASSIGN_OR_RETURN(const void* din, st.In(in, n * basis.RecordBytes()));
    KVCOMP_ASSIGN_OR_RETURN(void* dout,
                            st.Out(out, n * DTypeBytes(out_dtype, basis.head_dim)));
    KVCOMP_ASSIGN_OR_RETURN(const uint64_t* doff, st.Offsets(rows));
    uint64_t error = pq_cuda::kNoError;
    KVCOMP_ASSIGN_OR_RETURN(void* derr, st.Out(&error, sizeof(error)));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(derr, 0xff, sizeof(error), ctx_->stream));
    KVCOMP_RETURN_IF_ERROR(pq_cuda::LaunchDecode(
        ctx_->stream, db->view, doff, MaxRows(row_offsets), static_cast<const uint8_t*>(din),
        dout, out_dtype, static_cast<unsigned long long*>(derr)));
    KVCOMP_RETURN_IF_ERROR(st.Finish());
    return pq_cuda::DecodeError(error, row_offsets);
  }

  absl::Status EncodeKeys(KeyCodec codec, const RowSpan& rows, uint32_t head_dim,
                          const void* keys, DType dtype, void* out, float* key_scales) override {
    KVCOMP_RETURN_IF_ERROR(CheckKeyCall(codec, rows, head_dim, dtype, dtype));
    const uint64_t n = rows.total_rows(), d = head_dim, heads = rows.num_heads();
    if (codec == KeyCodec::kInt8 && key_scales == nullptr) {
      return absl::InvalidArgumentError("codec: null key_scales");
    }
    if (n > 0 && (keys == nullptr || out == nullptr)) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    if (codec == KeyCodec::kInt4) return EncodeKeysInt4(rows, d, keys, dtype, out, key_scales);
    Staging st(this);
    KVCOMP_ASSIGN_OR_RETURN(const void* dk, st.In(keys, n * d * DTypeBytes(dtype, 1)));
    const uint64_t out_bytes = n * d * (codec == KeyCodec::kRaw ? DTypeBytes(dtype, 1)
                                        : codec == KeyCodec::kFp16 ? 2 : 1);
    KVCOMP_ASSIGN_OR_RETURN(void* dout, st.Out(out, out_bytes));
    float* dsc = nullptr;
    if (codec == KeyCodec::kInt8) {
      KVCOMP_ASSIGN_OR_RETURN(void* s, st.Out(key_scales, heads * d * sizeof(float)));
      dsc = static_cast<float*>(s);
    }
    if (codec == KeyCodec::kRaw) {
      if (n > 0) {
        KVCOMP_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(dout, dk, out_bytes, cudaMemcpyDeviceToDevice, ctx_->stream));
      }
      return st.Finish();
    }
    uint64_t tiles = 0;
    KVCOMP_ASSIGN_OR_RETURN(const codec_cuda::TileList dt, st.List(rows, 64, &tiles));
    const uint64_t* doff = dt.offsets;
    uint64_t max_rows = 0;
    for (uint64_t h = 0; h < heads; ++h) {
      max_rows = std::max(max_rows, rows.row_offsets[h + 1] - rows.row_offsets[h]);
    }
    switch (dtype) {
      case DType::kF32:
        KVCOMP_RETURN_IF_ERROR(LaunchKeys<float>(codec, tiles, heads, max_rows, dt, doff, dk, d, dsc, dout));
        break;
      case DType::kF16:
        KVCOMP_RETURN_IF_ERROR(LaunchKeys<__half>(codec, tiles, heads, max_rows, dt, doff, dk, d, dsc, dout));
        break;
      default:
        KVCOMP_RETURN_IF_ERROR(
            LaunchKeys<__nv_bfloat16>(codec, tiles, heads, max_rows, dt, doff, dk, d, dsc, dout));
    }
    return st.Finish();
  }

  absl::Status DecodeKeys(KeyCodec codec, const RowSpan& rows, uint32_t head_dim,
                          const void* encoded, DType raw_dtype, const float* key_scales,
                          void* out, DType out_dtype) override {
    KVCOMP_RETURN_IF_ERROR(CheckKeyCall(codec, rows, head_dim, raw_dtype, out_dtype));
    const uint64_t n = rows.total_rows(), d = head_dim, heads = rows.num_heads();
    if (n == 0) return absl::OkStatus();
    if (encoded == nullptr || out == nullptr ||
        ((codec == KeyCodec::kInt8 || codec == KeyCodec::kInt4) && !key_scales)) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    if (codec == KeyCodec::kInt4) {
      return DecodeKeysInt4(rows, d, encoded, key_scales, out, out_dtype);
    }
    const DType in_dtype = codec == KeyCodec::kRaw ? raw_dtype : DType::kF16;
    Staging st(this);
    const uint64_t in_bytes = n * d * (codec == KeyCodec::kInt8 ? 1 : DTypeBytes(in_dtype, 1));
    KVCOMP_ASSIGN_OR_RETURN(const void* din, st.In(encoded, in_bytes));
    const void* dsc = nullptr;
    if (codec == KeyCodec::kInt8) {
      KVCOMP_ASSIGN_OR_RETURN(dsc, st.In(key_scales, heads * d * sizeof(float)));
    }
    KVCOMP_ASSIGN_OR_RETURN(void* dout, st.Out(out, n * d * DTypeBytes(out_dtype, 1)));
    const std::vector<Tile> tiles = MakeTiles(rows, 64);
    KVCOMP_ASSIGN_OR_RETURN(const Tile* dt, st.Tiles(tiles));
    KVCOMP_RETURN_IF_ERROR(codec_cuda::LaunchDecodeKeys(
        ctx_->stream, dt, tiles.size(), din, in_dtype, static_cast<uint32_t>(d),
        static_cast<const float*>(dsc), codec == KeyCodec::kInt8, dout, out_dtype));
    return st.Finish();
  }

  absl::Status AccumulateSecondMoment(const HeadsView& values, absl::Span<double> gram) override {
    if (!IsInputDType(values.dtype)) {
      return absl::InvalidArgumentError("codec: value dtype must be f32, f16 or bf16");
    }
    const uint64_t d = values.head_dim, heads = values.num_heads, t = values.num_tokens;
    if (gram.size() != heads * d * d) {
      return absl::InvalidArgumentError("codec: gram size does not match the values");
    }
    if (t == 0 || heads == 0) return absl::OkStatus();
    if (values.data == nullptr) return absl::InvalidArgumentError("codec: null values");
    KVCOMP_RETURN_IF_ERROR(EnsureHandles());
    // Bytes the view spans, for staging a host view.
    const uint64_t span = (heads - 1) * values.head_stride + (t - 1) * values.token_stride + d;
    Staging st(this);
    KVCOMP_ASSIGN_OR_RETURN(const void* dv, st.In(values.data, span * DTypeBytes(values.dtype, 1)));
    KVCOMP_ASSIGN_OR_RETURN(Buffer dense, Buffer::Allocate(*ctx_->allocator, heads * t * d * 4));
    KVCOMP_ASSIGN_OR_RETURN(Buffer g, Buffer::Allocate(*ctx_->allocator, heads * d * d * 4));
    const int blocks = static_cast<int>(std::min<uint64_t>((heads * t * d + 255) / 256, 65535));
    switch (values.dtype) {
      case DType::kF32:
        codec_cuda::GatherF32Kernel<float><<<blocks, 256, 0, ctx_->stream>>>(
            static_cast<const float*>(dv), heads, t, d, values.token_stride, values.head_stride,
            dense.as<float>());
        break;
      case DType::kF16:
        codec_cuda::GatherF32Kernel<__half><<<blocks, 256, 0, ctx_->stream>>>(
            static_cast<const __half*>(dv), heads, t, d, values.token_stride, values.head_stride,
            dense.as<float>());
        break;
      default:
        codec_cuda::GatherF32Kernel<__nv_bfloat16><<<blocks, 256, 0, ctx_->stream>>>(
            static_cast<const __nv_bfloat16*>(dv), heads, t, d, values.token_stride,
            values.head_stride, dense.as<float>());
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    // Column-major X = V_h^T (d x t, ld d); G_h = X X^T.
    const float one = 1.0f, zero = 0.0f;
    KVCOMP_RETURN_IF_ERROR(CublasStatus(
        cublasSgemmStridedBatched(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(d),
                                  static_cast<int>(d), static_cast<int>(t), &one,
                                  dense.as<float>(), static_cast<int>(d),
                                  static_cast<long long>(t * d), dense.as<float>(),
                                  static_cast<int>(d), static_cast<long long>(t * d), &zero,
                                  g.as<float>(), static_cast<int>(d),
                                  static_cast<long long>(d * d), static_cast<int>(heads)),
        "cublasSgemmStridedBatched"));
    std::vector<float> host(heads * d * d);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), g.data(), host.size() * 4,
                                                cudaMemcpyDeviceToHost, ctx_->stream));
    KVCOMP_RETURN_IF_ERROR(st.Finish());
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));  // `host` is read next
    for (size_t i = 0; i < host.size(); ++i) gram[i] += host[i];  // symmetric: layout agnostic
    return absl::OkStatus();
  }

  absl::Status EigenDecompose(uint32_t dim, uint64_t batch, absl::Span<const double> gram,
                              absl::Span<double> eigenvalues,
                              absl::Span<double> eigenvectors) override {
    KVCOMP_RETURN_IF_ERROR(codec_internal::CheckEigenArgs(dim, batch, gram.size(),
                                                          eigenvalues.size(), eigenvectors.size()));
    const uint64_t dd = uint64_t{dim} * dim;
    if (batch == 0) return absl::OkStatus();
    KVCOMP_RETURN_IF_ERROR(EnsureHandles());
    KVCOMP_ASSIGN_OR_RETURN(Buffer a, Buffer::Allocate(*ctx_->allocator, batch * dd * 8));
    KVCOMP_ASSIGN_OR_RETURN(Buffer w, Buffer::Allocate(*ctx_->allocator, batch * dim * 8));
    KVCOMP_ASSIGN_OR_RETURN(Buffer info, Buffer::Allocate(*ctx_->allocator, batch * sizeof(int)));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.data(), gram.data(), batch * dd * 8,
                                                cudaMemcpyHostToDevice, ctx_->stream));
    int lwork = 0;
    KVCOMP_RETURN_IF_ERROR(CusolverStatus(
        cusolverDnDsyevd_bufferSize(cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER,
                                    static_cast<int>(dim), a.as<double>(), static_cast<int>(dim),
                                    w.as<double>(), &lwork),
        "cusolverDnDsyevd_bufferSize"));
    KVCOMP_ASSIGN_OR_RETURN(Buffer work,
                            Buffer::Allocate(*ctx_->allocator, std::max(lwork, 1) * 8ull));
    for (uint64_t b = 0; b < batch; ++b) {
      KVCOMP_RETURN_IF_ERROR(CusolverStatus(
          cusolverDnDsyevd(cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER,
                           static_cast<int>(dim), a.as<double>() + b * dd, static_cast<int>(dim),
                           w.as<double>() + b * dim, work.as<double>(), lwork,
                           info.as<int>() + b),
          "cusolverDnDsyevd"));
    }
    std::vector<double> vecs(batch * dd), vals(batch * dim);
    std::vector<int> infos(batch);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(vecs.data(), a.data(), batch * dd * 8,
                                                cudaMemcpyDeviceToHost, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(vals.data(), w.data(), batch * dim * 8,
                                                cudaMemcpyDeviceToHost, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(infos.data(), info.data(), batch * sizeof(int),
                                                cudaMemcpyDeviceToHost, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    for (uint64_t b = 0; b < batch; ++b) {
      if (infos[b] != 0) {
        return absl::InternalError(absl::StrFormat(
            "codec (CUDA): syevd of matrix %u did not converge (info %d)", b, infos[b]));
      }
      // Ascending with column-major eigenvectors (column j contiguous): reverse into rows.
      for (uint32_t j = 0; j < dim; ++j) {
        const uint32_t src = dim - 1 - j;
        eigenvalues[b * dim + j] = vals[b * dim + src];
        std::memcpy(&eigenvectors[b * dd + uint64_t{j} * dim], &vecs[b * dd + uint64_t{src} * dim],
                    dim * sizeof(double));
      }
    }
    return absl::OkStatus();
  }

 private:
  // Resident blocks of 256 threads on the device (the hq kernels loop over their rows).
  int MaxBlocks() const {
    return std::max(1, ctx_->properties.multiProcessorCount) *
           std::max(1, ctx_->properties.maxThreadsPerMultiProcessor / 256);
  }

  // Device copies of host inputs/outputs for one call; Finish copies outputs back and, when the
  // call copied from or to the caller's host memory, waits for the stream (the caller may reuse
  // that memory once the call returns). A call on device memory alone does not wait: its kernels
  // complete in the stream's order, and its own small uploads (tile lists, offsets) come from
  // pageable host memory, which the copy has read by the time it returns; their device buffers
  // are freed in stream order.
  class Staging {
   public:
    explicit Staging(CudaCodecOps* ops) : ops_(ops) {}
    absl::StatusOr<const void*> In(const void* p, uint64_t bytes) {
      if (p == nullptr || bytes == 0 || IsDevicePointer(p)) return p;
      caller_host_ = true;
      KVCOMP_ASSIGN_OR_RETURN(Buffer b, Buffer::Allocate(*ops_->ctx_->allocator, bytes));
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.data(), p, bytes, cudaMemcpyHostToDevice,
                                                  ops_->ctx_->stream));
      bufs_.push_back(std::move(b));
      return const_cast<const void*>(bufs_.back().data());
    }
    absl::StatusOr<void*> Out(void* p, uint64_t bytes) {
      if (p == nullptr || bytes == 0 || IsDevicePointer(p)) return p;
      caller_host_ = true;
      KVCOMP_ASSIGN_OR_RETURN(Buffer b, Buffer::Allocate(*ops_->ctx_->allocator, bytes));
      outs_.push_back({p, b.data(), bytes});
      bufs_.push_back(std::move(b));
      return bufs_.back().data();
    }
    absl::StatusOr<const void*> Bytes(const void* p, uint64_t bytes) { return Upload(p, bytes); }
    // The heads' offsets and tile counts of a codec_cuda::TileList (one small upload); *count
    // receives the number of tiles.
    absl::StatusOr<codec_cuda::TileList> List(const RowSpan& rows, uint32_t tile_rows,
                                              uint64_t* count) {
      const uint64_t heads = rows.num_heads();
      std::vector<uint64_t> words(2 * heads + 2);
      std::copy(rows.row_offsets.begin(), rows.row_offsets.end(), words.begin());
      auto* first = reinterpret_cast<uint32_t*>(words.data() + heads + 1);
      uint64_t tiles = 0;
      for (uint64_t h = 0; h < heads; ++h) {
        first[h] = static_cast<uint32_t>(tiles);
        tiles += (rows.row_offsets[h + 1] - rows.row_offsets[h] + tile_rows - 1) / tile_rows;
      }
      first[heads] = static_cast<uint32_t>(tiles);
      if (tiles >= (uint64_t{1} << 31)) {
        return absl::InvalidArgumentError("codec (CUDA): too many rows in one call");
      }
      *count = tiles;
      KVCOMP_ASSIGN_OR_RETURN(const void* p, Upload(words.data(), words.size() * 8));
      const auto* w = static_cast<const uint64_t*>(p);
      return codec_cuda::TileList{w, reinterpret_cast<const uint32_t*>(w + heads + 1),
                                  static_cast<uint32_t>(heads), tile_rows};
    }
    absl::StatusOr<const Tile*> Tiles(const std::vector<Tile>& tiles) {
      KVCOMP_ASSIGN_OR_RETURN(const void* p, Upload(tiles.data(), tiles.size() * sizeof(Tile)));
      return static_cast<const Tile*>(p);
    }
    absl::StatusOr<const uint64_t*> Offsets(const RowSpan& rows) {
      KVCOMP_ASSIGN_OR_RETURN(const void* p, Upload(rows.row_offsets.data(),
                                                    rows.row_offsets.size() * sizeof(uint64_t)));
      return static_cast<const uint64_t*>(p);
    }
    absl::Status Finish() {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      for (const auto& o : outs_) {
        KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(o.host, o.device, o.bytes,
                                                    cudaMemcpyDeviceToHost, ops_->ctx_->stream));
      }
      if (caller_host_) KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ops_->ctx_->stream));
      return absl::OkStatus();
    }
    ~Staging() {
      // Buffers are freed stream-ordered; the caller's host memory must outlive queued copies.
      if (caller_host_) cudaStreamSynchronize(ops_->ctx_->stream);
    }

   private:
    absl::StatusOr<const void*> Upload(const void* p, uint64_t bytes) {
      if (bytes == 0) return static_cast<const void*>(nullptr);
      KVCOMP_ASSIGN_OR_RETURN(Buffer b, Buffer::Allocate(*ops_->ctx_->allocator, bytes));
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.data(), p, bytes, cudaMemcpyHostToDevice,
                                                  ops_->ctx_->stream));
      bufs_.push_back(std::move(b));
      return const_cast<const void*>(bufs_.back().data());
    }
    struct OutCopy {
      void* host;
      void* device;
      uint64_t bytes;
    };
    CudaCodecOps* ops_;
    std::list<Buffer> bufs_;  // stable addresses
    std::vector<OutCopy> outs_;
    bool caller_host_ = false;  // In or Out staged the caller's host memory
  };

  static uint64_t MaxRows(absl::Span<const uint64_t> row_offsets) {
    uint64_t m = 0;
    for (size_t h = 0; h + 1 < row_offsets.size(); ++h) {
      m = std::max(m, row_offsets[h + 1] - row_offsets[h]);
    }
    return m;
  }

  // One pq basis on the device (pq_cuda::Layout), named by its fingerprint and shape.
  struct DevicePq {
    uint64_t fingerprint = 0;
    uint64_t heads = 0;
    uint32_t head_dim = 0;
    uint32_t bits_total = 0;
    uint64_t bytes = 0;
    Buffer mem;
    pq_cuda::DeviceBasisView view;
  };

  // The basis uploaded once per fingerprint (validated then) and kept, most recently used
  // first, under kMaxPqBytes (the newest entry always stays).
  absl::StatusOr<const DevicePq*> UploadPq(const pq::Basis& basis, uint64_t fingerprint) {
    if (fingerprint == 0) fingerprint = basis.Fingerprint();
    for (auto it = pq_bases_.begin(); it != pq_bases_.end(); ++it) {
      if (it->fingerprint == fingerprint && it->heads == basis.num_heads() &&
          it->head_dim == basis.head_dim && it->bits_total == basis.bits_total) {
        pq_bases_.splice(pq_bases_.begin(), pq_bases_, it);
        return &pq_bases_.front();
      }
    }
    KVCOMP_RETURN_IF_ERROR(basis.Validate());
    const pq_cuda::Layout layout = pq_cuda::LayoutOf(basis);
    const std::vector<uint8_t> image = pq_cuda::HostImage(basis, layout);
    if (!pq_bases_.empty() && pq_bytes_ + layout.bytes > kMaxPqBytes) {
      // Earlier launches may still read an entry about to go.
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
      while (!pq_bases_.empty() && pq_bytes_ + layout.bytes > kMaxPqBytes) {
        pq_bytes_ -= pq_bases_.back().bytes;
        pq_bases_.pop_back();
      }
    }
    DevicePq db;
    db.fingerprint = fingerprint;
    db.heads = basis.num_heads();
    db.head_dim = basis.head_dim;
    db.bits_total = basis.bits_total;
    db.bytes = layout.bytes;
    KVCOMP_ASSIGN_OR_RETURN(db.mem, Buffer::Allocate(*ctx_->allocator, layout.bytes));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(db.mem.data(), image.data(), image.size(),
                                                cudaMemcpyHostToDevice, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    db.view = pq_cuda::ViewOf(basis, layout, db.mem.data());
    pq_bytes_ += db.bytes;
    pq_bases_.push_front(std::move(db));
    return &pq_bases_.front();
  }

  // The matrices of heads [first_head, first_head + num_heads) of one projection at one rank.
  // A whole-cache call uploads every head; a per-layer call (caches with per-layer ranks) only
  // its layer's, so a cache of many ranks holds one small entry per layer, not a full copy each.
  struct DeviceProjection {
    uint64_t version = 0;
    uint32_t rank = 0;
    bool gamma = false;
    uint64_t first_head = 0;
    uint64_t num_heads = 0;
    uint64_t bytes = 0;
    Buffer dec16;  // [heads][r_pad][d] f16
  };

  absl::StatusOr<const DeviceProjection*> Upload(const Projection& proj,
                                                 const ValueCodecParams& params,
                                                 const RowSpan& rows) {
    const bool gamma = params.UsesGamma();
    const uint64_t first = rows.first_head, heads = rows.num_heads();
    for (auto it = projections_.begin(); it != projections_.end(); ++it) {
      if (it->version == proj.version && it->rank == params.rank && it->gamma == gamma &&
          it->first_head <= first && first + heads <= it->first_head + it->num_heads) {
        projections_.splice(projections_.begin(), projections_, it);
        return &projections_.front();
      }
    }
    const uint64_t d = proj.head_dim, r = params.rank;
    const uint64_t r_pad = (r + 15) / 16 * 16;
    std::vector<__half> dec(heads * r_pad * d, __float2half(0.0f));
    std::vector<float> enc, decf;
    for (uint64_t h = 0; h < heads; ++h) {
      codec_internal::HeadMatrices(proj, first + h, params, &enc, &decf);
      for (uint64_t j = 0; j < r; ++j) {
        for (uint64_t k = 0; k < d; ++k) {
          dec[(h * r_pad + j) * d + k] = __float2half_rn(decf[j * d + k]);
        }
      }
    }
    DeviceProjection dp;
    dp.version = proj.version;
    dp.rank = params.rank;
    dp.gamma = gamma;
    dp.first_head = first;
    dp.num_heads = heads;
    dp.bytes = dec.size() * 2;
    // Keep the cached matrices under kMaxProjectionBytes (the newest entry always stays).
    while (!projections_.empty() && projection_bytes_ + dp.bytes > kMaxProjectionBytes) {
      projection_bytes_ -= projections_.back().bytes;
      projections_.pop_back();
    }
    KVCOMP_ASSIGN_OR_RETURN(dp.dec16, Buffer::Allocate(*ctx_->allocator, dec.size() * 2));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dp.dec16.data(), dec.data(), dec.size() * 2,
                                                cudaMemcpyHostToDevice, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    projection_bytes_ += dp.bytes;
    projections_.push_front(std::move(dp));
    return &projections_.front();
  }

  // A RowSpan as the one layer of a fused call.
  static kvsplice_internal::LayerRows OneSpan(const RowSpan& rows, const ValueCodecParams& p) {
    kvsplice_internal::LayerRows L;
    L.offsets.assign(rows.row_offsets.begin(), rows.row_offsets.end());
    L.first_head = rows.first_head;
    L.params = p;
    return L;
  }

  // The fused encoder (codec_encode.cuh) over `layers` (rows, latents and scales as
  // kvsplice_internal::SplitLayers lays them out): one launch for all of them. latent null: the
  // measure only.
  absl::Status EncodeLayers(const Projection& projection, const ValueCodecParams& params,
                            const std::vector<kvsplice_internal::LayerRows>& layers,
                            const void* values, DType dtype, void* latent, uint16_t* scales,
                            float* energy, float* lost) {
    const uint32_t d = projection.head_dim, R = params.rank;
    if (FusedRPad(R) > 256) {
      return absl::InvalidArgumentError(absl::StrFormat("codec (CUDA): rank %u above 256", R));
    }
    std::vector<codec_cuda::FusedHead> heads;
    uint64_t rows_total = 0, latent_total = 0, scale_total = 0, tiles = 0;
    for (const kvsplice_internal::LayerRows& L : layers) {
      const uint64_t lb = L.params.LatentBytes(), g = L.params.Groups();
      for (uint64_t h = 0; h + 1 < L.offsets.size(); ++h) {
        const uint64_t b = L.offsets[h], m = L.offsets[h + 1] - b;
        heads.push_back({L.first_row + b, L.latent_byte + b * lb, L.scale_elem + b * g,
                         static_cast<uint32_t>(L.first_head + h), static_cast<uint32_t>(m),
                         L.params.rank, static_cast<uint32_t>(tiles)});
        tiles += (m + codec_cuda::kFusedRows - 1) / codec_cuda::kFusedRows;
      }
      rows_total = std::max(rows_total, L.first_row + L.offsets.back());
      latent_total = std::max(latent_total, L.latent_byte + L.offsets.back() * lb);
      scale_total = std::max(scale_total, L.scale_elem + L.offsets.back() * g);
    }
    if (tiles >= (uint64_t{1} << 32)) {
      return absl::InvalidArgumentError("codec (CUDA): too many rows in one call");
    }
    if (tiles == 0) return absl::OkStatus();
    KVCOMP_ASSIGN_OR_RETURN(const DeviceBasis* basis, UploadBasis(projection, R));
    Staging st(this);
    KVCOMP_ASSIGN_OR_RETURN(const void* dv, st.In(values, rows_total * d * DTypeBytes(dtype, 1)));
    void* dl = nullptr;
    void* ds = nullptr;
    if (latent != nullptr) {
      KVCOMP_ASSIGN_OR_RETURN(dl, st.Out(latent, latent_total));
      KVCOMP_ASSIGN_OR_RETURN(ds, st.Out(scales, scale_total * 2));
    }
    void* de = nullptr;
    void* dlost = nullptr;
    if (energy != nullptr) {
      KVCOMP_ASSIGN_OR_RETURN(de, st.Out(energy, rows_total * sizeof(float)));
      KVCOMP_ASSIGN_OR_RETURN(dlost, st.Out(lost, rows_total * sizeof(float)));
    }
    KVCOMP_ASSIGN_OR_RETURN(const void* dh,
                            st.Bytes(heads.data(), heads.size() * sizeof(codec_cuda::FusedHead)));
    codec_cuda::FusedParams p;
    p.heads = static_cast<const codec_cuda::FusedHead*>(dh);
    p.num_heads = static_cast<uint32_t>(heads.size());
    p.first_block = 0;
    p.values = dv;
    p.basis_t = basis->basis_t.as<float>();
    p.gamma = latent != nullptr && params.UsesGamma() ? basis->gamma.as<float>() : nullptr;
    p.latent = static_cast<uint8_t*>(dl);
    p.scales = static_cast<uint16_t*>(ds);
    p.energy = static_cast<float*>(de);
    p.lost = static_cast<float*>(dlost);
    p.d = d;
    p.R = R;
    p.group_size = params.Groups() > 0 ? params.group_size : 1;
    p.kind = codec_cuda::KindOf(params.codec);
    p.vec = (uint64_t{d} * DTypeBytes(dtype, 1)) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(dv) % 16 == 0;
    const uint32_t groups = static_cast<uint32_t>(params.Groups());
    switch (dtype) {
      case DType::kF32:
        KVCOMP_RETURN_IF_ERROR(LaunchFused<float>(p, tiles, groups));
        break;
      case DType::kF16:
        KVCOMP_RETURN_IF_ERROR(LaunchFused<__half>(p, tiles, groups));
        break;
      default:
        KVCOMP_RETURN_IF_ERROR(LaunchFused<__nv_bfloat16>(p, tiles, groups));
    }
    return st.Finish();
  }

  template <typename T>
  absl::Status LaunchFused(const codec_cuda::FusedParams& p, size_t tiles, uint32_t groups) {
    const uint32_t items = FusedRPad(p.R) / 4 * (codec_cuda::kFusedRows / 4);
    if (items <= codec_cuda::kFusedThreads) return LaunchFusedItems<T, 1>(p, tiles, groups);
    if (items <= 2 * codec_cuda::kFusedThreads) return LaunchFusedItems<T, 2>(p, tiles, groups);
    return LaunchFusedItems<T, 4>(p, tiles, groups);
  }

  template <typename T, int kItems>
  absl::Status LaunchFusedItems(const codec_cuda::FusedParams& p, size_t tiles,
                                uint32_t groups) {
    const size_t smem = codec_cuda::FusedSmemBytes(p.d, p.R, groups);
    if (smem > ctx_->properties.sharedMemPerBlockOptin) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "codec (CUDA): rank %u at head_dim %u needs %u bytes of shared memory (device: %u)",
          p.R, p.d, smem, ctx_->properties.sharedMemPerBlockOptin));
    }
    if (smem > 48 * 1024) {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          codec_cuda::FusedEncodeKernel<T, kItems>, cudaFuncAttributeMaxDynamicSharedMemorySize,
          static_cast<int>(smem)));
    }
    for (size_t first = 0; first < tiles; first += kMaxGrid) {
      codec_cuda::FusedParams q = p;
      q.first_block = static_cast<uint32_t>(first);
      const auto grid = static_cast<unsigned>(std::min<size_t>(kMaxGrid, tiles - first));
      codec_cuda::FusedEncodeKernel<T, kItems>
          <<<grid, codec_cuda::kFusedThreads, smem, ctx_->stream>>>(q);
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    return absl::OkStatus();
  }

  // Every head's basis transposed ([heads][d][R] f32, B = P_R^T) and gamma ([heads][R]) of one
  // projection, uploaded once per (version, R) and kept with the decode matrices.
  struct DeviceBasis {
    uint64_t version = 0;
    uint32_t rank = 0;
    uint64_t bytes = 0;
    Buffer basis_t;
    Buffer gamma;
  };

  absl::StatusOr<const DeviceBasis*> UploadBasis(const Projection& proj, uint32_t R) {
    for (auto it = bases_.begin(); it != bases_.end(); ++it) {
      if (it->version == proj.version && it->rank == R) {
        bases_.splice(bases_.begin(), bases_, it);
        return &bases_.front();
      }
    }
    const uint64_t heads = proj.num_heads(), d = proj.head_dim;
    std::vector<float> bt(heads * d * R), g(heads * R);
    for (uint64_t h = 0; h < heads; ++h) {
      const float* basis = proj.head_basis(h);
      for (uint64_t j = 0; j < R; ++j) {
        g[h * R + j] = proj.head_gamma(h)[j];
        for (uint64_t k = 0; k < d; ++k) bt[(h * d + k) * R + j] = basis[j * d + k];
      }
    }
    DeviceBasis db;
    db.version = proj.version;
    db.rank = R;
    db.bytes = (bt.size() + g.size()) * 4;
    while (!bases_.empty() && basis_bytes_ + db.bytes > kMaxProjectionBytes) {
      basis_bytes_ -= bases_.back().bytes;
      bases_.pop_back();
    }
    KVCOMP_ASSIGN_OR_RETURN(db.basis_t, Buffer::Allocate(*ctx_->allocator, bt.size() * 4));
    KVCOMP_ASSIGN_OR_RETURN(db.gamma, Buffer::Allocate(*ctx_->allocator, g.size() * 4));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(db.basis_t.data(), bt.data(), bt.size() * 4,
                                                cudaMemcpyHostToDevice, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(db.gamma.data(), g.data(), g.size() * 4,
                                                cudaMemcpyHostToDevice, ctx_->stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_->stream));
    basis_bytes_ += db.bytes;
    bases_.push_front(std::move(db));
    return &bases_.front();
  }

  template <int D>
  absl::Status DecodeByDType(codec_cuda::DecodeParams p, const RowSpan& rows, DType out_dtype,
                             Staging* st) {
    // The pipelined tensor-core expand where the latent layout allows it (KVCOMP_CUDA_EXPAND=0
    // keeps the WMMA kernel, for comparisons); the WMMA kernel otherwise.
    static const bool expand = internal::SwitchOn("KVCOMP_CUDA_EXPAND");
    if (expand && codec_cuda::ExpandEligible(p.r, p.group_size, p.latent_bytes, p.kind,
                                             reinterpret_cast<uintptr_t>(p.latent))) {
      // Slots per layout and output dtype, asked of the driver once (the query also sets the
      // kernel's shared-memory attribute and reads the device's limits).
      const SlotsKey key{p.r_pad, p.latent_bytes, p.groups, static_cast<int>(p.kind),
                         static_cast<int>(out_dtype), D};
      auto it = expand_slots_.find(key);
      if (it == expand_slots_.end()) {
        KVCOMP_ASSIGN_OR_RETURN(const uint64_t found, codec_cuda::ExpandSlots(p, D, out_dtype));
        it = expand_slots_.emplace(key, found).first;
      }
      const uint64_t slots = it->second;
      const std::vector<Tile> tiles = codec_cuda::ExpandTiles(
          rows.row_offsets.data(), rows.num_heads(), codec_cuda::ExpandShape<D>::M, slots);
      KVCOMP_ASSIGN_OR_RETURN(p.tiles, st->Tiles(tiles));
      return codec_cuda::LaunchExpandValues(ctx_->stream, p, tiles.size(), D, out_dtype);
    }
    const std::vector<Tile> tiles = MakeTiles(rows, codec_cuda::DecodeShape<D>::kTileRows);
    KVCOMP_ASSIGN_OR_RETURN(p.tiles, st->Tiles(tiles));
    switch (out_dtype) {
      case DType::kF32:
        return LaunchDecode<float, D>(p, tiles.size());
      case DType::kF16:
        return LaunchDecode<__half, D>(p, tiles.size());
      default:
        return LaunchDecode<__nv_bfloat16, D>(p, tiles.size());
    }
  }

  template <typename T, int D>
  absl::Status LaunchDecode(const codec_cuda::DecodeParams& p, size_t tiles) {
    const size_t smem = codec_cuda::DecodeSmemBytes<D>(p.r_pad);
    if (smem > ctx_->properties.sharedMemPerBlockOptin) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "codec (CUDA): rank %u at head_dim %d needs %u bytes of shared memory (device: %u)",
          p.r, D, smem, ctx_->properties.sharedMemPerBlockOptin));
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(codec_cuda::DecodeValuesKernel<T, D>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(smem)));
    codec_cuda::DecodeValuesKernel<T, D>
        <<<static_cast<unsigned>(tiles), codec_cuda::kDecodeThreads, smem, ctx_->stream>>>(p);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status LaunchKeys(KeyCodec codec, size_t tiles, uint64_t heads, uint64_t max_rows,
                          const codec_cuda::TileList& dt, const uint64_t* doff, const void* dk,
                          uint64_t d, float* dsc, void* dout) {
    const bool int8 = codec == KeyCodec::kInt8;
    if (int8 && heads > 0) {
      // Rows per head split over up to 64 blocks (about 512 rows each).
      const unsigned chunks =
          static_cast<unsigned>(std::clamp<uint64_t>(max_rows / 512, 1, 64));
      KVCOMP_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(dsc, 0, heads * d * sizeof(float), ctx_->stream));
      // Eight channels a thread where the rows are 16-byte aligned (d % 8 == 0).
      const bool vec_scales = d % 8 == 0 && reinterpret_cast<uintptr_t>(dk) % 16 == 0;
      codec_cuda::KeyScalesKernel<T>
          <<<dim3(static_cast<unsigned>(heads), chunks), 256,
             vec_scales ? d * sizeof(unsigned int) : 0, ctx_->stream>>>(
              static_cast<const T*>(dk), doff, static_cast<uint32_t>(d), vec_scales, dsc);
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      const uint64_t ns = heads * d;
      codec_cuda::KeyScalesFinishKernel<float><<<
          static_cast<unsigned>(std::min<uint64_t>((ns + 255) / 256, 4096)), 256, 0,
          ctx_->stream>>>(dsc, ns);
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    if (tiles == 0) return absl::OkStatus();
    auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
    const bool vec = d % 8 == 0 && aligned(dk) && aligned(dout);
    codec_cuda::EncodeKeysKernel<T><<<static_cast<unsigned>(tiles), 256, 0, ctx_->stream>>>(
        dt, static_cast<const T*>(dk), static_cast<uint32_t>(d), dsc, int8, vec, dout);
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }

  // Host-side count of the int4 key scales of `rows` (KeyScaleGroups x d per head).
  static uint64_t Int4ScaleCount(const RowSpan& rows, uint64_t d) {
    uint64_t groups = 0;
    for (uint64_t h = 0; h < rows.num_heads(); ++h) {
      groups += KeyScaleGroups(KeyCodec::kInt4, rows.row_offsets[h + 1] - rows.row_offsets[h]);
    }
    return groups * d;
  }

  absl::Status EncodeKeysInt4(const RowSpan& rows, uint64_t d, const void* keys, DType dtype,
                              void* out, float* key_scales) {
    const uint64_t n = rows.total_rows(), nb = (d + 1) / 2;
    if (n == 0) return absl::OkStatus();
    if (key_scales == nullptr) return absl::InvalidArgumentError("codec: null key_scales");
    Staging st(this);
    KVCOMP_ASSIGN_OR_RETURN(const void* dk, st.In(keys, n * d * DTypeBytes(dtype, 1)));
    KVCOMP_ASSIGN_OR_RETURN(void* dout, st.Out(out, n * nb));
    KVCOMP_ASSIGN_OR_RETURN(void* s, st.Out(key_scales, Int4ScaleCount(rows, d) * sizeof(float)));
    auto* dsc = static_cast<float*>(s);
    uint64_t tiles = 0;
    KVCOMP_ASSIGN_OR_RETURN(const codec_cuda::TileList dt, st.List(rows, 64, &tiles));
    const uint64_t* doff = dt.offsets;
    uint64_t max_groups = 0;
    for (uint64_t h = 0; h < rows.num_heads(); ++h) {
      max_groups = std::max<uint64_t>(
          max_groups,
          KeyScaleGroups(KeyCodec::kInt4, rows.row_offsets[h + 1] - rows.row_offsets[h]));
    }
    // The scales of a head over up to 64 blocks of 256 (group, channel) scans.
    const dim3 heads(static_cast<unsigned>(rows.num_heads()),
                     static_cast<unsigned>(std::clamp<uint64_t>((max_groups * d + 255) / 256, 1, 64)));
    const auto d32 = static_cast<uint32_t>(d);
    const auto g = static_cast<unsigned>(tiles);
    auto* o = static_cast<uint8_t*>(dout);
    switch (dtype) {
      case DType::kF32:
        codec_cuda::KeyInt4ScalesKernel<float><<<heads, 256, 0, ctx_->stream>>>(
            static_cast<const float*>(dk), doff, d32, dsc);
        codec_cuda::EncodeKeysInt4Kernel<float><<<g, 256, 0, ctx_->stream>>>(
            dt, static_cast<const float*>(dk), doff, d32, dsc, o);
        break;
      case DType::kF16:
        codec_cuda::KeyInt4ScalesKernel<__half><<<heads, 256, 0, ctx_->stream>>>(
            static_cast<const __half*>(dk), doff, d32, dsc);
        codec_cuda::EncodeKeysInt4Kernel<__half><<<g, 256, 0, ctx_->stream>>>(
            dt, static_cast<const __half*>(dk), doff, d32, dsc, o);
        break;
      default:
        codec_cuda::KeyInt4ScalesKernel<__nv_bfloat16><<<heads, 256, 0, ctx_->stream>>>(
            static_cast<const __nv_bfloat16*>(dk), doff, d32, dsc);
        codec_cuda::EncodeKeysInt4Kernel<__nv_bfloat16><<<g, 256, 0, ctx_->stream>>>(
            dt, static_cast<const __nv_bfloat16*>(dk), doff, d32, dsc, o);
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return st.Finish();
  }

  absl::Status DecodeKeysInt4(const RowSpan& rows, uint64_t d, const void* encoded,
                              const float* key_scales, void* out, DType out_dtype) {
    const uint64_t n = rows.total_rows(), nb = (d + 1) / 2;
    Staging st(this);
    KVCOMP_ASSIGN_OR_RETURN(const void* din, st.In(encoded, n * nb));
    KVCOMP_ASSIGN_OR_RETURN(const void* dsc,
                            st.In(key_scales, Int4ScaleCount(rows, d) * sizeof(float)));
    KVCOMP_ASSIGN_OR_RETURN(void* dout, st.Out(out, n * d * DTypeBytes(out_dtype, 1)));
    const std::vector<Tile> tiles = MakeTiles(rows, 64);
    KVCOMP_ASSIGN_OR_RETURN(const Tile* dt, st.Tiles(tiles));
    KVCOMP_ASSIGN_OR_RETURN(const uint64_t* doff, st.Offsets(rows));
    const auto g = static_cast<unsigned>(tiles.size());
    const auto* in = static_cast<const uint8_t*>(din);
    const auto* sc = static_cast<const float*>(dsc);
    const auto d32 = static_cast<uint32_t>(d);
    switch (out_dtype) {
      case DType::kF32:
        codec_cuda::DecodeKeysInt4Kernel<float><<<g, 256, 0, ctx_->stream>>>(
            dt, in, doff, d32, sc, static_cast<float*>(dout));
        break;
      case DType::kF16:
        codec_cuda::DecodeKeysInt4Kernel<__half><<<g, 256, 0, ctx_->stream>>>(
            dt, in, doff, d32, sc, static_cast<__half*>(dout));
        break;
      default:
        codec_cuda::DecodeKeysInt4Kernel<__nv_bfloat16><<<g, 256, 0, ctx_->stream>>>(
            dt, in, doff, d32, sc, static_cast<__nv_bfloat16*>(dout));
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return st.Finish();
  }

  absl::Status CheckValueCall(const Projection& projection, const ValueCodecParams& params,
                              const RowSpan& rows, DType dtype) {
    KVCOMP_RETURN_IF_ERROR(params.ValidateFor(projection));
    KVCOMP_RETURN_IF_ERROR(rows.Validate(projection.num_heads()));
    if (!IsInputDType(dtype)) {
      return absl::InvalidArgumentError("codec: value dtype must be f32, f16 or bf16");
    }
    if (rows.total_rows() > 0) {
      for (uint64_t h = 0; h < rows.num_heads(); ++h) {
        if (rows.row_offsets[h + 1] - rows.row_offsets[h] > (uint64_t{1} << 31)) {
          return absl::InvalidArgumentError("codec (CUDA): too many rows in one head");
        }
      }
    }
    return cudaSetDevice(ctx_->device) == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError("codec (CUDA): cudaSetDevice failed");
  }

  absl::Status CheckKeyCall(KeyCodec codec, const RowSpan& rows, uint32_t head_dim, DType dtype,
                            DType out_dtype) {
    if (static_cast<uint8_t>(codec) > static_cast<uint8_t>(KeyCodec::kInt4)) {
      return absl::InvalidArgumentError("codec: unknown key codec");
    }
    if (head_dim == 0 || head_dim > 1024) {
      return absl::InvalidArgumentError("codec: head_dim out of range");
    }
    KVCOMP_RETURN_IF_ERROR(rows.Validate(~uint64_t{0}));
    if (!IsInputDType(dtype) || !IsInputDType(out_dtype)) {
      return absl::InvalidArgumentError("codec: key dtype must be f32, f16 or bf16");
    }
    return cudaSetDevice(ctx_->device) == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError("codec (CUDA): cudaSetDevice failed");
  }

  absl::Status EnsureHandles() {
    if (cublas_ == nullptr) {
      KVCOMP_RETURN_IF_ERROR(CublasStatus(cublasCreate(&cublas_), "cublasCreate"));
      KVCOMP_RETURN_IF_ERROR(CublasStatus(cublasSetStream(cublas_, ctx_->stream), "cublasSetStream"));
    }
    if (cusolver_ == nullptr) {
      KVCOMP_RETURN_IF_ERROR(CusolverStatus(cusolverDnCreate(&cusolver_), "cusolverDnCreate"));
      KVCOMP_RETURN_IF_ERROR(
          CusolverStatus(cusolverDnSetStream(cusolver_, ctx_->stream), "cusolverDnSetStream"));
    }
    return absl::OkStatus();
  }

  static constexpr uint64_t kMaxProjectionBytes = uint64_t{256} << 20;
  CudaContext* ctx_;
  // DecodeByDType's occupancy answers: (r_pad, latent bytes, groups, kind, out dtype, D).
  using SlotsKey = std::tuple<uint32_t, uint32_t, uint32_t, int, int, int>;
  std::map<SlotsKey, uint64_t> expand_slots_;
  cublasHandle_t cublas_ = nullptr;
  cusolverDnHandle_t cusolver_ = nullptr;
  static constexpr size_t kMaxGrid = 1u << 30;
  std::list<DeviceProjection> projections_;  // most recently used first
  uint64_t projection_bytes_ = 0;
  std::list<DeviceBasis> bases_;  // most recently used first
  uint64_t basis_bytes_ = 0;
  // A model's keys' and values' bases (about 33 MiB each at 32 layers x 8 kv heads x 128).
  static constexpr uint64_t kMaxPqBytes = uint64_t{512} << 20;
  std::list<DevicePq> pq_bases_;  // most recently used first
  uint64_t pq_bytes_ = 0;
};

}  // namespace

std::unique_ptr<CodecOps> NewCudaCodecOps(CudaContext* context) {
  return std::make_unique<CudaCodecOps>(context);
}

}  // namespace kvcomp

namespace kvcomp {
namespace codec_cuda {
namespace {

// One instantiation of the expand: launched, or its blocks per SM when `blocks` is set.
template <typename T, int D, LatentKind K>
absl::Status ExpandAs(cudaStream_t stream, const DecodeParams& p, size_t tiles, int* blocks) {
  const size_t smem = ExpandSmemLayout<D>(p.r_pad, K, p.groups, sizeof(T)).total;
  int device = 0, optin = 0;
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem > static_cast<size_t>(optin)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "codec (CUDA): rank %u at head_dim %d needs %u bytes of shared memory (device: %d)", p.r,
        D, smem, optin));
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      ExpandValuesKernel<T, D, K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(smem)));
  if (blocks != nullptr) {
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks, ExpandValuesKernel<T, D, K>, kExpandThreads, smem));
    return absl::OkStatus();
  }
  if (tiles == 0) return absl::OkStatus();
  ExpandValuesKernel<T, D, K><<<static_cast<unsigned>(tiles), kExpandThreads, smem, stream>>>(p);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

template <typename T, int D>
absl::Status ExpandKind(cudaStream_t stream, const DecodeParams& p, size_t tiles, int* blocks) {
  switch (p.kind) {
    case LatentKind::kInt8:
      return ExpandAs<T, D, LatentKind::kInt8>(stream, p, tiles, blocks);
    case LatentKind::kInt4:
      return ExpandAs<T, D, LatentKind::kInt4>(stream, p, tiles, blocks);
    default:
      return ExpandAs<T, D, LatentKind::kF16>(stream, p, tiles, blocks);
  }
}

template <int D>
absl::Status ExpandDType(cudaStream_t stream, const DecodeParams& p, size_t tiles, DType out,
                         int* blocks) {
  switch (out) {
    case DType::kF32:
      return ExpandKind<float, D>(stream, p, tiles, blocks);
    case DType::kF16:
      return ExpandKind<__half, D>(stream, p, tiles, blocks);
    case DType::kBF16:
      return ExpandKind<__nv_bfloat16, D>(stream, p, tiles, blocks);
    default:
      return absl::InvalidArgumentError("codec (CUDA): output dtype must be f32, f16 or bf16");
  }
}

absl::Status Expand(cudaStream_t stream, const DecodeParams& p, size_t tiles, uint32_t head_dim,
                    DType out_dtype, int* blocks) {
  if (!ExpandEligible(p.r, p.group_size, p.latent_bytes, p.kind,
                      reinterpret_cast<uintptr_t>(p.latent))) {
    return absl::InvalidArgumentError("codec (CUDA): latent layout unfit for the pipelined expand");
  }
  switch (head_dim) {
    case 64:
      return ExpandDType<64>(stream, p, tiles, out_dtype, blocks);
    case 128:
      return ExpandDType<128>(stream, p, tiles, out_dtype, blocks);
    case 256:
      return ExpandDType<256>(stream, p, tiles, out_dtype, blocks);
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("codec (CUDA): head_dim %u (64, 128 or 256)", head_dim));
  }
}

template <typename Out>
void KeysAs(cudaStream_t stream, const Tile* dt, unsigned g, const void* din, DType in_dtype,
            uint32_t d, const float* sc, bool int8, void* dout) {
  auto* o = static_cast<Out*>(dout);
  auto aligned = [](const void* ptr, uintptr_t n) { return reinterpret_cast<uintptr_t>(ptr) % n == 0; };
  const bool vec = d % 8 == 0 && aligned(dout, 16) &&
                   (int8 ? aligned(din, 8) && aligned(sc, 16)
                         : in_dtype != DType::kF32 && aligned(din, 16));
  switch (in_dtype) {
    case DType::kF32:
      DecodeKeysKernel<float, Out><<<g, 256, 0, stream>>>(dt, din, d, sc, int8, vec && int8, o);
      break;
    case DType::kF16:
      DecodeKeysKernel<__half, Out><<<g, 256, 0, stream>>>(dt, din, d, sc, int8, vec, o);
      break;
    default:
      DecodeKeysKernel<__nv_bfloat16, Out><<<g, 256, 0, stream>>>(dt, din, d, sc, int8, vec, o);
  }
}

}  // namespace

absl::Status LaunchExpandValues(cudaStream_t stream, const DecodeParams& p, size_t tiles,
                                uint32_t head_dim, DType out_dtype) {
  return Expand(stream, p, tiles, head_dim, out_dtype, nullptr);
}

absl::StatusOr<uint64_t> ExpandSlots(const DecodeParams& p, uint32_t head_dim, DType out_dtype) {
  int blocks = 0, device = 0, sms = 0;
  KVCOMP_RETURN_IF_ERROR(Expand(nullptr, p, 0, head_dim, out_dtype, &blocks));
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<uint64_t>(std::max(blocks, 1)) * static_cast<uint64_t>(std::max(sms, 1));
}

absl::Status LaunchDecodeKeys(cudaStream_t stream, const Tile* tiles, size_t num_tiles,
                              const void* in, DType in_dtype, uint32_t head_dim,
                              const float* scales, bool int8, void* out, DType out_dtype) {
  if (num_tiles == 0) return absl::OkStatus();
  const unsigned g = static_cast<unsigned>(num_tiles);
  switch (out_dtype) {
    case DType::kF32:
      KeysAs<float>(stream, tiles, g, in, in_dtype, head_dim, scales, int8, out);
      break;
    case DType::kF16:
      KeysAs<__half>(stream, tiles, g, in, in_dtype, head_dim, scales, int8, out);
      break;
    case DType::kBF16:
      KeysAs<__nv_bfloat16>(stream, tiles, g, in, in_dtype, head_dim, scales, int8, out);
      break;
    default:
      return absl::InvalidArgumentError("codec (CUDA): output dtype must be f32, f16 or bf16");
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace codec_cuda
}  // namespace kvcomp
