// The cuBLAS entry points the project calls (the set
// third_party/cuda/cublas_dlopen.cc forwards), on the emulated device of
// cuda_emu.h: GEMMs run on the host in fp32, on the handle's stream (so a
// CUDA graph being captured records them), with the toolkit header's
// signatures and column-major conventions.

#include <cublas_api.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "common/cuda/emu/cuda_emu.h"

namespace {

struct Handle {
  cudaStream_t stream = nullptr;
};

float Load(const void* base, cudaDataType type, size_t i) {
  switch (type) {
    case CUDA_R_32F:
      return static_cast<const float*>(base)[i];
    case CUDA_R_16BF:
      return static_cast<float>(static_cast<const __nv_bfloat16*>(base)[i]);
    case CUDA_R_16F:
      return static_cast<float>(static_cast<const __half*>(base)[i]);
    default:
      return 0.0f;
  }
}

void Store(void* base, cudaDataType type, size_t i, float v) {
  switch (type) {
    case CUDA_R_32F:
      static_cast<float*>(base)[i] = v;
      break;
    case CUDA_R_16BF:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
      break;
    case CUDA_R_16F:
      static_cast<__half*>(base)[i] = __float2half_rn(v);
      break;
    default:
      break;
  }
}

bool Supported(cudaDataType t) {
  return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F;
}

}  // namespace

extern "C" {

cublasStatus_t CUBLASWINAPI cublasCreate_v2(cublasHandle_t* handle) {
  *handle = reinterpret_cast<cublasHandle_t>(new Handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasDestroy_v2(cublasHandle_t handle) {
  delete reinterpret_cast<Handle*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasSetStream_v2(cublasHandle_t handle,
                                               cudaStream_t stream) {
  reinterpret_cast<Handle*>(handle)->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasSetWorkspace_v2(cublasHandle_t, void*,
                                                  size_t) {
  return CUBLAS_STATUS_SUCCESS;
}

// C = alpha op(A) op(B) + beta C, column-major; fp32 accumulation
// (CUBLAS_COMPUTE_32F*), host-side alpha / beta.
cublasStatus_t CUBLASWINAPI cublasGemmEx(
    cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
    int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
    int lda, const void* B, cudaDataType Btype, int ldb, const void* beta,
    void* C, cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
    cublasGemmAlgo_t) {
  if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (!Supported(Atype) || !Supported(Btype) || !Supported(Ctype)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (computeType != CUBLAS_COMPUTE_32F &&
      computeType != CUBLAS_COMPUTE_32F_FAST_TF32 &&
      computeType != CUBLAS_COMPUTE_32F_FAST_16BF &&
      computeType != CUBLAS_COMPUTE_32F_FAST_16F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const float al = *static_cast<const float*>(alpha);
  const float be = *static_cast<const float*>(beta);
  specserve::cuda_emu::EnqueueOnStream(
      reinterpret_cast<Handle*>(handle)->stream, [=] {
        // op(A) as [m][k] and op(B) as [n][k] in fp32, then dot products.
        std::vector<float> a(static_cast<size_t>(m) * k),
            b(static_cast<size_t>(n) * k);
        for (int i = 0; i < m; ++i) {
          for (int p = 0; p < k; ++p) {
            a[size_t(i) * k + p] =
                Load(A, Atype, ta ? size_t(i) * lda + p : size_t(p) * lda + i);
          }
        }
        for (int j = 0; j < n; ++j) {
          for (int p = 0; p < k; ++p) {
            b[size_t(j) * k + p] =
                Load(B, Btype, tb ? size_t(p) * ldb + j : size_t(j) * ldb + p);
          }
        }
        for (int j = 0; j < n; ++j) {
          for (int i = 0; i < m; ++i) {
            const float* ar = &a[size_t(i) * k];
            const float* br = &b[size_t(j) * k];
            float s = 0.0f;
            for (int p = 0; p < k; ++p) s += ar[p] * br[p];
            const size_t c = size_t(j) * ldc + i;
            // beta == 0 must not read C (it may hold NaN), as in cuBLAS.
            Store(C, Ctype, c,
                  be == 0.0f ? al * s : al * s + be * Load(C, Ctype, c));
          }
        }
      });
  return CUBLAS_STATUS_SUCCESS;
}

const char* CUBLASWINAPI cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_UNKNOWN";
  }
}

const char* CUBLASWINAPI cublasGetStatusString(cublasStatus_t status) {
  return cublasGetStatusName(status);
}

}  // extern "C"
