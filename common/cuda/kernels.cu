// Element-wise and row-wise kernels of the CUDA Llama forward (see
// kernels.h). fp32 math throughout; T is only the storage type.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/cuda/cuda_types.cuh"
#include "common/cuda/kernels.h"
#include "common/cuda/launch.cuh"

namespace specserve {

size_t CudaDTypeBytes(CudaDType dtype) {
  return dtype == CudaDType::kF32 ? 4 : 2;
}

const char* CudaDTypeName(CudaDType dtype) {
  switch (dtype) {
    case CudaDType::kF32:
      return "f32";
    case CudaDType::kBF16:
      return "bf16";
    case CudaDType::kFP16:
      return "fp16";
  }
  return "?";
}

namespace cuda_kernels {
namespace {

using cuda_detail::CeilDiv;
using cuda_detail::FromF32;
using cuda_detail::ToF32;

constexpr int kThreads = 256;
// RmsNorm's block at hidden sizes >= 4096; its launch bounds hold the
// kernel to the registers 1024 threads may each have.
constexpr int kRmsNormMaxThreads = 1024;
// Grid-stride loops: enough blocks to fill an H100 several times over.
constexpr unsigned kMaxBlocks = 4096;

unsigned GridFor(size_t n) {
  const unsigned blocks = CeilDiv(n, kThreads);
  return blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

template <typename T>
__global__ void ConvertFromF32Kernel(const float* __restrict__ src,
                                     T* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = FromF32<T>(src[i]);
  }
}

// One block per gathered row; 2-byte / 4-byte elements copied as is.
template <typename T>
__global__ void GatherKvRowsKernel(const T* __restrict__ pool,
                                   const int* __restrict__ table,
                                   int block_size, int row_width,
                                   T* __restrict__ dst) {
  const int t = blockIdx.x;
  const size_t src_row =
      static_cast<size_t>(table[t / block_size]) * block_size + t % block_size;
  const T* src = pool + src_row * row_width;
  T* out = dst + static_cast<size_t>(t) * row_width;
  for (int i = threadIdx.x; i < row_width; i += blockDim.x) out[i] = src[i];
}

// One block per slot; padding slots (row < 0) return at once.
__global__ void CaptureQueryRowsKernel(const float* __restrict__ qkv,
                                       int qkv_dim, int qrow,
                                       const CaptureSlot* __restrict__ slots,
                                       int layer) {
  const CaptureSlot s = slots[blockIdx.x];
  if (s.row < 0) return;
  const float* src = qkv + static_cast<size_t>(s.row) * qkv_dim;
  float* dst = s.dst + static_cast<size_t>(layer) * s.layer_stride;
  for (int i = threadIdx.x; i < qrow; i += blockDim.x) dst[i] = src[i];
}

// Rows of `row_bytes` at `a` and `b` move as 16-byte words (uint4): the
// copy is bound by its loads, and one 16-byte load per thread keeps 8x
// the bytes of a 2-byte load in flight.
bool SixteenByteRows(const void* a, const void* b, size_t row_bytes) {
  return row_bytes % 16 == 0 &&
         ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) &
          15) == 0;
}

template <typename T>
__global__ void ConvertToF32Kernel(const T* __restrict__ src,
                                   float* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = ToF32<T>(src[i]);
  }
}

template <typename T>
__global__ void EmbeddingGatherKernel(const T* __restrict__ table,
                                      const int* __restrict__ ids, int hidden,
                                      float* __restrict__ out) {
  const size_t row = blockIdx.x;
  const T* src = table + static_cast<size_t>(ids[row]) * hidden;
  float* dst = out + row * hidden;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    dst[c] = ToF32<T>(src[c]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kRmsNormMaxThreads)
    RmsNormKernel(const float* __restrict__ x, const int* __restrict__ rows,
                  int dim, const float* __restrict__ w, float eps,
                  T* __restrict__ out) {
  __shared__ float scratch[32];
  const size_t r = blockIdx.x;
  const size_t src_row = rows != nullptr ? rows[r] : r;
  const float* xr = x + src_row * dim;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += xr[c] * xr[c];
  ss = cuda_detail::BlockSum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / dim + eps);
  T* o = out + r * dim;
  for (int c = threadIdx.x; c < dim; c += blockDim.x) {
    o[c] = FromF32<T>(xr[c] * scale * w[c]);
  }
}

