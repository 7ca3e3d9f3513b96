#ifndef SPECSERVE_COMMON_CUDA_DEVICE_BUFFER_H_
#define SPECSERVE_COMMON_CUDA_DEVICE_BUFFER_H_

#include <cstddef>

#include "absl/status/statusor.h"

namespace specserve {

/// Owns one cudaMalloc allocation (move-only; cudaFree on destruction).
/// A default-constructed buffer is empty (null, 0 bytes).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  /// Allocates `bytes` of device memory (uninitialised; 0 bytes gives an
  /// empty buffer). RESOURCE_EXHAUSTED when the device is out of memory,
  /// INTERNAL for other CUDA errors (no device included).
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);

  /// Ensures at least `bytes` are allocated; reallocates (contents lost)
  /// when smaller. Same errors as Allocate.
  absl::Status Reserve(size_t bytes);

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void Release();

  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_DEVICE_BUFFER_H_
