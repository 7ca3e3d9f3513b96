#ifndef SPECSERVE_COMMON_CUDA_CUDA_TYPES_CUH_
#define SPECSERVE_COMMON_CUDA_CUDA_TYPES_CUH_

// Device-side helpers shared by the .cu files (nvcc only): conversions
// between fp32 and the storage types, a dtype dispatch, warp reductions.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/cuda/kernels.h"

namespace specserve {
namespace cuda_detail {

template <typename T>
__device__ __forceinline__ float ToF32(T v);
template <>
__device__ __forceinline__ float ToF32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float ToF32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float ToF32<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T FromF32(float v);
template <>
__device__ __forceinline__ float FromF32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromF32<__half>(float v) {
  return __float2half_rn(v);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double WarpSumD(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// Block-wide reductions for blockDim.x a multiple of 32 (<= 1024). Every
// thread gets the result. `scratch`: 32 elements of shared memory; safe to
// call repeatedly with the same scratch.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}
__device__ __forceinline__ double BlockSumD(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpSumD(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0;
  return WarpSumD(v);
}
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

inline unsigned CeilDiv(size_t a, size_t b) {
  return static_cast<unsigned>((a + b - 1) / b);
}

}  // namespace cuda_detail
}  // namespace specserve

// Runs the statement(s) with `T` bound to the C++ type of `dtype`
// (float, __nv_bfloat16, __half).
#define SPECSERVE_DISPATCH_DTYPE(dtype, T, ...)        \
  switch (dtype) {                                     \
    case ::specserve::CudaDType::kF32: {               \
      using T = float;                                 \
      __VA_ARGS__;                                     \
      break;                                           \
    }                                                  \
    case ::specserve::CudaDType::kBF16: {              \
      using T = __nv_bfloat16;                         \
      __VA_ARGS__;                                     \
      break;                                           \
    }                                                  \
    case ::specserve::CudaDType::kFP16: {              \
      using T = __half;                                \
      __VA_ARGS__;                                     \
      break;                                           \
    }                                                  \
  }

#endif  // SPECSERVE_COMMON_CUDA_CUDA_TYPES_CUH_