// One block per row: cos/sin of the row's position for every frequency in
// shared memory (double, as the CPU reference), then the rotation of every q
// and k head, and the stores of q, k and v.
template <typename T>
__global__ void RopeQkvStoreKernel(RopeArgs a) {
  SPECSERVE_DYNAMIC_SHARED(float, cs_sn);  // [half] cos, then [half] sin
  const int half = a.head_dim / 2;
  const int D = a.head_dim, H = a.num_heads, KV = a.num_kv_heads;
  const size_t row = blockIdx.x;
  const size_t qkv_dim = static_cast<size_t>(H + 2 * KV) * D;
  const double pos = a.positions[row];
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const double inv_freq = a.inv_freq != nullptr
                                ? a.inv_freq[i]
                                : pow(a.theta, -2.0 * i / D);
    double s, c;
    sincos(pos * inv_freq, &s, &c);
    cs_sn[i] = static_cast<float>(c * a.attention_factor);
    cs_sn[half + i] = static_cast<float>(s * a.attention_factor);
  }
  __syncthreads();
  float* x = a.qkv + row * qkv_dim;
  T* q_out = static_cast<T*>(a.q_out);
  T* k_cache = static_cast<T*>(a.k_cache);
  T* v_cache = static_cast<T*>(a.v_cache);
  const size_t rw = static_cast<size_t>(KV) * D;
  const long long slot_or_none =
      a.slots != nullptr ? a.slots[row]
                         : static_cast<long long>(a.cache_first) + row;
  const bool store = slot_or_none >= 0;
  const size_t slot = store ? static_cast<size_t>(slot_or_none) : 0;
  for (int idx = threadIdx.x; idx < (H + KV) * half; idx += blockDim.x) {
    const int h = idx / half, i = idx % half;
    float* v = x + static_cast<size_t>(h) * D;
    const float x1 = v[i], x2 = v[i + half];
    const float c = cs_sn[i], s = cs_sn[half + i];
    const float y1 = x1 * c - x2 * s;
    const float y2 = x2 * c + x1 * s;
    if (a.rotate_in_place) {
      v[i] = y1;
      v[i + half] = y2;
    }
    if (h < H) {
      if (q_out != nullptr) {
        T* dst = q_out + row * H * D + static_cast<size_t>(h) * D;
        dst[i] = FromF32<T>(y1);
        dst[i + half] = FromF32<T>(y2);
      }
    } else if (k_cache != nullptr && store) {
      T* dst = k_cache + slot * rw + static_cast<size_t>(h - H) * D;
      dst[i] = FromF32<T>(y1);
      dst[i + half] = FromF32<T>(y2);
    }
  }
  if (v_cache != nullptr && store) {
    const float* vs = x + static_cast<size_t>(H + KV) * D;
    T* dst = v_cache + slot * rw;
    for (int idx = threadIdx.x; idx < KV * D; idx += blockDim.x) {
      dst[idx] = FromF32<T>(vs[idx]);
    }
  }
}

__global__ void AddBiasKernel(float* __restrict__ x, size_t stride, int rows,
                              int cols, const float* __restrict__ bias) {
  const size_t total = static_cast<size_t>(rows) * cols;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = idx / cols, c = idx % cols;
    x[r * stride + c] += bias[c];
  }
}

