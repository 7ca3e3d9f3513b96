#ifndef SPECSERVE_COMMON_CUDA_DEVICE_BUFFER_H_
#define SPECSERVE_COMMON_CUDA_DEVICE_BUFFER_H_

#include <cstddef>

#include "absl/status/statusor.h"

namespace specserve {

/// Sub-buffers carved from one device allocation start on 256-byte
/// boundaries (cudaMalloc's alignment): kernels use 16-byte vector loads
/// and WMMA needs 32-byte aligned tiles.
inline constexpr size_t kDeviceAlignment = 256;

/// `bytes` rounded up to kDeviceAlignment.
inline size_t AlignDeviceBytes(size_t bytes) {
  return (bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment;
}

/// Carves aligned regions out of one allocation: a dry run from a null
/// base sizes them (size(), every Take null), then the same calls against
/// the real base pointer give the regions. Host arithmetic only.
class DeviceCarver {
 public:
  explicit DeviceCarver(char* base) : base_(base) {}
  /// The next region of `bytes` (null in a dry run), kDeviceAlignment-
  /// aligned when the base is.
  void* Take(size_t bytes) {
    void* p = base_ == nullptr ? nullptr : base_ + offset_;
    offset_ = AlignDeviceBytes(offset_ + bytes);
    return p;
  }
  /// Bytes taken so far, each region padded to kDeviceAlignment.
  size_t size() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

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
