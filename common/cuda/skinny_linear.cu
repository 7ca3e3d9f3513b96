#include "common/cuda/skinny_linear.h"

#include <cstdint>

#include "common/cuda/cuda_types.cuh"
#include "common/cuda/launch.cuh"

namespace specserve {
namespace cuda_kernels {
namespace {

using cuda_detail::FromF32;
using cuda_detail::WarpSum;

constexpr int kWarps = 4;   // warps per block
constexpr int kCols = 2;    // output columns per warp: x packs serve both
constexpr int kUnroll = 4;  // 16-byte packs of each W row a lane has in flight
constexpr int kPack = 8;    // 16-bit elements in 16 bytes

// The 8 values of a 16-byte pack as fp32, taken from its 32-bit words (a
// per-element view of the pack lets the compiler split its load into 8).
template <typename T>
__device__ __forceinline__ void Unpack(const uint4& p, float* f);
template <>
__device__ __forceinline__ void Unpack<__nv_bfloat16>(const uint4& p,
                                                      float* f) {
  const unsigned w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);  // the low half: element 2i
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void Unpack<__half>(const uint4& p, float* f) {
  const unsigned w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __half2float(__ushort_as_half(
        static_cast<unsigned short>(w[i] & 0xffffu)));
    f[2 * i + 1] = __half2float(
        __ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
  }
}

// A warp computes kCols adjacent outputs of all M rows: its lanes stride
// over the 16-byte packs of those W rows, kUnroll packs a row loaded before
// any is used (the loads, not the arithmetic, set the pace), each pack
// multiplied by the same pack of every x row (x is small and stays in
// L1 / L2). The fp32 partial sums meet in a warp reduction.
template <typename T, typename Y, int M>
__global__ void __launch_bounds__(kWarps * 32)
    SkinnyLinearKernel(const T* __restrict__ x, const T* __restrict__ w,
                       Y* __restrict__ y, int in, int out, float beta) {
  const int lane = threadIdx.x & 31;
  const int col0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * kCols;
  if (col0 >= out) return;  // the whole warp: col0 is the warp's
  const int packs = in / kPack;
  const uint4* __restrict__ xp = reinterpret_cast<const uint4*>(x);
  const uint4* __restrict__ wp[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    // Past the last column: a valid row whose sum is not written.
    const int col = col0 + c < out ? col0 + c : out - 1;
    wp[c] = reinterpret_cast<const uint4*>(w + static_cast<size_t>(col) * in);
  }
  float acc[M][kCols];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[m][c] = 0.0f;
  }
  for (int p0 = lane; p0 < packs; p0 += 32 * kUnroll) {
    uint4 wv[kUnroll][kCols];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = p0 + u * 32;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        wv[u][c] = p < packs ? wp[c][p] : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = p0 + u * 32;
      if (p >= packs) break;
      float wf[kCols][kPack];
#pragma unroll
      for (int c = 0; c < kCols; ++c) Unpack<T>(wv[u][c], wf[c]);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[kPack];
        Unpack<T>(xp[static_cast<size_t>(m) * packs + p], xf);
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
#pragma unroll
          for (int i = 0; i < kPack; ++i) acc[m][c] += xf[i] * wf[c][i];
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float sum = WarpSum(acc[m][c]);
      if (lane == m * kCols + c && col0 + c < out) {
        const size_t at = static_cast<size_t>(m) * out + col0 + c;
        if constexpr (sizeof(Y) == sizeof(float)) {
          y[at] = beta != 0.0f ? sum + beta * y[at] : sum;
        } else {
          y[at] = FromF32<Y>(sum);
        }
      }
    }
  }
}

template <typename T, typename Y, int M>
void LaunchSkinny(const SkinnyLinearArgs& a, cudaStream_t stream) {
  const unsigned blocks = cuda_detail::CeilDiv(a.out, kWarps * kCols);
  SPECSERVE_LAUNCH(blocks, kWarps * 32, 0, stream,
                   SkinnyLinearKernel<T, Y, M>)(
      static_cast<const T*>(a.x), static_cast<const T*>(a.w),
      static_cast<Y*>(a.y), a.in, a.out, a.beta);
}

template <typename T, typename Y>
void LaunchRows(const SkinnyLinearArgs& a, cudaStream_t stream) {
  switch (a.n) {
    case 1: LaunchSkinny<T, Y, 1>(a, stream); break;
    case 2: LaunchSkinny<T, Y, 2>(a, stream); break;
    case 3: LaunchSkinny<T, Y, 3>(a, stream); break;
    case 4: LaunchSkinny<T, Y, 4>(a, stream); break;
    case 5: LaunchSkinny<T, Y, 5>(a, stream); break;
    case 6: LaunchSkinny<T, Y, 6>(a, stream); break;
    case 7: LaunchSkinny<T, Y, 7>(a, stream); break;
    case 8: LaunchSkinny<T, Y, 8>(a, stream); break;
  }
}

template <typename T>
void LaunchOut(const SkinnyLinearArgs& a, cudaStream_t stream) {
  if (a.y_dtype == CudaDType::kF32) {
    LaunchRows<T, float>(a, stream);
  } else {
    LaunchRows<T, T>(a, stream);
  }
}

}  // namespace

static_assert(kSkinnyMaxRows == 8, "LaunchRows instantiates 1..8 rows");

bool SkinnyLinearSupported(const SkinnyLinearArgs& a) {
  const bool sixteen_bit =
      a.dtype == CudaDType::kBF16 || a.dtype == CudaDType::kFP16;
  const bool out_ok = a.y_dtype == CudaDType::kF32 ||
                      (a.y_dtype == a.dtype && a.beta == 0.0f);
  return sixteen_bit && out_ok && (a.beta == 0.0f || a.beta == 1.0f) &&
         a.x != nullptr && a.w != nullptr && a.y != nullptr && a.n >= 1 &&
         a.n <= kSkinnyMaxRows && a.in >= kPack && a.in % kPack == 0 &&
         a.out >= 1 &&
         ((reinterpret_cast<uintptr_t>(a.x) |
           reinterpret_cast<uintptr_t>(a.w)) &
          15) == 0;
}

cudaError_t SkinnyLinear(const SkinnyLinearArgs& a, cudaStream_t stream) {
  if (!SkinnyLinearSupported(a)) return cudaErrorInvalidValue;
  if (a.dtype == CudaDType::kBF16) {
    LaunchOut<__nv_bfloat16>(a, stream);
  } else {
    LaunchOut<__half>(a, stream);
  }
  return cudaGetLastError();
}

}  // namespace cuda_kernels
}  // namespace specserve
