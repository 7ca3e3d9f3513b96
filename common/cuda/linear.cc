#include "common/cuda/linear.h"

#include <cublas_v2.h>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"

namespace specserve {
namespace {

cudaDataType_t ToCudaType(CudaDType dtype) {
  switch (dtype) {
    case CudaDType::kF32:
      return CUDA_R_32F;
    case CudaDType::kBF16:
      return CUDA_R_16BF;
    case CudaDType::kFP16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

}  // namespace

absl::Status CublasLinear(cublasHandle_t handle, CudaDType dtype,
                          const void* x, int n, int in, const void* w, int out,
                          void* y, CudaDType y_dtype, float beta) {
  if (n <= 0 || in <= 0 || out <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CublasLinear: sizes must be positive, got n=", n, " in=", in,
        " out=", out));
  }
  if (y_dtype != CudaDType::kF32 && y_dtype != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("CublasLinear: output dtype ", CudaDTypeName(y_dtype),
                     " with ", CudaDTypeName(dtype), " operands"));
  }
  const float alpha = 1.0f;
  // Column-major view: Y^T [out, n] = W [out, in] (stored as W^T
  // column-major, so op T) x X^T [in, n] (X row-major = X^T column-major).
  SPECSERVE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &alpha, w,
      ToCudaType(dtype), in, x, ToCudaType(dtype), in, &beta, y,
      ToCudaType(y_dtype), out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace specserve
