#ifndef SPECSERVE_COMMON_CUDA_SKINNY_LINEAR_H_
#define SPECSERVE_COMMON_CUDA_SKINNY_LINEAR_H_

// A projection of a few rows (decode, a verify round, a look-ahead step)
// without cuBLAS: y[n, out] = x[n, in] W^T + beta * y, as CublasLinear
// computes it, for n <= kSkinnyMaxRows. Such a GEMM only streams W once
// from memory; this kernel keeps many 16-byte loads of W in flight per
// thread and sums each output in fp32 with a warp reduction. Whether it
// beats cuBLAS on a GPU is measured at start-up
// (CudaModelRunner::TuneSkinnyLinear), not assumed.

#include <cuda_runtime_api.h>

#include "common/cuda/kernels.h"

namespace specserve {
namespace cuda_kernels {

/// Rows one SkinnyLinear launch takes at most.
inline constexpr int kSkinnyMaxRows = 8;

/// Arguments of SkinnyLinear.
struct SkinnyLinearArgs {
  const void* x = nullptr;  ///< T [n, in], 16-byte aligned
  const void* w = nullptr;  ///< T [out, in] (PyTorch Linear), 16-byte aligned
  void* y = nullptr;        ///< y_dtype [n, out]
  int n = 0;                ///< rows, 1..kSkinnyMaxRows
  int in = 0;               ///< a multiple of 8 (16-byte rows)
  int out = 0;
  CudaDType dtype = CudaDType::kBF16;    ///< T: kBF16 or kFP16
  CudaDType y_dtype = CudaDType::kF32;   ///< kF32, or T (then beta = 0)
  float beta = 0.0f;                     ///< 0, or 1 (the residual add)
};

/// Whether SkinnyLinear takes `args`: the bounds and alignments above,
/// non-null pointers.
bool SkinnyLinearSupported(const SkinnyLinearArgs& args);

/// y[r, o] = sum_k x[r, k] w[o, k] (fp32 sums) + beta * y[r, o], rounded to
/// y_dtype. cudaErrorInvalidValue where !SkinnyLinearSupported(args).
cudaError_t SkinnyLinear(const SkinnyLinearArgs& args, cudaStream_t stream);

}  // namespace cuda_kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_SKINNY_LINEAR_H_
