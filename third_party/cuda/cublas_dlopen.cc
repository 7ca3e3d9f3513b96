// The cuBLAS entry points the project calls, with the toolkit headers'
// exact C signatures, each forwarding to the symbol of the same name in
// libcublas.so.<major>, which is dlopen'ed on first use (LD_LIBRARY_PATH
// first, then /usr/local/cuda/lib64) instead of linked: see
// third_party/lazy_library.h for why. The binaries link the CUDA backend on
// every machine but need cuBLAS only where a GPU runs it. Where the library
// is absent each returns CUBLAS_STATUS_NOT_INITIALIZED.

#include <cublas_api.h>

#include "third_party/lazy_library.h"

#define SPECSERVE_STR2(x) #x
#define SPECSERVE_STR(x) SPECSERVE_STR2(x)

namespace {

void* Cublas() {
  static void* const handle = specserve::lazy_library::LoadFirst(
      {"libcublas.so." SPECSERVE_STR(CUBLAS_VER_MAJOR),
       "/usr/local/cuda/lib64/libcublas.so." SPECSERVE_STR(CUBLAS_VER_MAJOR)});
  return handle;
}

}  // namespace

// Each entry point caches its resolved pointer in a function-local static.
#define SPECSERVE_CUBLAS_FORWARD(ret, name, params, args, missing)       \
  extern "C" ret CUBLASWINAPI name params {                              \
    using Fn = ret(CUBLASWINAPI*) params;                                \
    static const Fn fn =                                                 \
        specserve::lazy_library::Resolve<Fn>(Cublas(), #name);           \
    if (fn == nullptr) return missing;                                   \
    return fn args;                                                      \
  }

SPECSERVE_CUBLAS_FORWARD(cublasStatus_t, cublasCreate_v2,
                         (cublasHandle_t * handle), (handle),
                         CUBLAS_STATUS_NOT_INITIALIZED)
SPECSERVE_CUBLAS_FORWARD(cublasStatus_t, cublasDestroy_v2,
                         (cublasHandle_t handle), (handle),
                         CUBLAS_STATUS_NOT_INITIALIZED)
SPECSERVE_CUBLAS_FORWARD(cublasStatus_t, cublasSetStream_v2,
                         (cublasHandle_t handle, cudaStream_t stream),
                         (handle, stream), CUBLAS_STATUS_NOT_INITIALIZED)
SPECSERVE_CUBLAS_FORWARD(cublasStatus_t, cublasSetWorkspace_v2,
                         (cublasHandle_t handle, void* workspace,
                          size_t workspaceSizeInBytes),
                         (handle, workspace, workspaceSizeInBytes),
                         CUBLAS_STATUS_NOT_INITIALIZED)
SPECSERVE_CUBLAS_FORWARD(
    cublasStatus_t, cublasGemmEx,
    (cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
     int m, int n, int k, const void* alpha, const void* A,
     cudaDataType Atype, int lda, const void* B, cudaDataType Btype, int ldb,
     const void* beta, void* C, cudaDataType Ctype, int ldc,
     cublasComputeType_t computeType, cublasGemmAlgo_t algo),
    (handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta,
     C, Ctype, ldc, computeType, algo),
    CUBLAS_STATUS_NOT_INITIALIZED)
SPECSERVE_CUBLAS_FORWARD(const char*, cublasGetStatusName,
                         (cublasStatus_t status), (status),
                         "CUBLAS_STATUS_NOT_INITIALIZED")
SPECSERVE_CUBLAS_FORWARD(const char*, cublasGetStatusString,
                         (cublasStatus_t status), (status),
                         "libcublas could not be loaded")