// One block per (row, q-or-k head): RmsNormKernel's math on a head_dim
// slice, in place. Block (r, h) with h < H is q head h, else k head h - H
// (k heads follow the q heads in the fused row).
__global__ void HeadRmsNormKernel(float* __restrict__ qkv, int num_heads,
                                  int num_kv_heads, int head_dim,
                                  const float* __restrict__ q_weight,
                                  const float* __restrict__ k_weight,
                                  float eps) {
  __shared__ float scratch[32];
  const int heads = num_heads + num_kv_heads;
  const size_t r = blockIdx.x / heads;
  const int h = blockIdx.x % heads;
  const size_t qkv_dim = static_cast<size_t>(num_heads + 2 * num_kv_heads) *
                         head_dim;
  float* v = qkv + r * qkv_dim + static_cast<size_t>(h) * head_dim;
  const float* w = h < num_heads ? q_weight : k_weight;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x) ss += v[c] * v[c];
  // In place without a race: each thread writes only the elements it read.
  ss = cuda_detail::BlockSum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / head_dim + eps);
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
    v[c] = v[c] * scale * w[c];
  }
}

// Block (r, y) covers row r's columns from y * blockDim.x * kVec on, in
// strides of gridDim.y * blockDim.x * kVec; each thread takes kVec
// consecutive columns, one 16-byte load of gate, one of up and one store
// when kVec * sizeof(T) == 16. The row is the block's, so there is no
// per-element index division (the grid-stride kernel it replaces divided
// a 64-bit index by ffn for every element), and any row count fits
// gridDim.x.
template <typename T, int kVec>
__global__ void SiluMulKernel(const T* __restrict__ gu, int ffn,
                              T* __restrict__ out) {
  struct alignas(sizeof(T) * kVec) Pack {
    T v[kVec];
  };
  const size_t r = blockIdx.x;
  const T* g = gu + r * 2 * ffn;
  const T* u = g + ffn;
  T* o = out + r * ffn;
  const int step = gridDim.y * blockDim.x * kVec;
  for (int c = (blockIdx.y * blockDim.x + threadIdx.x) * kVec; c < ffn;
       c += step) {
    const Pack gp = *reinterpret_cast<const Pack*>(g + c);
    const Pack up = *reinterpret_cast<const Pack*>(u + c);
    Pack op;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float gv = ToF32<T>(gp.v[k]);
      op.v[k] = FromF32<T>(gv / (1.0f + expf(-gv)) * ToF32<T>(up.v[k]));
    }
    *reinterpret_cast<Pack*>(o + c) = op;
  }
}

// Whether (v, i) beats (best_v, best_i) under Argmax's rule: larger
// value, then lower id; NaN never beats anything, anything beats NaN.
__device__ __forceinline__ bool ArgmaxBeats(float v, int i, float best_v,
                                            int best_i) {
  if (isnan(v)) return false;
  if (isnan(best_v)) return true;
  return v > best_v || (v == best_v && i < best_i);
}

__global__ void ArgmaxRowsKernel(const float* __restrict__ logits, int vocab,
                                 int* __restrict__ out) {
  const float* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
  float best_v = nanf("");
  int best_i = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = row[i];
    if (ArgmaxBeats(v, i, best_v, best_i)) best_v = v, best_i = i;
  }
  // Warp, then block: the (value, id) pairs reduce with the same rule, so
  // the order of the reduction does not change the winner.
  for (int off = 16; off > 0; off >>= 1) {
    const float v = __shfl_down_sync(0xffffffffu, best_v, off);
    const int i = __shfl_down_sync(0xffffffffu, best_i, off);
    if (ArgmaxBeats(v, i, best_v, best_i)) best_v = v, best_i = i;
  }
  __shared__ float warp_v[kThreads / 32];
  __shared__ int warp_i[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_v[warp] = best_v, warp_i[warp] = best_i;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      if (ArgmaxBeats(warp_v[w], warp_i[w], best_v, best_i)) {
        best_v = warp_v[w], best_i = warp_i[w];
      }
    }
    out[blockIdx.x] = best_i;
  }
}

}  // namespace

cudaError_t ConvertFromF32(const float* src, void* dst, CudaDType dst_dtype,
                           size_t n, cudaStream_t stream) {
  if (n == 0) return cudaGetLastError();
  SPECSERVE_DISPATCH_DTYPE(
      dst_dtype, T,
      SPECSERVE_LAUNCH(GridFor(n), kThreads, 0, stream,
                       ConvertFromF32Kernel<T>)(src, static_cast<T*>(dst), n));
  return cudaGetLastError();
}

