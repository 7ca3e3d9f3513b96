// Speculative Prefill token importance on the device (see kernels.h and
// cuda_importance.h): q.k logits against the prompt keys, softmax over the
// prompt, avg-pool along it, max (or sum) over heads folded into a running
// [rows, prompt_len] buffer, mean over rows at the end. Only the final
// prompt_len floats leave the device.

#include <cmath>

#include "common/cuda/cuda_types.cuh"
#include "common/cuda/kernels.h"
#include "common/cuda/launch.cuh"

namespace specserve {
namespace cuda_kernels {
namespace {

using cuda_detail::CeilDiv;
using cuda_detail::ToF32;

constexpr int kLogitThreads = 256;

int LogitTile(int head_dim) { return head_dim <= 128 ? 32 : 16; }

// Block = (tile of prompt keys, kv head). The key tile is staged in shared
// memory once and every query of the kv head's group (rows x group heads,
// in chunks) is multiplied against it; consecutive threads take
// consecutive keys so the logits stores are coalesced.
template <typename T>
__global__ void __launch_bounds__(kLogitThreads)
    ImportanceLogitsKernel(const float* __restrict__ q,
                           const T* __restrict__ keys, size_t key_row_stride,
                           int prompt_len, int rows, int num_heads,
                           int num_kv_heads, int head_dim, float scale,
                           int tile, float* __restrict__ logits) {
  SPECSERVE_DYNAMIC_SHARED(float, il_smem);
  const int D = head_dim, group = num_heads / num_kv_heads;
  const int g = blockIdx.y;
  const int j0 = blockIdx.x * tile;
  float* Ks = il_smem;                // [tile][D + 1]
  float* Qs = Ks + tile * (D + 1);    // [tile][D + 1] (tile queries)
  for (int idx = threadIdx.x; idx < tile * D; idx += blockDim.x) {
    const int j = idx / D, d = idx % D;
    float v = 0.0f;
    if (j0 + j < prompt_len) {
      v = ToF32<T>(keys[static_cast<size_t>(j0 + j) * key_row_stride +
                        static_cast<size_t>(g) * D + d]);
    }
    Ks[j * (D + 1) + d] = v;
  }
  const int nq = rows * group;  // query m = r * group + head in group
  for (int c0 = 0; c0 < nq; c0 += tile) {
    __syncthreads();  // keys stored; previous chunk's queries consumed
    for (int idx = threadIdx.x; idx < tile * D; idx += blockDim.x) {
      const int i = idx / D, d = idx % D;
      const int mq = c0 + i;
      float v = 0.0f;
      if (mq < nq) {
        const int r = mq / group, h = g * group + mq % group;
        v = q[(static_cast<size_t>(r) * num_heads + h) * D + d] * scale;
      }
      Qs[i * (D + 1) + d] = v;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < tile * tile; p += blockDim.x) {
      const int i = p / tile, j = p % tile;
      const int mq = c0 + i;
      if (mq >= nq || j0 + j >= prompt_len) continue;
      const float* qr = Qs + i * (D + 1);
      const float* kr = Ks + j * (D + 1);
      float acc = 0.0f;
      for (int d = 0; d < D; ++d) acc = fmaf(qr[d], kr[d], acc);
      const int r = mq / group, h = g * group + mq % group;
      logits[(static_cast<size_t>(h) * rows + r) * prompt_len + j0 + j] = acc;
    }
  }
}

__global__ void ImportanceSoftmaxKernel(float* __restrict__ logits, int len) {
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  float* x = logits + static_cast<size_t>(blockIdx.x) * len;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < len; j += blockDim.x) mx = fmaxf(mx, x[j]);
  mx = cuda_detail::BlockMax(mx, fscratch);
  double sum = 0.0;
  for (int j = threadIdx.x; j < len; j += blockDim.x) {
    const float e = expf(x[j] - mx);
    x[j] = e;
    sum += e;
  }
  sum = cuda_detail::BlockSumD(sum, dscratch);
  const float inv = static_cast<float>(1.0 / sum);
  for (int j = threadIdx.x; j < len; j += blockDim.x) x[j] *= inv;
}

__global__ void ImportancePoolFoldKernel(const float* __restrict__ probs,
                                         int rows, int num_heads, int len,
                                         int kernel, bool is_max,
                                         float* __restrict__ running) {
  const size_t total = static_cast<size_t>(rows) * len;
  const int hk = kernel / 2;
  const float inv_k = 1.0f / kernel;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(idx / len);
    const int j = static_cast<int>(idx % len);
    const int t0 = j - hk < 0 ? 0 : j - hk;
    const int t1 = j + hk >= len ? len - 1 : j + hk;
    float agg = 0.0f;
    for (int h = 0; h < num_heads; ++h) {
      const float* p = probs + (static_cast<size_t>(h) * rows + r) * len;
      float s = 0.0f;
      for (int t = t0; t <= t1; ++t) s += p[t];
      const float pooled = s * inv_k;  // count_include_pad: always / kernel
      agg = is_max ? (h == 0 ? pooled : fmaxf(agg, pooled)) : agg + pooled;
    }
    running[idx] = is_max ? fmaxf(running[idx], agg) : running[idx] + agg;
  }
}

__global__ void ImportanceMeanRowsKernel(const float* __restrict__ running,
                                         int rows, int len, float scale,
                                         float* __restrict__ out) {
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < len;
       j += gridDim.x * blockDim.x) {
    double s = 0.0;
    for (int r = 0; r < rows; ++r) {
      s += static_cast<float>(running[static_cast<size_t>(r) * len + j] *
                              scale);
    }
    out[j] = static_cast<float>(s / rows);
  }
}

