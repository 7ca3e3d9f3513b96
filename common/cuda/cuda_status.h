#ifndef SPECSERVE_COMMON_CUDA_CUDA_STATUS_H_
#define SPECSERVE_COMMON_CUDA_CUDA_STATUS_H_

// CUDA runtime / cuBLAS error codes as absl::Status, and the RETURN_IF_ERROR
// macros every CUDA call of the backend goes through.

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace specserve {

/// OK for cudaSuccess; RESOURCE_EXHAUSTED for cudaErrorMemoryAllocation
/// (device memory is a capacity, like the KV cache); INTERNAL otherwise.
/// The message is "<what>: <cudaGetErrorName>: <cudaGetErrorString>".
absl::Status CudaStatus(cudaError_t err, const char* what);

/// OK for CUBLAS_STATUS_SUCCESS; RESOURCE_EXHAUSTED for
/// CUBLAS_STATUS_ALLOC_FAILED; INTERNAL otherwise, naming `what`.
absl::Status CublasStatus(cublasStatus_t status, const char* what);

}  // namespace specserve

/// Evaluates a cudaError_t expression; returns its Status from the enclosing
/// function unless it is cudaSuccess. The message names the expression.
#define SPECSERVE_CUDA_RETURN_IF_ERROR(expr)                              \
  do {                                                                    \
    const cudaError_t specserve_cuda_err_ = (expr);                       \
    if (specserve_cuda_err_ != cudaSuccess) {                             \
      return ::specserve::CudaStatus(specserve_cuda_err_, #expr);         \
    }                                                                     \
  } while (0)

/// As SPECSERVE_CUDA_RETURN_IF_ERROR for a cublasStatus_t expression.
#define SPECSERVE_CUBLAS_RETURN_IF_ERROR(expr)                            \
  do {                                                                    \
    const cublasStatus_t specserve_cublas_st_ = (expr);                   \
    if (specserve_cublas_st_ != CUBLAS_STATUS_SUCCESS) {                  \
      return ::specserve::CublasStatus(specserve_cublas_st_, #expr);      \
    }                                                                     \
  } while (0)

/// Returns from the enclosing function if an absl::Status expression is not
/// OK (the backend's own helper; Abseil 20220623 has no public macro).
#define SPECSERVE_RETURN_IF_ERROR(expr)                                   \
  do {                                                                    \
    ::absl::Status specserve_st_ = (expr);                                \
    if (!specserve_st_.ok()) return specserve_st_;                        \
  } while (0)

#endif  // SPECSERVE_COMMON_CUDA_CUDA_STATUS_H_
