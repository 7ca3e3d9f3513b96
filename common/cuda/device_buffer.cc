#include "common/cuda/device_buffer.h"

#include <cuda_runtime_api.h>

#include <utility>

#include "common/cuda/cuda_status.h"

namespace specserve {

DeviceBuffer::~DeviceBuffer() { Release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::Release() {
  if (ptr_ != nullptr) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer buf;
  if (bytes == 0) return buf;
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    // Out-of-memory is not sticky: clear it so that the next launch check
    // (cudaGetLastError) does not report it again.
    cudaGetLastError();
    return CudaStatus(err, "cudaMalloc");
  }
  buf.ptr_ = p;
  buf.bytes_ = bytes;
  return buf;
}

absl::Status DeviceBuffer::Reserve(size_t bytes) {
  if (bytes <= bytes_) return absl::OkStatus();
  // Pending work may still read the old allocation; cudaFree synchronises
  // the device first, so releasing before allocating is safe.
  Release();
  absl::StatusOr<DeviceBuffer> fresh = Allocate(bytes);
  if (!fresh.ok()) return fresh.status();
  *this = *std::move(fresh);
  return absl::OkStatus();
}

}  // namespace specserve