unsigned GridFor(size_t n, int threads) {
  const unsigned blocks = CeilDiv(n, threads);
  return blocks == 0 ? 1 : (blocks < 8192 ? blocks : 8192);
}

}  // namespace

cudaError_t ImportanceLogits(const float* q, const void* keys,
                             CudaDType key_dtype, size_t key_row_stride,
                             int prompt_len, int rows, int num_heads,
                             int num_kv_heads, int head_dim, float scale,
                             float* logits, cudaStream_t stream) {
  if (prompt_len <= 0 || rows <= 0 || num_heads <= 0 || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim > 256 ||
      key_row_stride < static_cast<size_t>(num_kv_heads) * head_dim) {
    return cudaErrorInvalidValue;
  }
  const int tile = LogitTile(head_dim);
  const dim3 grid(CeilDiv(prompt_len, tile), num_kv_heads);
  const size_t smem = sizeof(float) * 2 * tile * (head_dim + 1);
  SPECSERVE_DISPATCH_DTYPE(
      key_dtype, T,
      SPECSERVE_LAUNCH(grid, kLogitThreads, smem, stream,
                       ImportanceLogitsKernel<T>)(
          q, static_cast<const T*>(keys), key_row_stride, prompt_len, rows,
          num_heads, num_kv_heads, head_dim, scale, tile, logits));
  return cudaGetLastError();
}

cudaError_t ImportanceSoftmax(float* logits, int num_rows, int len,
                              cudaStream_t stream) {
  if (num_rows <= 0 || len <= 0) return cudaErrorInvalidValue;
  SPECSERVE_LAUNCH(num_rows, 256, 0, stream, ImportanceSoftmaxKernel)(
      logits, len);
  return cudaGetLastError();
}

cudaError_t ImportancePoolFold(const float* probs, int rows, int num_heads,
                               int len, int kernel, bool is_max,
                               float* running, cudaStream_t stream) {
  if (rows <= 0 || num_heads <= 0 || len <= 0 || kernel < 1 ||
      kernel % 2 == 0) {
    return cudaErrorInvalidValue;
  }
  const size_t total = static_cast<size_t>(rows) * len;
  SPECSERVE_LAUNCH(GridFor(total, 256), 256, 0, stream,
                   ImportancePoolFoldKernel)(
      probs, rows, num_heads, len, kernel, is_max, running);
  return cudaGetLastError();
}

cudaError_t ImportanceMeanRows(const float* running, int rows, int len,
                               float scale, float* out, cudaStream_t stream) {
  if (rows <= 0 || len <= 0) return cudaErrorInvalidValue;
  SPECSERVE_LAUNCH(GridFor(len, 256), 256, 0, stream, ImportanceMeanRowsKernel)(
      running, rows, len, scale, out);
  return cudaGetLastError();
}

}  // namespace cuda_kernels
}  // namespace specserve
