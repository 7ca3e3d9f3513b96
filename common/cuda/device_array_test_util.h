#ifndef SPECSERVE_COMMON_CUDA_DEVICE_ARRAY_TEST_UTIL_H_
#define SPECSERVE_COMMON_CUDA_DEVICE_ARRAY_TEST_UTIL_H_

// Device memory for the kernel tests: one cudaMalloc'ed array with the
// error kept for the test to assert on (tests run their launches through
// plain cudaError_t, so a failed allocation shows as the first failed
// call instead of a crash).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace testing_cuda {

/// Whether the device is common/cuda/emu's CPU emulation (the *_emu_test
/// twins), where a launch costs host time per emulated thread: tests size
/// their slowest cases down there, never their checks.
inline bool EmulatedDevice() {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  return std::string(prop.name).find("emulator") != std::string::npos;
}

/// `bytes` of device memory (at least 16, so never null); error() holds
/// cudaMalloc's result. Move-free, freed on destruction.
class DeviceArray {
 public:
  explicit DeviceArray(size_t bytes) {
    err_ = cudaMalloc(&ptr_, std::max<size_t>(bytes, 16));
  }
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  /// Copies `host` to the start of the array (synchronous); the allocation
  /// error if there was one. The array must hold host.size() elements.
  template <typename T>
  cudaError_t Upload(const std::vector<T>& host) {
    if (err_ != cudaSuccess || host.empty()) return err_;
    return cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T),
                      cudaMemcpyHostToDevice);
  }
  /// Copies the first host->size() elements back (synchronous).
  template <typename T>
  cudaError_t Download(std::vector<T>* host) const {
    if (err_ != cudaSuccess || host->empty()) return err_;
    return cudaMemcpy(host->data(), ptr_, host->size() * sizeof(T),
                      cudaMemcpyDeviceToHost);
  }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  cudaError_t error() const { return err_; }

 private:
  void* ptr_ = nullptr;
  cudaError_t err_ = cudaSuccess;
};

}  // namespace testing_cuda
}  // namespace specserve

#define ASSERT_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

#endif  // SPECSERVE_COMMON_CUDA_DEVICE_ARRAY_TEST_UTIL_H_
