#include "common/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace specserve {

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(err), ": ",
                                       cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(msg);
  }
  return absl::InternalError(msg);
}

absl::Status CublasStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string msg =
      absl::StrCat(what, ": ", cublasGetStatusName(status), ": ",
                   cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(msg);
  }
  return absl::InternalError(msg);
}

}  // namespace specserve
