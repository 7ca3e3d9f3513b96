#ifndef SPECSERVE_COMMON_CUDA_LINEAR_H_
#define SPECSERVE_COMMON_CUDA_LINEAR_H_

#include <cublas_api.h>

#include "absl/status/status.h"
#include "common/cuda/kernels.h"

namespace specserve {

/// A projection through cuBLAS (cublasGemmEx, fp32 accumulation
/// CUBLAS_COMPUTE_32F, tensor cores for 16-bit operands):
///   y[n, out] = x[n, in] W^T + beta * y
/// with W row-major [out, in] (PyTorch Linear layout), all on the device.
/// `x` and `w` are `dtype` (kBF16, kFP16 or kF32); `y` is `y_dtype` (kF32,
/// or the same as `dtype`). beta = 1 with an fp32 `y` is the residual add
/// of the Llama block (the residual stream stays fp32). Runs on the stream
/// bound to `handle` (cublasSetStream).
/// Errors: INVALID_ARGUMENT for non-positive sizes or an unsupported dtype
/// pair; INTERNAL / RESOURCE_EXHAUSTED from cuBLAS.
absl::Status CublasLinear(cublasHandle_t handle, CudaDType dtype,
                          const void* x, int n, int in, const void* w, int out,
                          void* y, CudaDType y_dtype, float beta);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_LINEAR_H_
