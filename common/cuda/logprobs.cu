// RowLogprobs (sampling_kernels.h): OpenAI logprobs of logit rows on the
// device, as specserve::ComputeTokenLogprobs computes them on the host.

#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "common/cuda/launch.cuh"
#include "common/cuda/sampling_kernels.h"

namespace specserve {
namespace cuda_kernels {
namespace {

constexpr int kLpThreads = 256;
constexpr int kLpWarps = kLpThreads / 32;
constexpr int kMaxLpTopN = 64;

// NaN counts as -inf, as on the host.
__device__ __forceinline__ float LpValue(float x) {
  return isnan(x) ? -INFINITY : x;
}

// (v, i) comes before (w, k) in the top list: the larger value, then the
// lower id. k < 0 is "nothing yet" and comes after everything.
__device__ __forceinline__ bool LpBefore(float v, int i, float w, int k) {
  if (i < 0) return false;
  if (k < 0) return true;
  return v != w ? v > w : i < k;
}

__device__ float BlockMax(float v, float* smem) {
  for (int off = 16; off > 0; off >>= 1) {
    v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, off));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kLpWarps; ++w) v = fmaxf(v, smem[w]);
    smem[0] = v;
  }
  __syncthreads();
  v = smem[0];
  __syncthreads();  // smem is reused by the next reduction
  return v;
}

// Deterministic: fixed shuffle tree, then warps in order.
__device__ double BlockSum(double v, double* smem) {
  for (int off = 16; off > 0; off >>= 1) {
    v += __shfl_down_sync(0xffffffffu, v, off);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kLpWarps; ++w) v += smem[w];
    smem[0] = v;
  }
  __syncthreads();
  v = smem[0];
  __syncthreads();
  return v;
}

// The block's first (value, id) in LpBefore's order; every thread gets it.
__device__ void BlockFirst(float* v, int* i, float* sv, int* si) {
  for (int off = 16; off > 0; off >>= 1) {
    const float w = __shfl_down_sync(0xffffffffu, *v, off);
    const int k = __shfl_down_sync(0xffffffffu, *i, off);
    if (LpBefore(w, k, *v, *i)) *v = w, *i = k;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sv[warp] = *v, si[warp] = *i;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kLpWarps; ++w) {
      if (LpBefore(sv[w], si[w], *v, *i)) *v = sv[w], *i = si[w];
    }
    sv[0] = *v, si[0] = *i;
  }
  __syncthreads();
  *v = sv[0], *i = si[0];
  __syncthreads();
}

__global__ void RowLogprobsKernel(const float* __restrict__ logits, int vocab,
                                  const int* __restrict__ rows,
                                  const int* __restrict__ tokens, int top_n,
                                  float* __restrict__ out_logprob,
                                  int* __restrict__ out_top_ids,
                                  float* __restrict__ out_top_logprobs) {
  __shared__ float sf[kLpWarps];
  __shared__ double sd[kLpWarps];
  __shared__ int si[kLpWarps];
  const int j = blockIdx.x;
  const float* x = logits + static_cast<size_t>(rows[j]) * vocab;

  float m = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += kLpThreads) {
    m = fmaxf(m, LpValue(x[i]));
  }
  m = BlockMax(m, sf);
  // log Z; m is the same in every thread, so the branch is uniform.
  double log_z;
  if (isfinite(m)) {
    double sum = 0.0;
    for (int i = threadIdx.x; i < vocab; i += kLpThreads) {
      sum += exp(static_cast<double>(LpValue(x[i])) - m);
    }
    log_z = m + log(BlockSum(sum, sd));
  } else {
    log_z = m > 0 ? static_cast<double>(m) : -INFINITY;  // +inf share it
  }
  auto logprob = [&](float raw) -> float {
    const double v = LpValue(raw);
    if (!isfinite(log_z)) {
      return log_z > 0 && v == log_z ? 0.0f : -INFINITY;
    }
    return static_cast<float>(v - log_z);
  };
  if (threadIdx.x == 0) {
    const int t = tokens[j];
    out_logprob[j] = t >= 0 && t < vocab ? logprob(x[t]) : NAN;
  }
  // Top-n by selection: each pass takes the first entry after the
  // previous pick in LpBefore's order.
  float prev_v = 0.0f;
  int prev_i = -1;  // nothing picked yet: every entry qualifies
  for (int k = 0; k < top_n; ++k) {
    float best_v = 0.0f;
    int best_i = -1;
    for (int i = threadIdx.x; i < vocab; i += kLpThreads) {
      const float v = LpValue(x[i]);
      const bool after = prev_i < 0 || LpBefore(prev_v, prev_i, v, i);
      if (after && LpBefore(v, i, best_v, best_i)) best_v = v, best_i = i;
    }
    BlockFirst(&best_v, &best_i, sf, si);
    if (threadIdx.x == 0) {
      const size_t at = static_cast<size_t>(j) * top_n + k;
      out_top_ids[at] = best_i;
      out_top_logprobs[at] = best_i >= 0 ? logprob(x[best_i]) : -INFINITY;
    }
    prev_v = best_v;
    prev_i = best_i;
  }
}

}  // namespace

cudaError_t RowLogprobs(const float* logits, int vocab, const int* rows,
                        const int* tokens, int num_rows, int top_n,
                        float* out_logprob, int* out_top_ids,
                        float* out_top_logprobs, cudaStream_t stream) {
  if (vocab < 1 || num_rows < 0 || top_n < 0 || top_n > vocab ||
      top_n > kMaxLpTopN) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (logits == nullptr || rows == nullptr || tokens == nullptr ||
      out_logprob == nullptr ||
      (top_n > 0 && (out_top_ids == nullptr || out_top_logprobs == nullptr))) {
    return cudaErrorInvalidValue;
  }
  SPECSERVE_LAUNCH(num_rows, kLpThreads, 0, stream, RowLogprobsKernel)(
      logits, vocab, rows, tokens, top_n, out_logprob, out_top_ids,
      out_top_logprobs);
  return cudaGetLastError();
}

}  // namespace cuda_kernels
}  // namespace specserve
