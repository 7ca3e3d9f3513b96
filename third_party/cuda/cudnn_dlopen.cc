// The cuDNN 9 entry points the project calls (the handle and the backend
// "graph" API of cudnn_graph.h), with the toolkit headers' exact C
// signatures, each forwarding to the symbol of the same name in
// libcudnn.so.<major>, dlopen'ed on first use (LD_LIBRARY_PATH first, then
// /usr/local/cuda/lib64) instead of linked, as cuBLAS is (cublas_dlopen.cc,
// lazy_library.h). The GPU machine has no cuDNN in its toolkit; its PyTorch
// wheel carries one, which tools/gpu/gpu_env.sh puts on LD_LIBRARY_PATH.
// libcudnn.so.9 loads its engine sub-libraries itself. Where the library is
// absent each returns CUDNN_STATUS_NOT_INITIALIZED (cudnnGetVersion: 0).

#include <cudnn_graph.h>

#include "third_party/lazy_library.h"

#define SPECSERVE_STR2(x) #x
#define SPECSERVE_STR(x) SPECSERVE_STR2(x)

namespace {

void* Cudnn() {
  static void* const handle = specserve::lazy_library::LoadFirst(
      {"libcudnn.so." SPECSERVE_STR(CUDNN_MAJOR),
       "/usr/local/cuda/lib64/libcudnn.so." SPECSERVE_STR(CUDNN_MAJOR)});
  return handle;
}

}  // namespace

// Each entry point caches its resolved pointer in a function-local static.
#define SPECSERVE_CUDNN_FORWARD(ret, name, params, args, missing)        \
  extern "C" ret CUDNNWINAPI name params {                               \
    using Fn = ret(CUDNNWINAPI*) params;                                 \
    static const Fn fn =                                                 \
        specserve::lazy_library::Resolve<Fn>(Cudnn(), #name);            \
    if (fn == nullptr) return missing;                                   \
    return fn args;                                                      \
  }

SPECSERVE_CUDNN_FORWARD(size_t, cudnnGetVersion, (void), (), 0)
SPECSERVE_CUDNN_FORWARD(const char*, cudnnGetErrorString,
                        (cudnnStatus_t status), (status),
                        "libcudnn could not be loaded")
extern "C" void CUDNNWINAPI cudnnGetLastErrorString(char* message,
                                                    size_t max_size) {
  using Fn = void(CUDNNWINAPI*)(char*, size_t);
  static const Fn fn = specserve::lazy_library::Resolve<Fn>(
      Cudnn(), "cudnnGetLastErrorString");
  if (fn != nullptr) {
    fn(message, max_size);
  } else if (message != nullptr && max_size > 0) {
    message[0] = '\0';
  }
}
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnCreate, (cudnnHandle_t * handle),
                        (handle), CUDNN_STATUS_NOT_INITIALIZED)
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnDestroy, (cudnnHandle_t handle),
                        (handle), CUDNN_STATUS_NOT_INITIALIZED)
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnSetStream,
                        (cudnnHandle_t handle, cudaStream_t streamId),
                        (handle, streamId), CUDNN_STATUS_NOT_INITIALIZED)
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnBackendCreateDescriptor,
                        (cudnnBackendDescriptorType_t descriptorType,
                         cudnnBackendDescriptor_t* descriptor),
                        (descriptorType, descriptor),
                        CUDNN_STATUS_NOT_INITIALIZED)
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnBackendDestroyDescriptor,
                        (cudnnBackendDescriptor_t descriptor), (descriptor),
                        CUDNN_STATUS_NOT_INITIALIZED)
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnBackendFinalize,
                        (cudnnBackendDescriptor_t descriptor), (descriptor),
                        CUDNN_STATUS_NOT_INITIALIZED)
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnBackendSetAttribute,
                        (cudnnBackendDescriptor_t descriptor,
                         cudnnBackendAttributeName_t attributeName,
                         cudnnBackendAttributeType_t attributeType,
                         int64_t elementCount, const void* arrayOfElements),
                        (descriptor, attributeName, attributeType,
                         elementCount, arrayOfElements),
                        CUDNN_STATUS_NOT_INITIALIZED)
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnBackendGetAttribute,
                        (cudnnBackendDescriptor_t const descriptor,
                         cudnnBackendAttributeName_t attributeName,
                         cudnnBackendAttributeType_t attributeType,
                         int64_t requestedElementCount,
                         int64_t* elementCount, void* arrayOfElements),
                        (descriptor, attributeName, attributeType,
                         requestedElementCount, elementCount,
                         arrayOfElements),
                        CUDNN_STATUS_NOT_INITIALIZED)
SPECSERVE_CUDNN_FORWARD(cudnnStatus_t, cudnnBackendExecute,
                        (cudnnHandle_t handle,
                         cudnnBackendDescriptor_t executionPlan,
                         cudnnBackendDescriptor_t variantPack),
                        (handle, executionPlan, variantPack),
                        CUDNN_STATUS_NOT_INITIALIZED)