cudaError_t ConvertToF32(const void* src, CudaDType src_dtype, float* dst,
                         size_t n, cudaStream_t stream) {
  if (n == 0) return cudaGetLastError();
  SPECSERVE_DISPATCH_DTYPE(
      src_dtype, T,
      SPECSERVE_LAUNCH(GridFor(n), kThreads, 0, stream, ConvertToF32Kernel<T>)(
          static_cast<const T*>(src), dst, n));
  return cudaGetLastError();
}

cudaError_t EmbeddingGather(const void* table, CudaDType dtype, const int* ids,
                            int n, int hidden, float* out,
                            cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return cudaErrorInvalidValue;
  SPECSERVE_DISPATCH_DTYPE(
      dtype, T,
      SPECSERVE_LAUNCH(n, kThreads, 0, stream, EmbeddingGatherKernel<T>)(
          static_cast<const T*>(table), ids, hidden, out));
  return cudaGetLastError();
}

cudaError_t RmsNorm(const float* x, const int* rows, int num_rows, int dim,
                    const float* w, float eps, void* out, CudaDType out_dtype,
                    cudaStream_t stream) {
  if (num_rows <= 0 || dim <= 0) return cudaErrorInvalidValue;
  const int threads =
      dim >= 4096 ? kRmsNormMaxThreads : (dim >= 1024 ? 512 : 128);
  SPECSERVE_DISPATCH_DTYPE(
      out_dtype, T,
      SPECSERVE_LAUNCH(num_rows, threads, 0, stream, RmsNormKernel<T>)(
          x, rows, dim, w, eps, static_cast<T*>(out)));
  return cudaGetLastError();
}

cudaError_t RopeQkvStore(const RopeArgs& args, cudaStream_t stream) {
  if (args.n <= 0 || args.head_dim <= 0 || args.head_dim % 2 != 0 ||
      args.num_heads <= 0 || args.num_kv_heads <= 0 || args.qkv == nullptr ||
      args.positions == nullptr) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = sizeof(float) * args.head_dim;
  SPECSERVE_DISPATCH_DTYPE(
      args.dtype, T,
      SPECSERVE_LAUNCH(args.n, 128, smem, stream, RopeQkvStoreKernel<T>)(args));
  return cudaGetLastError();
}

cudaError_t AddBias(float* x, size_t stride, int rows, int cols,
                    const float* bias, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0 || stride < static_cast<size_t>(cols) ||
      x == nullptr || bias == nullptr) {
    return cudaErrorInvalidValue;
  }
  const size_t total = static_cast<size_t>(rows) * cols;
  SPECSERVE_LAUNCH(GridFor(total), kThreads, 0, stream, AddBiasKernel)(
      x, stride, rows, cols, bias);
  return cudaGetLastError();
}

cudaError_t HeadRmsNorm(float* qkv, int n, int num_heads, int num_kv_heads,
                        int head_dim, const float* q_weight,
                        const float* k_weight, float eps,
                        cudaStream_t stream) {
  if (n <= 0 || num_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0 ||
      qkv == nullptr || q_weight == nullptr || k_weight == nullptr) {
    return cudaErrorInvalidValue;
  }
  // A whole number of warps (BlockSum), one element per thread up to 256.
  const int threads = head_dim >= 256 ? 256 : ((head_dim + 31) / 32) * 32;
  const unsigned blocks =
      static_cast<unsigned>(n) * static_cast<unsigned>(num_heads + num_kv_heads);
  SPECSERVE_LAUNCH(blocks, threads, 0, stream, HeadRmsNormKernel)(
      qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps);
  return cudaGetLastError();
}

