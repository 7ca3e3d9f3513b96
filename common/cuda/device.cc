#include "common/cuda/device.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace specserve {

absl::string_view DeviceKindName(DeviceKind kind) {
  return kind == DeviceKind::kCuda ? "cuda" : "cpu";
}

bool CudaAvailable() {
  static std::once_flag once;
  static bool available = false;
  std::call_once(once, [] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    // Clear the error so that later runtime calls do not report it.
    cudaGetLastError();
    available = err == cudaSuccess && count > 0;
  });
  return available;
}

std::string CudaDeviceDescription() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::StrCat("no CUDA device (",
                        err == cudaSuccess ? "device count 0"
                                           : cudaGetErrorString(err),
                        ")");
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    cudaGetLastError();
    return "CUDA device 0 (properties unavailable)";
  }
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  return absl::StrFormat(
      "%s, sm_%d%d, %d SMs, %.1f GiB, driver %d.%d, runtime %d.%d", prop.name,
      prop.major, prop.minor, prop.multiProcessorCount,
      prop.totalGlobalMem / 1073741824.0, driver / 1000, (driver % 1000) / 10,
      runtime / 1000, (runtime % 1000) / 10);
}

bool CudaDeviceEmulated() {
  if (!CudaAvailable()) return false;
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return std::string(prop.name).find("emulator") != std::string::npos;
}

absl::StatusOr<CudaMemory> QueryCudaMemory() {
  CudaMemory m;
  const cudaError_t err = cudaMemGetInfo(&m.free_bytes, &m.total_bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cudaMemGetInfo: ", cudaGetErrorString(err)));
  }
  return m;
}

absl::StatusOr<DeviceKind> ParseDevice(const std::string& flag,
                                       bool gpu_present) {
  if (flag.empty() || flag == "auto") {
    return gpu_present ? DeviceKind::kCuda : DeviceKind::kCpu;
  }
  if (flag == "cpu") return DeviceKind::kCpu;
  if (flag == "cuda" || flag == "gpu") {
    if (!gpu_present) {
      return absl::FailedPreconditionError(
          absl::StrCat("--device=", flag,
                       " but no CUDA device is available; use --device=cpu"));
    }
    return DeviceKind::kCuda;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--device must be cpu, cuda or auto, got \"", flag, "\""));
}

}  // namespace specserve
