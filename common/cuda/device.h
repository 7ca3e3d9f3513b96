#ifndef SPECSERVE_COMMON_CUDA_DEVICE_H_
#define SPECSERVE_COMMON_CUDA_DEVICE_H_

// Backend selection: which ModelRunner (CpuModelRunner or
// CudaModelRunner) a service runs, from a `--device cpu|cuda` flag whose
// default is cuda when a GPU is present.

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace specserve {

/// The engine backend.
enum class DeviceKind { kCpu, kCuda };

/// "cpu" or "cuda".
absl::string_view DeviceKindName(DeviceKind kind);

/// True when the CUDA runtime reports at least one usable device
/// (cudaGetDeviceCount succeeds with a count >= 1). Never aborts: with no
/// driver, no device or CUDA_VISIBLE_DEVICES hiding every device the runtime
/// returns an error code and this returns false. The answer is computed once
/// per process and cached. Thread-safe.
bool CudaAvailable();

/// One line describing device 0 for logs and benchmark records, e.g.
/// "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.1 GiB, driver 13.0,
/// runtime 13.0"; "no CUDA device (<runtime error>)" otherwise.
std::string CudaDeviceDescription();

/// True when device 0 is common/cuda/emu's CPU emulation of a device (its
/// name says "emulator"): timing there measures the host, so start-up
/// choices made by timing kernels are skipped. False without a device.
bool CudaDeviceEmulated();

/// Device memory of the current device, in bytes (cudaMemGetInfo).
struct CudaMemory {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};

/// cudaMemGetInfo on the current device (creates the CUDA context when
/// there is none yet). FAILED_PRECONDITION naming the CUDA error when it
/// fails (no device included).
absl::StatusOr<CudaMemory> QueryCudaMemory();

/// Parses a `--device` flag value. `flag`: "cpu", "cuda" (alias "gpu"), or
/// "" / "auto" for the default: kCuda when `gpu_present`, else kCpu. Pass
/// CudaAvailable() as `gpu_present` (a parameter so callers and tests can
/// decide). Case-sensitive.
/// Errors: INVALID_ARGUMENT naming the value for anything else;
/// FAILED_PRECONDITION for "cuda" when !gpu_present.
absl::StatusOr<DeviceKind> ParseDevice(const std::string& flag,
                                       bool gpu_present);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_DEVICE_H_