cudaError_t SiluMul(const void* gu, int rows, int ffn, void* out,
                    CudaDType dtype, cudaStream_t stream) {
  if (rows <= 0 || ffn <= 0) return cudaErrorInvalidValue;
  const size_t tb = CudaDTypeBytes(dtype);
  const int vec = static_cast<int>(16 / tb);
  // 16-byte packs when every row's gate, up and out start on 16 bytes.
  const bool packed =
      ffn % vec == 0 &&
      ((reinterpret_cast<uintptr_t>(gu) | reinterpret_cast<uintptr_t>(out)) &
       15) == 0;
  const int per_thread = packed ? vec : 1;
  // Enough column blocks that each thread takes one pack of the row, up to
  // 8 (14,336 bf16 columns: 7 blocks of 256 threads).
  const int cols_per_block = kThreads * per_thread;
  const unsigned y = static_cast<unsigned>(
      std::min(8, (ffn + cols_per_block - 1) / cols_per_block));
  const dim3 grid(static_cast<unsigned>(rows), y);
  if (packed) {
    SPECSERVE_DISPATCH_DTYPE(
        dtype, T,
        SPECSERVE_LAUNCH(grid, kThreads, 0, stream,
                         SiluMulKernel<T, 16 / sizeof(T)>)(
            static_cast<const T*>(gu), ffn, static_cast<T*>(out)));
  } else {
    SPECSERVE_DISPATCH_DTYPE(
        dtype, T,
        SPECSERVE_LAUNCH(grid, kThreads, 0, stream, SiluMulKernel<T, 1>)(
            static_cast<const T*>(gu), ffn, static_cast<T*>(out)));
  }
  return cudaGetLastError();
}

cudaError_t ArgmaxRows(const float* logits, int rows, int vocab, int* out,
                       cudaStream_t stream) {
  if (rows < 0 || vocab <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaGetLastError();
  SPECSERVE_LAUNCH(rows, kThreads, 0, stream, ArgmaxRowsKernel)(
      logits, vocab, out);
  return cudaGetLastError();
}

cudaError_t GatherKvRows(const void* pool, CudaDType dtype,
                         const int* block_table, int block_size, int count,
                         int row_width, void* dst, cudaStream_t stream) {
  if (pool == nullptr || block_table == nullptr || dst == nullptr ||
      block_size < 1 || count < 1 || row_width < 1) {
    return cudaErrorInvalidValue;
  }
  const size_t row_bytes =
      static_cast<size_t>(row_width) * CudaDTypeBytes(dtype);
  if (SixteenByteRows(pool, dst, row_bytes)) {
    SPECSERVE_LAUNCH(count, 128, 0, stream, GatherKvRowsKernel<uint4>)(
        static_cast<const uint4*>(pool), block_table, block_size,
        static_cast<int>(row_bytes / 16), static_cast<uint4*>(dst));
    return cudaGetLastError();
  }
  SPECSERVE_DISPATCH_DTYPE(
      dtype, T,
      SPECSERVE_LAUNCH(count, 128, 0, stream, GatherKvRowsKernel<T>)(
          static_cast<const T*>(pool), block_table, block_size, row_width,
          static_cast<T*>(dst)));
  return cudaGetLastError();
}

cudaError_t CaptureQueryRows(const float* qkv, int qkv_dim, int qrow,
                             const CaptureSlot* slots, int num_slots,
                             int layer, cudaStream_t stream) {
  if (qkv == nullptr || slots == nullptr || num_slots < 1 || qrow < 1 ||
      qrow > qkv_dim || layer < 0) {
    return cudaErrorInvalidValue;
  }
  SPECSERVE_LAUNCH(num_slots, 256, 0, stream, CaptureQueryRowsKernel)(
      qkv, qkv_dim, qrow, slots, layer);
  return cudaGetLastError();
}

cudaError_t GatherRows(const void* src, CudaDType dtype, const int* rows,
                       int n, int row_width, void* dst, cudaStream_t stream) {
  // A row list is a block table of one-row blocks.
  return GatherKvRows(src, dtype, rows, /*block_size=*/1, n, row_width, dst,
                      stream);
}

}  // namespace cuda_kernels
}  // namespace specserve
